"""One request as the scheduler sees it: token counts, where its KV is, and the device blocks
and slot the ledger gave it (`SeqInfo`). The engine's record (`sequence.Sequence`) is one,
with its tokens; the simulator uses plain ones.

Token accounting. `computed` is how many tokens of a sequence have KV (in whichever tier
holds it); `context_len` = prompt + generated. After a whole prefill `computed ==
context_len` and the sampled token raises `generated` by one, so a decode step writes one
more KV row (computed + 1). A recompute preemption sets `computed` back to 0: the prompt and
the outputs so far are prefilled again (`to_prefill`).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field


class Location(enum.Enum):
    WAITING = "waiting"  # no KV (never prefilled, or preempted for recompute)
    DEVICE = "device"  # KV in the device store: decodable
    HOST = "host"  # KV in the host tier: must be swapped in before decoding
    FINISHED = "finished"


@dataclass(eq=False)
class SeqInfo:
    """One request as the scheduler sees it. Lengths in tokens."""

    seq_id: Hashable
    prompt_len: int
    max_output_len: int
    predicted_output_len: int | None = None  # e.g. from an output-length predictor
    first_prediction: int | None = None  # the predictor's first guess (its error is measured)
    generated: int = 0  # output tokens sampled so far
    computed: int = 0  # tokens whose KV exists (prefill progress, then one per decode step)
    location: Location = Location.WAITING
    arrival: int = 0  # admission order, set by SchedulerState.add (preemption picks the newest)
    blocks: list[int] = field(default_factory=list)  # device KV blocks held, in position order
    behind: int = 0  # of them, leading ones given back (FREED): behind every layer's window
    slot: int | None = None  # its device slot while it is in the device store
    cached_tokens: int = 0  # tokens of its context its last admission found in the prefix cache
    reads_cache: bool = True  # False: takes no cached prefix (prompt logprobs score every
    # position, so each is computed; its blocks are still cached for others)
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # of blocks[:len(this)]
    # The hashes of its context's first full blocks of known tokens, as far as the prefix
    # cache has hashed them (a memo: a block's tokens never change, so each is hashed once).
    hash_chain: list[bytes] = field(default_factory=list, repr=False)
    # n > 1: the other samples of its request, not in the state yet; they fork from it when
    # its prompt's prefill completes, sharing its prompt's blocks (`SchedulerState._fork`).
    forks: list[SeqInfo] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.prompt_len < 1 or self.max_output_len < 1:
            raise ValueError(f"sequence {self.seq_id!r}: prompt_len ({self.prompt_len}) and "
                             f"max_output_len ({self.max_output_len}) must be >= 1")

    @property
    def context_len(self) -> int:
        """Prompt plus generated tokens: what a (re)prefill must cover."""
        return self.prompt_len + self.generated

    @property
    def in_prefill(self) -> bool:
        """True until a (chunked) prefill of the whole context has sampled a token."""
        return self.generated == 0 or self.computed < self.context_len - 1

    @property
    def to_prefill(self) -> int:
        """Tokens still to prefill (prompt, plus outputs after a recompute preemption)."""
        return self.context_len - self.computed

    def token_ids(self, start: int, stop: int) -> list[int] | None:
        """Its context's token ids (prompt, then outputs) in [start, stop), as far as known;
        None if unknown: a plain SeqInfo carries only lengths (it never hits the cache)."""
        return None

    @property
    def expected_total(self) -> int:
        """Tokens of KV this sequence will hold at the end (predicted, else the maximum)."""
        out = self.predicted_output_len or self.max_output_len
        return self.prompt_len + min(out, self.max_output_len)
