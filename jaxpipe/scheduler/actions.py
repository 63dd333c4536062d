"""What a policy asks an executor to do next: one of four small actions.

- `Run`: one model step on the current layout — prefill chunks and/or decode one token for
  sequences on the device. `prefill_to_host` sends each completed prefill's KV to the host tier.
- `Switch`: re-shard the weights to the other layout (`phase` "prefill" or "decode").
- `SwapIn`: copy these sequences' KV from the host tier into the device store.
- `Preempt`: evict these device sequences, either to the host tier (`mode="swap"`) or by
  dropping their KV to be recomputed later (`mode="recompute"`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpipe.scheduler.seq_info import SeqInfo


class Kind(enum.Enum):
    RUN = "run"
    SWITCH = "switch"
    SWAP_IN = "swap_in"
    PREEMPT = "preempt"


@dataclass
class Run:
    """One step: `prefill` is [(seq, tokens of it to prefill now)], `decode` one token each."""

    prefill: list[tuple[SeqInfo, int]] = field(default_factory=list)
    decode: list[SeqInfo] = field(default_factory=list)
    prefill_to_host: bool = False
    kind = Kind.RUN

    @property
    def seqs(self) -> list[SeqInfo]:
        return [s for s, _ in self.prefill] + list(self.decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    def split(self, pieces: int) -> list[Run]:
        """This run as up to `pieces` runs of about as many tokens each (none empty): decodes
        dealt round-robin, each prompt chunk to the piece with the fewest tokens so far. A
        sequence stays in one piece. (How a one-micro-batch policy's run fills a pipeline.)"""
        parts = [Run(prefill_to_host=self.prefill_to_host) for _ in range(max(1, pieces))]
        for i, seq in enumerate(self.decode):
            parts[i % len(parts)].decode.append(seq)
        for seq, n in sorted(self.prefill, key=lambda p: -p[1]):
            min(parts, key=_tokens).prefill.append((seq, n))
        return [p for p in parts if p.seqs]

    def sampling(self) -> list[SeqInfo]:
        """Sequences that sample a token in this step: completed prefills and every decode.
        (Call before `SchedulerState.apply`, which advances the counts.)"""
        done = [s for s, n in self.prefill if n == s.to_prefill]
        return done + list(self.decode)


def _tokens(run: Run) -> int:
    return run.prefill_tokens + len(run.decode)


@dataclass
class Switch:
    """Re-shard the weights to the layout of `phase` ("prefill" or "decode")."""

    phase: str
    kind = Kind.SWITCH


@dataclass
class SwapIn:
    """Host tier -> device store for these sequences."""

    seqs: list[SeqInfo]
    kind = Kind.SWAP_IN


@dataclass
class Preempt:
    """Evict these device sequences: `mode` "swap" (to the host tier) or "recompute"."""

    seqs: list[SeqInfo]
    mode: str = "recompute"
    kind = Kind.PREEMPT

    def __post_init__(self):
        if self.mode not in ("swap", "recompute"):
            raise ValueError(f"preempt mode {self.mode!r}; accepted: 'swap', 'recompute'")


Action = Run | Switch | SwapIn | Preempt
