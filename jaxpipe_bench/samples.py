"""n samples of one request against one sample (`scripts/bench_samples.py`): the prompt is
prefilled once and its samples share its blocks, so n samples of a long prompt with few new
tokens should cost little more than one. In one process, on one engine (prefix cache off, so
no run finds another's prompt), alternating: a request of one sample, then one of `samples`,
each on a prompt of its own, `repeats` times; the ratio of the medians (and of the fastest of
each), with the machine it ran on and the engine's prompt / prefill token counts for one
request of `samples` (the prompt counted once; each sample past the first computes its last
token again).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxpipe.config.checks import check_counts
from jaxpipe.config.engine import EngineConfig
from jaxpipe.config.model import Dtype
from jaxpipe_bench.report import machine_info


@dataclass(frozen=True)
class SamplesBenchConfig:
    """What `scripts/bench_samples.py` runs (its flags).

    samples: n of the compared request
    input_len: tokens of every prompt
    output_len: tokens each sample generates (greedy, ignore_eos)
    repeats: timed pairs (one sample, then n), after one untimed pair (compiles)
    model: model preset or path
    dtype: EngineConfig.dtype
    json_path: where the JSON goes
    """

    samples: int = 8
    input_len: int = 1500
    output_len: int = 4
    repeats: int = 6
    model: str = EngineConfig.model
    dtype: Dtype = EngineConfig.dtype
    json_path: str = field(default="out/bench_samples.json", metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_counts(self, "samples", "input_len", "output_len", "repeats")


def prompt(config: SamplesBenchConfig, k: int, vocab: int) -> list[int]:
    """Prompt `k`: its own tokens (no two prompts share a first block)."""
    return [(13 * i + 7 * k + 1) % (vocab - 2) + 1 for i in range(config.input_len)]


def run(config: SamplesBenchConfig) -> dict:
    """Time the pairs; the record (JSON-able), also written to `config.json_path`."""
    from jaxpipe import Engine, SamplingParams

    engine = Engine(model=config.model, dtype=config.dtype, prefix_caching=False,
                    max_model_len=config.input_len + config.output_len,
                    max_num_seqs=max(config.samples, 1), show_progress=False)
    vocab = engine.model_config.vocab_size

    def timed(k: int, n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=config.output_len, n=n,
                                ignore_eos=True)
        start = time.perf_counter()
        [out] = engine.generate(prompt_token_ids=[prompt(config, k, vocab)],
                                sampling_params=params)
        assert [len(c.token_ids) for c in out.outputs] == [config.output_len] * n
        return time.perf_counter() - start

    timed(0, 1), timed(1, config.samples)  # compiles every program the pairs use
    one, many = [], []
    for k in range(1, config.repeats + 1):
        one.append(timed(2 * k, 1))
        many.append(timed(2 * k + 1, config.samples))
    engine.reset_stats()
    timed(2 * config.repeats + 2, config.samples)
    stats = engine.stats()
    engine.close()
    record = {"config": asdict(config), "machine": machine_info(), "one_s": one, "n_s": many,
              "ratio_median": statistics.median(many) / statistics.median(one),
              "ratio_best": min(many) / min(one), "prompt_tokens": stats["prompt_tokens"],
              "prefill_tokens": stats["prefill_tokens"],
              "forked_samples": stats["forked_samples"]}
    out = Path(config.json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    return record


def format_record(record: dict) -> str:
    """The table: seconds per request of one sample and of n, the ratios, the machine."""
    c, m = record["config"], record["machine"]
    return "\n".join([
        f"CPU: {m['cpu_model']} x {m['cpu_count']} (load {m['loadavg_at_start'][0]:.1f})",
        f"{c['input_len']}-token prompts, {c['output_len']} new tokens a sample, {c['dtype']}",
        f"{'request':>12} {'median s':>9} {'best s':>8}",
        f"{'n=1':>12} {statistics.median(record['one_s']):9.3f} {min(record['one_s']):8.3f}",
        f"{'n=' + str(c['samples']):>12} {statistics.median(record['n_s']):9.3f} "
        f"{min(record['n_s']):8.3f}",
        f"n={c['samples']} / n=1: {record['ratio_median']:.2f}x (medians), "
        f"{record['ratio_best']:.2f}x (best)",
        f"one n={c['samples']} request: prompt_tokens {record['prompt_tokens']}, "
        f"prefill_tokens {record['prefill_tokens']}, forked_samples {record['forked_samples']}",
    ])
