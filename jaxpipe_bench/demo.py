"""A real generation run on the default model (scripts/demo.py, `make demo`): chat prompts,
greedy and sampled, then a throughput line."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxpipe.config.checks import check_choices, check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import Dtype

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain what a CPU cache is in two sentences.",
    "What is 17 times 23?",
    "Name three planets in our solar system.",
]


@dataclass(frozen=True)
class DemoConfig:
    """The demo's model and answers (`scripts/demo.py`'s flags, jaxpipe.config.flags).

    model: a preset name or a path (EngineConfig.model)
    dtype: EngineConfig.dtype
    max_tokens: the most tokens of each answer
    """

    model: str = EngineConfig.model
    dtype: Dtype = EngineConfig.dtype
    max_tokens: int = 96

    def __post_init__(self):
        check_choices(self)
        check_counts(self, "max_tokens")


def run(config: DemoConfig, log: Callable[[str], None] = print) -> None:
    """Answer QUESTIONS greedily, then sampled, on one engine; log every answer and the
    output tok/s over both runs (compilation excluded)."""
    from jaxpipe import Engine, SamplingParams

    engine = Engine(EngineConfig(model=config.model, dtype=config.dtype, max_model_len=512,
                                 max_num_seqs=16))
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = [("greedy", SamplingParams(temperature=0.0, max_tokens=config.max_tokens)),
            ("sampled (T=0.7, top_p=0.9, seed=1)",
             SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=config.max_tokens))]
    generated, elapsed = 0, 0.0
    for label, params in runs:
        start = time.perf_counter()
        outputs = engine.chat(conversations, params)
        elapsed += time.perf_counter() - start
        log(f"\n===== {label} =====")
        for question, out in zip(QUESTIONS, outputs, strict=True):
            completion = out.outputs[0]
            generated += len(completion.token_ids)
            log(f"\n> {question}\n{completion.text.strip()}\n"
                f"  [{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]")
    stats = engine.stats()
    log(f"\nthroughput: {generated} tokens in {elapsed:.1f} s = {generated / elapsed:.1f} "
        f"output tok/s over {2 * len(QUESTIONS)} requests ({config.dtype}, batch of "
        f"{len(QUESTIONS)}; compile {stats['compile_seconds']:.1f} s excluded)")
