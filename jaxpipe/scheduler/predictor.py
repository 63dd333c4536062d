"""Output-length predictors for TD-Pipe's greedy prefill (`tdpipe.py`).

A predictor says how many tokens a request will generate before it has generated them, and
learns from requests as they finish:

- `oracle`: the true length where the executor knows it (the simulator, where every request
  runs to `max_output_len`); on the engine it is the request's `max_tokens` (an upper bound).
  For ablations only.
- `learned`: learns online from finished requests, with no model to train offline (TD-Pipe
  uses a BERT classifier trained on 60% of its dataset; we have no such data here). It predicts
  the mean output length of finished requests whose prompt length falls in the same
  power-of-two bucket, once the bucket has `min_count` of them, else the mean over all finished
  requests, else `prior`. Why this: prompt length is the one feature every request has without
  running a model, the classifier's output is itself a class mean (the paper assigns each
  class its training mean), and what Algorithm 1 needs is the *sum* over hundreds of requests,
  whose error a mean estimator keeps small (the paper's Fig. 14). Where prompt and output
  lengths are independent (our synthetic ShareGPT) the buckets carry no signal and it
  converges to the global mean, which is still what the sum needs.

`accumulated_error(pairs, group)` is the paper's Fig. 14 metric: over consecutive groups of
`group` requests, the mean relative error of the predicted total output against the actual.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from jaxpipe.scheduler.seq_info import SeqInfo

DEFAULT_PRIOR = 256  # tokens predicted before any request finished
MIN_COUNT = 8  # finished requests a prompt-length bucket needs before it is used


class Oracle:
    """The request's own `max_output_len` (the true length in the simulator)."""

    name = "oracle"

    def predict(self, seq: SeqInfo) -> int:
        return seq.max_output_len

    def observe(self, seq: SeqInfo) -> None:
        pass


class Learned:
    """Mean output length per power-of-two prompt-length bucket, learned from finished ones."""

    name = "learned"

    def __init__(self, prior: int = DEFAULT_PRIOR, min_count: int = MIN_COUNT):
        if prior < 1 or min_count < 1:
            raise ValueError(f"prior ({prior}) and min_count ({min_count}) must be >= 1")
        self.prior, self.min_count = prior, min_count
        self._sums: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # bucket -> [sum, n]
        self._total = [0, 0]

    @staticmethod
    def bucket(prompt_len: int) -> int:
        return max(prompt_len, 1).bit_length()

    def predict(self, seq: SeqInfo) -> int:
        total, n = self._sums.get(self.bucket(seq.prompt_len), (0, 0))
        if n < self.min_count:
            total, n = self._total
        guess = round(total / n) if n else self.prior
        return max(1, min(guess, seq.max_output_len))

    def observe(self, seq: SeqInfo) -> None:
        """`seq` finished: its `generated` is its true output length."""
        for acc in (self._sums[self.bucket(seq.prompt_len)], self._total):
            acc[0] += seq.generated
            acc[1] += 1


PREDICTORS = {"oracle": Oracle, "learned": Learned}


def make_predictor(name: str):
    if name not in PREDICTORS:
        raise ValueError(f"unknown output-length predictor {name!r}; accepted: "
                         f"{sorted(PREDICTORS)}")
    return PREDICTORS[name]()


def accumulated_error(pairs: Iterable[tuple[int, int]], group: int) -> float:
    """Mean over consecutive groups of `group` (predicted, actual) pairs of |sum predicted -
    sum actual| / sum actual (TD-Pipe Fig. 14); a trailing partial group is left out."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    pairs = list(pairs)  # TD-Pipe keeps the newest ones in a bounded deque
    errors = []
    for i in range(0, len(pairs) - group + 1, group):
        pred = sum(p for p, _ in pairs[i:i + group])
        actual = sum(a for _, a in pairs[i:i + group])
        errors.append(abs(pred - actual) / actual)
    return sum(errors) / len(errors) if errors else float("nan")
