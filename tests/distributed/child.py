"""One process of the multi-process tests (tests/distributed/test_cluster.py): the leader
(process 0, or the only process) generates a fixed greedy workload and writes its tokens and
stats as JSON; a follower runs the leader's calls. Run as a script:

    python tests/distributed/child.py MODEL OUT.json --prefill pp=8 --decode tp=8 \
        --schedulers seesaw,prefill_first \
        [--coordinator 127.0.0.1:PORT --num-processes 2 --process-id I]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# Prime sizes (as tests/multidevice's TINY): a mis-split axis fails loudly.
TINY = dict(vocab_size=251, hidden_size=37, intermediate_size=53, num_layers=5, num_heads=14,
            num_kv_heads=7, head_dim=6, tie_embeddings=False, max_position_embeddings=512,
            eos_token_ids=(250,))
VOCAB = TINY["vocab_size"]
# Small device KV (96 tokens for 8 rows) and host tier: sequences are swapped and preempted.
SIZES = dict(mesh="cpu-8", max_num_seqs=8, kv_cache_tokens=96, host_kv_tokens=192,
             dtype="float32", max_model_len=64, warmup=False, show_progress=False,
             compilation_cache_dir=None)


def workload(shared: bool = False, prompt_logprobs: int | None = None):
    """12 greedy requests; `shared`: every other prompt starts with one 32-token stem (a
    prefix cache shares it, and a small pool evicts it to the host tier); `prompt_logprobs`:
    every other request asks for them."""
    from jaxpipe import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB - 1, rng.integers(3, 40)).tolist() for _ in range(12)]
    if shared:
        stem = rng.integers(0, VOCAB - 1, 32).tolist()
        prompts = [stem + p[:8] if i % 2 else p for i, p in enumerate(prompts)]
    lengths = rng.integers(4, 20, len(prompts))
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=i % 2 == 0,
                             prompt_logprobs=prompt_logprobs if i % 2 else None)
              for i, n in enumerate(lengths)]
    return prompts, params


def samples_workload():
    """6 greedy requests of n=2 samples, small enough for both samples to fit the pool."""
    from jaxpipe import SamplingParams

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB - 1, rng.integers(3, 22)).tolist() for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True, n=2)
              for n in rng.integers(3, 9, len(prompts))]
    return prompts, params


def save_tiny(path) -> None:
    """The tiny model with seeded random weights as an orbax checkpoint at `path`."""
    from jaxpipe.config.model import ModelConfig
    from jaxpipe.model import decoder, orbax_dir

    cfg = ModelConfig(**TINY)
    orbax_dir.save_orbax(path, cfg, decoder.numpy_random_values(cfg, seed=3), "float32")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--schedulers", required=True, help="comma-separated; one run each")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--prompt-logprobs", type=int)
    p.add_argument("--samples", action="store_true", help="requests of n=2 (samples_workload)")
    p.add_argument("--structured", action="store_true",
                   help="constrained requests beside others (tests/structured_workload.py; "
                        "MODEL must have a tokenizer)")
    a = p.parse_args(argv)
    from jaxpipe import Engine, EngineConfig
    from jaxpipe.engine.builder import follow

    schedulers = a.schedulers.split(",")
    config = EngineConfig(model=a.model, prefill=a.prefill, decode=a.decode,
                          scheduler=schedulers[0], coordinator=a.coordinator,
                          num_processes=a.num_processes, process_id=a.process_id,
                          prefix_caching=a.prefix_caching, **SIZES)
    if a.process_id:
        follow(config)
        return 0
    prompts, params = samples_workload() if a.samples else workload(a.prefix_caching,
                                                                      a.prompt_logprobs)
    runs = {}
    with Engine(config) as engine:
        for name in schedulers:
            engine.set_scheduler(name)
            engine.reset_stats()
            if a.structured:
                sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
                from structured_workload import mixed_run
                runs[name] = {"tokens": mixed_run(engine), "stats": engine.stats()}
                continue
            outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
            runs[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                          "samples": [[c.token_ids for c in o.outputs] for o in outs],
                          "stats": engine.stats()}
            if a.prompt_logprobs is not None:  # per request, per prompt token: [[id, lp], ...]
                runs[name]["prompt_logprobs"] = [
                    o.prompt_logprobs and [e and list(e.items()) for e in o.prompt_logprobs]
                    for o in outs]
    with open(a.out, "w") as f:
        json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
