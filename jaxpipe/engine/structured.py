"""Structured outputs in the engine: each constrained sequence's grammar matcher, the token
bitmasks of a step's rows, and the matchers advanced by landed tokens.

    constraints.attach(seq)             # at add_request: a fresh matcher per sample
    mask = constraints.masks(sampled)   # [rows, W] i32 for the step's sampling inputs, or None
    reason = constraints.advance(seq, token)   # at land: "stop" once its grammar is complete

A constrained row's mask depends on its previous token, so with overlap a constrained sequence
skips the step after its own (the executor keeps it out until its token lands,
`Executor.waits`): the rows of the other sequences keep overlapping, and its mask is filled
while the device runs the step it skipped. A batch of constrained decodes alone is sent in two
halves that alternate (`Executor._halved`), so that one half's tokens land and its masks are
filled while the other half's step runs. The fill runs on llguidance's own threads
(`LLExecutor`, the GIL released), one call for all of a step's constrained rows. Only the
leader holds matchers: the masks travel in the sampling inputs to every process.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jaxpipe.request.errors import RequestError
from jaxpipe.request.grammar import Grammars, grammars_for, mask_width
from jaxpipe.scheduler import Sequence


class Constraints:
    """The grammar side of one engine: compiled constraints (cached) for its tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...] = (),
                 threads: int | None = None):
        """`eos_ids`: the model's end tokens (each allowed wherever a grammar may end)."""
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, tuple(eos_ids)
        self._threads = threads
        self._pool: llguidance.LLExecutor | None = None
        self.width = mask_width(vocab_size)

    @property
    def grammars(self) -> Grammars:
        if self._tokenizer is None:
            raise RequestError("sampling.structured_outputs", "structured outputs need the "
                               "model's tokenizer; this model has none")
        return grammars_for(self._tokenizer, self.vocab_size, self._eos)

    def attach(self, seqs: list[Sequence]) -> None:
        """Give each of a request's samples a fresh matcher of its constraint (compiled once
        per constraint); RequestError if it does not compile."""
        so = seqs[0].params.structured_outputs
        if so is None:
            return
        grammar = self.grammars.compile(so)
        for seq in seqs:
            seq.grammar = grammar.matcher()

    def masks(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Token bitmasks of `seqs`' rows [len(seqs), W] (all ones for an unconstrained
        row), or None when none is constrained."""
        rows = [(seq.grammar, i) for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        if self._pool is None:
            self._pool = llguidance.LLExecutor(self._threads)
        out = np.full((len(seqs), self.width), -1, np.int32)
        llg_numpy.fill_next_token_bitmask_par(self._pool, rows, out)
        return out

    @staticmethod
    def advance(seq: Sequence, token: int) -> str | None:
        """`seq`'s matcher takes its new `token`; "stop" once the grammar is complete (it
        can take no more, or took EOS) or, defensively, if it refused the token."""
        ok = seq.grammar.consume_token(token)
        return "stop" if not ok or seq.grammar.is_stopped() else None
