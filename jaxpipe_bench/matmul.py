"""Machine matmul throughput in JAX, and the model FLOP count it is compared against.

The benchmark reports jaxpipe's achieved model FLOP/s as a fraction of what a plain jitted
`jnp.dot` reaches on this machine in the same dtype: a "model FLOPs utilisation" against a
measured, not a datasheet, peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxpipe_peers.protocol import seconds_per_call

# (m, k, n) shapes. The first two are the model's own: 256 tokens through SmolLM2's MLP up/gate
# (576 -> 1536) and down (1536 -> 576) projections. The square one is large enough to approach
# the machine's compute peak, so the max over shapes is an upper bound on matmul throughput.
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (256, 576, 1536),
    (256, 1536, 576),
    (2048, 2048, 2048),
)


def _input_dtype(dtype: str) -> Any:
    """JAX dtype for the matmul inputs."""
    import jax.numpy as jnp

    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    return jnp.bfloat16 if dtype == "bfloat16" else jnp.float32


def measure_matmul_gflops(
    dtype: str = "bfloat16",
    m: int = 256,
    k: int = 576,
    n: int = 1536,
    repeats: int = 10,
    min_seconds: float = 0.05,
    impl: str = "xla",
) -> float:
    """GFLOP/s of a jitted `(m,k) @ (k,n)` matmul with f32 accumulation: XLA's dot, or (bf16
    only) the bf16 kernel's path `impl` on the weight in panel order.

    Inputs are `dtype` (bf16 or f32); the dot uses `preferred_element_type=float32`, as the
    model's matmuls do. The best of `repeats` (see `jaxpipe_peers.protocol.seconds_per_call`):
    a peak, and what other work on a shared machine disturbs least.
    """
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpipe.kernels import matmul

    in_dtype = _input_dtype(dtype)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (m, k), dtype=jnp.float32).astype(in_dtype)
    b = jax.random.normal(key_b, (k, n), dtype=jnp.float32).astype(in_dtype)
    if impl == "xla":
        dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    else:
        dot, b = jax.jit(functools.partial(matmul.bf16_matmul, path=impl)), matmul.pack(b)
    # Each call waits for the one before: back to back, independent calls may run at once on
    # XLA's threads and compete for the cores (the kernel's measured ~40% low that way).
    seconds = seconds_per_call(
        lambda: dot(a, b).block_until_ready(), lambda out: out, repeats, min_seconds, min
    )
    return 2.0 * m * k * n / seconds / 1e9


def measure_peak_gflops(
    dtype: str = "bfloat16",
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
    repeats: int = 10,
) -> dict:
    """Median GFLOP/s for each shape and implementation, and `peak_gflops` = the max.

    Implementations: XLA's dot, and in bf16 each path of the bf16 kernel this machine has (on
    an AVX2-only CPU XLA's bf16 dot runs at a fraction of what the FMA units do, so it alone
    would be no ceiling). The max is the denominator of the utilisation figure: the best this
    machine's matmuls were seen to do, which makes the reported fraction conservative. (torch's
    figure on the same shapes comes from the HF peer, `jaxpipe_peers.hf.torch_matmul_gflops`.)
    """
    from jaxpipe.kernels import matmul

    impls = ("xla", *(matmul.paths() if dtype == "bfloat16" else ()))
    per_shape = [
        {"m": m, "k": k, "n": n, "impl": impl,
         "gflops": measure_matmul_gflops(dtype, m, k, n, repeats, impl=impl)}
        for m, k, n in shapes for impl in impls
    ]
    return {
        "backend": "jax",
        "dtype": dtype,
        "accumulate": "float32",
        "statistic": "max over shapes and implementations of the best of repeats",
        "shapes": per_shape,
        "peak_gflops": max(s["gflops"] for s in per_shape),
        "peak_impl": max(per_shape, key=lambda s: s["gflops"])["impl"],
    }


def _linear_params_per_layer(cfg: Any) -> int:
    """Weights of one decoder layer's matmuls (q, k, v, o projections and the gated MLP)."""
    q_out = cfg.num_heads * cfg.head_dim
    kv_out = cfg.num_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * (q_out + 2 * kv_out) + q_out * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    return attn + mlp


def model_flops(cfg: Any, prompt_lens: Sequence[int], output_lens: Sequence[int]) -> float:
    """Forward FLOPs needed to serve requests with these prompt and output lengths.

    Per request with prompt P and output O, the model runs forward over P + O - 1 tokens (the
    first output token comes from the prompt's last position, the last output token is never
    fed back). Counted:
      * 2 * (decoder matmul params) per forwarded token (norms, rotary, activations: ignored);
      * 2 * hidden * vocab (LM head, tied or not) per *generated* token only, since logits at
        other prompt positions are not needed;
      * attention 4 * layers * heads * head_dim * context per forwarded token (QK^T and PV),
        where the token at position t (1-based) attends t keys, i.e. causal over the sequence.
    Embedding lookups are gathers, not FLOPs.
    """
    body = 2.0 * cfg.num_layers * _linear_params_per_layer(cfg)
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size
    attn_per_key = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    total = 0.0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        tokens = p + o - 1
        context_sum = tokens * (tokens + 1) / 2  # sum over t = 1..tokens
        total += body * tokens + lm_head * o + attn_per_key * context_sum
    return total
