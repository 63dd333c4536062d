"""From a scheduled `Run` to what the runner dispatches: pieces, step inputs, sampling inputs.

    step = builder.build(run, flight)    # one piece per prompt chunk and decode token
    sampling_inputs = sampling_inputs_for(step.sampled, rows)

A prompt chunk is its next context tokens, from `computed` (past a cached prefix: see
`SchedulerState`'s prefix caching; a sequence entering the device first gets its slot's penalty
state); a decode token is the sequence's newest token, from the host or, still in flight, fed
from the step in flight's sampled row on the device. Decode sequences whose KV is still being
swapped in sit this step out (the prefetcher keeps working meanwhile): `ready` takes them out
before the scheduler state gives the run the blocks it writes (`SchedulerState.launch`), which
the pieces then read from each sequence. Sampled rows come first (`step_inputs.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxpipe.engine.structured import Constraints
from jaxpipe.kv.manager import KVManager
from jaxpipe.request.params import SamplingParams
from jaxpipe.runtime import prompt_scores, sampling, step_inputs
from jaxpipe.runtime.buckets import Buckets
from jaxpipe.runtime.runner import Runner, SamplingInputs
from jaxpipe.runtime.step_inputs import Piece, StepInputs
from jaxpipe.scheduler import Run, SchedulerState, Sequence


@dataclass
class Step:
    """One ragged step, built: the run it carries (only the decodes that are ready), the
    sequences it samples (in row order), its inputs and token counts."""

    run: Run
    sampled: list[Sequence]
    to_host: list[tuple[Sequence, int]]  # completed prefills bound for the host tier: tokens
    inputs: StepInputs
    tokens: int  # real tokens
    padded: int  # tokens with the bucket's padding
    feeds: bool  # some token comes from the step in flight's sampled rows on the device
    score: prompt_scores.PromptScore | None = None  # its prompt positions to score
    scored: list[tuple[Sequence, int]] = field(default_factory=list)  # what each scores:
    # (sequence, index of the prompt token)

    @property
    def slots(self) -> np.ndarray:
        return np.array([s.slot for s in self.sampled], np.int32)


class StepBuilder:
    """Builds steps over one runner's token buckets, the blocks and slots the scheduler state
    gave each sequence, and the KV manager's swap-ins."""

    def __init__(self, runner: Runner, buckets: Buckets, state: SchedulerState, kv: KVManager,
                 constraints: Constraints | None = None):
        self.runner, self.buckets, self.state, self.kv = runner, buckets, state, kv
        self.constraints = constraints

    def ready(self, action: Run, launched: bool = False) -> Run:
        """`action` less the decodes whose KV is still being swapped in (they join a later
        step). `launched`: its micro-batches were launched already, so none may wait. A
        prompt chunk reading blocks a swap-in is still bringing (a sample forked from its
        parent as the parent came back) waits for it."""
        self.kv.await_blocks(b for seq, _ in action.prefill for b in seq.blocks)
        decode = self._ready_decodes(action.decode)
        if launched and len(decode) < len(action.decode):
            raise RuntimeError("a micro-batch decodes sequences whose KV is not on the device")
        return Run(prefill=action.prefill, decode=decode, prefill_to_host=action.prefill_to_host)

    def build(self, run: Run, flight) -> Step | None:
        """The step of `run`, whose sequences hold the blocks it writes (None if it is
        empty). `flight`: the step in flight (its sampled rows feed decode tokens the host
        has not seen)."""
        prefill = [self._prefill_piece(seq, n) for seq, n in run.prefill]
        pieces = [p for p in prefill if p[2]]
        pieces += [self._decode_piece(seq, flight) for seq in run.decode]
        pieces += [p for p in prefill if not p[2]]  # sampled rows first
        if not pieces:
            return None
        real = sum(len(piece.tokens) for _, piece, _ in pieces)
        tokens = self.buckets.tokens(real)
        inputs = step_inputs.build([piece for _, piece, _ in pieces], tokens,
                                   self.buckets.rows(tokens), self.runner.max_blocks)
        to_host = [(seq, piece.start + len(piece.tokens)) for seq, piece, done in prefill
                   if done and run.prefill_to_host]  # all but the token being sampled
        sampled = [seq for seq, _, samples in pieces if samples]
        step = Step(run, sampled, to_host, inputs, real, tokens,
                    any(p.feed >= 0 for _, p, _ in pieces))
        step.score, step.scored = prompt_positions(pieces, inputs)
        return step

    def sampling_inputs(self, step: Step) -> SamplingInputs:
        """The sampling inputs of `step`'s sampled rows, in a row bucket (with the token
        bitmasks of its constrained rows)."""
        mask = self.constraints.masks(step.sampled) if self.constraints is not None else None
        return sampling_inputs_for(step.sampled, self.buckets.sample_rows(len(step.sampled)),
                                   mask)


    def _ready_decodes(self, seqs: list[Sequence]) -> list[Sequence]:
        """The decode sequences whose KV is in the device pool (waits for a swap-in only
        when none is)."""
        if not seqs:
            return []
        self.kv.deliver()
        ready = [s for s in seqs if self.kv.decodable(s)]
        if not ready and self.kv.pending:
            self.kv.deliver(block=True)
            ready = [s for s in seqs if self.kv.decodable(s)]
        if not ready:
            raise RuntimeError(f"decode of {len(seqs)} sequences, none of them on the device")
        return ready

    def _prefill_piece(self, seq: Sequence, n: int) -> tuple[Sequence, Piece, bool]:
        """(seq, piece, samples) for the next `n` context tokens of `seq`'s prefill (a
        sequence that has just entered the device gets its slot's penalty state when it uses
        penalties). The chunk starts at `computed`: past a cached prefix, whose shared blocks
        lead `seq.blocks`, so its attention reads them."""
        if seq.computed == seq.cached_tokens:  # its first chunk since it entered the device
            restore_penalties(self.runner, seq)
        context = seq.prompt_token_ids + seq.output_token_ids
        start = seq.computed
        piece = Piece(context[start:start + n], start, list(seq.blocks))
        return seq, piece, start + n == len(context)

    def _decode_piece(self, seq: Sequence, flight) -> tuple[Sequence, Piece, bool]:
        """(seq, piece, True): `seq`'s newest token at its position: from the host, or (its
        token still in flight) from the step in flight's sampled row on the device."""
        position = seq.context_len - 1
        blocks = list(seq.blocks)
        if len(seq.output_token_ids) == seq.generated:
            return seq, Piece([seq.last_token], position, blocks), True
        row = flight.rows.get(seq, -1) if flight is not None else -1
        if row < 0:
            raise RuntimeError(f"{seq.request_id!r}'s newest token is in no step in flight")
        return seq, Piece([0], position, blocks, feed=row), True


def prompt_positions(pieces: list[tuple[Sequence, Piece, bool]], inputs: StepInputs
                     ) -> tuple[prompt_scores.PromptScore | None, list[tuple[Sequence, int]]]:
    """The step's prompt positions that score the prompt token after them, of the sequences
    asking for prompt logprobs (row r: pieces[r]), skipping tokens scored already (a
    recompute after preemption), and (sequence, prompt token index) of each."""
    entries, scored, num = [], [], 0
    for r, (seq, piece, _) in enumerate(pieces):
        if seq.params.prompt_logprobs is None:
            continue
        num = max(num, seq.params.prompt_logprobs)
        done = seq.prompt_logprobs or [None] * seq.prompt_len
        for p in prompt_scores.positions(piece.start, len(piece.tokens), seq.prompt_len):
            if done[p + 1] is None:
                entries.append((int(inputs.q_start[r]) + p - piece.start,
                                seq.prompt_token_ids[p + 1]))
                scored.append((seq, p + 1))
    return prompt_scores.build(entries, num), scored


def sampling_inputs_for(seqs: list[Sequence], rows: int, mask: np.ndarray | None = None
                        ) -> SamplingInputs:
    """Sampling inputs of `seqs`, padded with neutral rows to `rows`; `mask`: their token
    bitmasks (`Constraints.masks`), None when none is constrained."""
    neutral = SamplingParams(temperature=0.0)
    pad = rows - len(seqs)
    params = [s.params for s in seqs] + [neutral] * pad
    seeds = [s.seed for s in seqs] + [0] * pad
    steps = [s.generated for s in seqs] + [0] * pad  # tokens sampled before (in flight too)
    banned = [s.stop.banned(s.generated, s.output_token_ids) for s in seqs] + [[]] * pad
    tensors = sampling.build_sampling_tensors(params, seeds, steps, banned, rows, mask)
    mode = sampling.sampling_mode(s.params for s in seqs)
    penalties = sampling.uses_penalties(s.params for s in seqs)
    wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    return SamplingInputs(tensors, mode, penalties, max(wanted) if wanted else None)


def restore_penalties(runner, seq: Sequence) -> None:
    """`seq` took a slot (its prefill starts, or its KV was swapped in): its penalty state
    follows it into the slot's row on `runner`. The KV manager calls this on every insert."""
    if sampling.uses_penalties([seq.params]):
        runner.restore_penalties(seq.slot, seq.prompt_token_ids, seq.output_token_ids)
