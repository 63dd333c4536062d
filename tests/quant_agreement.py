"""How close a quantized engine is to its float twin, teacher-forced: both score the same
token sequences (`prompt_logprobs`), so one early flip of a near-tie cannot derail the rest
of a greedy continuation. Shared by tests/engine/test_quantization.py and
tests/multidevice/test_quantized_layouts.py."""

from __future__ import annotations

import numpy as np

from jaxpipe import SamplingParams


def scores(engine, seqs: list[list[int]]) -> list[list[dict[int, float] | None]]:
    """Each sequence's prompt logprobs (top 3 and the token itself) under `engine`."""
    outs = engine.generate(prompt_token_ids=seqs, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=3))
    return [o.prompt_logprobs for o in outs]


def agreement(want, got, seqs) -> tuple[float, float]:
    """(fraction of positions whose top-1 token agrees, median |logprob difference| of the
    sequence's own next token) between two engines' `scores` of `seqs`."""
    same, diffs = [], []
    for a, b, ids in zip(want, got, seqs, strict=True):
        for t in range(1, len(ids)):
            same.append(max(a[t], key=a[t].get) == max(b[t], key=b[t].get))
            diffs.append(abs(a[t][ids[t]] - b[t][ids[t]]))
    return float(np.mean(same)), float(np.median(diffs))
