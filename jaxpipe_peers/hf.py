"""HF transformers baseline: static-batch greedy generation over the benchmark workload.

This is the "what you get without a serving engine" reference: requests are cut into fixed
batches in workload order, each batch is left-padded and generated to its longest output. Only
each request's own output_len counts as output; the padding and the tokens generated past a
request's length are the cost of static batching, and are charged to HF's elapsed time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from jaxpipe_peers.protocol import Request, best_point, seconds_per_call, throughput

_TORCH_DTYPES = ("bfloat16", "float32")


def load_hf_model(model_dir: str, gguf_file: str | None, dtype: str,
                  device: str = "cpu") -> tuple[Any, int]:
    """Load the GGUF `gguf_file` in `model_dir` (None: the HF checkpoint `model_dir`) as a
    dense HF causal LM in `dtype` on torch `device`; return (model, pad token id).

    The GGUF is dequantized at load time (`GgufConfig(dequantize=True)`) so HF runs plain
    `dtype` matmuls, the same arithmetic jaxpipe does, rather than a packed-weight kernel.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5 keeps GGUF weights packed unless told otherwise
        from transformers import GgufConfig

        if gguf_file is not None:
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older releases always dequantize
        pass
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_file, dtype=getattr(torch, dtype), **kwargs
    )
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    return model, int(pad_id)


def _left_pad(batch: Sequence[Request], pad_id: int) -> tuple[Any, Any]:
    """(input_ids, attention_mask) for `batch`, left-padded to its longest prompt."""
    import torch

    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        input_ids[row, width - req.prompt_len :] = torch.tensor(req.prompt_token_ids)
        attention_mask[row, width - req.prompt_len :] = 1
    return input_ids, attention_mask


def _generate_batch(model: Any, batch: Sequence[Request], pad_id: int,
                    sampled: bool = False) -> int:
    """Generate one static batch, greedy or (`sampled`) at temperature 1; return the number of
    token slots HF computed."""
    input_ids, attention_mask = (x.to(model.device) for x in _left_pad(batch, pad_id))
    new_tokens = max(r.output_len for r in batch)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # never stop at EOS: every row runs to the batch maximum
        do_sample=sampled,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        pad_token_id=pad_id,
    )
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(
            f"HF generated {out.shape[1] - input_ids.shape[1]} tokens, expected {new_tokens}"
        )
    return int(out.shape[0] * out.shape[1])


def warm_up_hf(model: Any, pad_id: int, workload: Sequence[Request]) -> None:
    """One short generate, so first-call allocation/dispatch costs stay out of the timing."""
    import torch

    sample = [Request(r.prompt_token_ids, min(r.output_len, 4)) for r in workload[:2]]
    with torch.inference_mode():
        _generate_batch(model, sample, pad_id)


def run_hf(
    workload: Sequence[Request],
    batch_size: int,
    dtype: str,
    model_dir: str,
    gguf_file: str | None,
    *,
    model: Any = None,
    pad_id: int | None = None,
    max_seconds: float | None = None,
) -> dict:
    """Time HF static-batch generation of `workload` at `batch_size`.

    Pass a preloaded `model`/`pad_id` (from `load_hf_model`) to reuse it across a sweep;
    otherwise the model is loaded here (loading is never timed). With `max_seconds`, stops
    after the first batch that ends past the limit and reports throughput over the completed
    requests (`truncated: true`), an estimate rather than the full-workload number.
    """
    import torch

    if model is None or pad_id is None:
        model, pad_id = load_hf_model(model_dir, gguf_file, dtype)
    torch.set_num_threads(os.cpu_count() or 1)
    # a rollout's samples: one row each (HF shares no prompt between rows), sampled
    sampled = any(r.samples > 1 for r in workload)
    rows = [replace(r, samples=1) for r in workload for _ in range(r.samples)]
    done: list[Request] = []
    computed_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            computed_tokens += _generate_batch(model, batch, pad_id, sampled)
            done.extend(batch)
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
    elapsed = time.perf_counter() - start
    result = throughput(done, elapsed)
    result.update(
        engine="hf",
        dtype=dtype,
        batch_size=batch_size,
        truncated=len(done) < len(rows),
        computed_token_slots=computed_tokens,
        torch_threads=torch.get_num_threads(),
    )
    return result


def sweep_hf(
    workload: Sequence[Request],
    batch_sizes: Sequence[int],
    dtype: str,
    model_dir: str,
    gguf_file: str | None,
    max_seconds: float | None = None,
    log: Any = print,
    device: str = "cpu",
) -> dict:
    """Run `run_hf` at each batch size with one loaded model; return all points and the best.

    "Best" is the highest output tok/s. `max_seconds` caps each sweep point separately.
    """
    load_start = time.perf_counter()
    model, pad_id = load_hf_model(model_dir, gguf_file, dtype, device)
    log(f"[hf] loaded model in {time.perf_counter() - load_start:.1f}s")
    warm_up_hf(model, pad_id, workload)
    points = []
    for batch_size in batch_sizes:
        point = run_hf(
            workload,
            batch_size,
            dtype,
            model_dir,
            gguf_file,
            model=model,
            pad_id=pad_id,
            max_seconds=max_seconds,
        )
        log(
            f"[hf] batch {batch_size}: {point['output_tok_s']:.1f} output tok/s over "
            f"{point['num_requests']} requests in {point['elapsed_s']:.1f}s"
        )
        points.append(point)
    return {"points": points, "best": best_point(points)}


def torch_matmul_gflops(dtype: str, shapes: Sequence[Sequence[int]], repeats: int = 10,
                        min_seconds: float = 0.05) -> dict:
    """torch's (oneDNN's) GFLOP/s on the benchmark's matmul shapes, f32 accumulation inside:
    beside jax's peak it says whether the ceiling jaxpipe is measured against is XLA's dot or
    the hardware. Informational only."""
    import torch

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(0)
    per_shape = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(getattr(torch, dtype))
        b = torch.randn(k, n, generator=gen).to(getattr(torch, dtype))
        with torch.inference_mode():
            seconds = seconds_per_call(lambda a=a, b=b: a @ b, lambda out: None, repeats,
                                       min_seconds)
        per_shape.append({"m": m, "k": k, "n": n, "gflops": 2.0 * m * k * n / seconds / 1e9})
    return {"backend": "torch", "dtype": dtype, "shapes": per_shape,
            "peak_gflops": max(s["gflops"] for s in per_shape)}


def run_job(job: dict, requests: Sequence[Request], warmup: Sequence[Request]) -> dict:
    """A job file's HF sweep (`jaxpipe_peers.__main__`), plus torch's matmul GFLOP/s on the
    job's `matmul_shapes` when it names any."""
    from pathlib import Path

    model = Path(job["model"])
    model_dir, gguf_file = (str(model), None) if model.is_dir() else (str(model.parent),
                                                                      model.name)
    result = sweep_hf(requests, job["batch_sizes"], job["dtype"], model_dir, gguf_file,
                      max_seconds=job.get("max_seconds"),
                      log=lambda line: print(line, flush=True))
    if job.get("matmul_shapes"):
        result["torch_matmul"] = torch_matmul_gflops(job["dtype"], job["matmul_shapes"],
                                                     job.get("matmul_repeats", 10))
    return result
