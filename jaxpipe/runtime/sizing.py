"""How the engine divides memory: the device KV pool's blocks, the sequences on the device at
once, the host KV tier's tokens, and whether the pool and the weights fit.

The engine's builder (`engine/builder.py`) calls `size` once, with the bytes of its weights:
every figure (the pool's blocks, the sequences, the host tier's tokens) comes from that one
call. Explicit settings win (kv_cache_tokens,
then kv_cache_gb; host_kv_tokens, then host_kv_gb); defaults take a fraction of the free
memory (`jaxpipe.runtime.memory`, which reads it) after the weights and the activation reserve.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax.numpy as jnp

from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels.paged import storage_dtype
from jaxpipe.kv import device_cache
from jaxpipe.model.decoder import param_decls
from jaxpipe.model.quantized import Quantization
from jaxpipe.runtime import memory, pipeline, sharding
from jaxpipe.runtime.kernel_choice import KernelChoice

ACCELERATOR_UTILIZATION = 0.9
# CPU: the pool's pages are taken only as blocks are written (`memory.zeros`), so a pool sized
# for a full batch (256 rows of a few hundred tokens: ~8 GiB of SmolLM2 bf16 KV on a 24 GiB
# machine) costs memory only as the batch fills it.
CPU_UTILIZATION = 0.4
HOST_TIER_FRACTION = 0.1
ASSUMED_FREE = 4 * 2**30  # where a backend reports nothing
ACTIVATION_FACTOR = 3
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default


@dataclass(frozen=True)
class Budget:
    """Bytes the engine may give its device KV pool and its host KV tier, and what set them
    (for messages): an explicit setting, or a fraction of the free memory; and what the rest
    of the engine was counted as taking: its weights (every copy it keeps) and the activation
    reserve of its largest step."""

    pool_bytes: float
    pool_setting: str
    host_bytes: float
    host_setting: str
    weight_bytes: int = 0
    reserve_bytes: int = 0


@dataclass(frozen=True)
class Sizes:
    """What `size` decided: the budget (the host tier's counted from the pool really made),
    the sequences on the device at once, the device pool's blocks and the host tier's
    tokens."""

    budget: Budget
    max_num_seqs: int
    num_blocks: int
    host_tokens: int


def size(config, model, dtype, layouts: dict, devices, weight_bytes: int,
         max_len: int) -> Sizes:
    """Size the engine for `config` and `model` (a ModelConfig) in `dtype` and `layouts` on
    `devices`: the weights take `weight_bytes`, a sequence at most `max_len` tokens. Raises a
    ValueError naming the setting when the pool cannot hold one sequence, or the pool and the
    weights do not fit in the devices' free memory."""
    kv = config.kv_cache_dtype
    block = block_bytes(model, dtype, layouts, kv)
    reserve = activation_bytes(model, max(config.max_num_batched_tokens,
                                          config.max_num_seqs or 0),
                               config.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    budget = budget_for(config, devices, weight_bytes, reserve, block)
    seqs = max_num_seqs(config, budget, block)
    blocks = num_blocks(budget, seqs, max_len, block)
    check_fits(budget, blocks * block, weight_bytes, devices)
    budget = with_host_tier(budget, config, devices, blocks * block, weight_bytes)
    return Sizes(budget, seqs, blocks, host_tokens(config, budget.host_bytes,
                                                   token_bytes(model, dtype, layouts, kv)))


def host_tokens(config, host_bytes: float, per_token: int) -> int:
    """Tokens the host KV tier holds: host_kv_tokens, else `host_bytes` at `per_token` bytes a
    token (`token_bytes`)."""
    if config.host_kv_tokens is not None:
        return config.host_kv_tokens
    return int(host_bytes // per_token)


def token_bytes(model, dtype, layouts: dict, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's K and V (every layer, the padded layers and KV heads) in one copy
    of the pool: what the host tier keeps of a swapped-out token (the pool's ep replicas are
    one array)."""
    ep = max(lo.ep for lo in layouts.values())
    return block_bytes(model, dtype, layouts, kv_cache_dtype) // ep // device_cache.BLOCK


def utilization(config, devices) -> float:
    """`memory_utilization`, or its default for the platform: 0.9 of an accelerator's free
    memory after the weights (vLLM's `gpu_memory_utilization`); 0.4 of the host's available
    RAM for CPU devices, which share it with the host KV tier, the compiled programs, the OS
    and other programs (the pool's pages are taken only as blocks are written,
    `memory.zeros`)."""
    if config.memory_utilization is not None:
        return config.memory_utilization
    return CPU_UTILIZATION if devices[0].platform == "cpu" else ACCELERATOR_UTILIZATION


def activation_bytes(model, tokens: int, rows: int) -> int:
    """An upper bound of the memory one step of `tokens` tokens and `rows` sampled rows
    needs besides its arguments: f32 activations of one layer (residual, q/k/v, attention
    output, the MLP's gate, up and product, the experts') times ACTIVATION_FACTOR for XLA's
    temporaries, the rows' logits, and one f32 [V, E] buffer (the temporaries of the steps
    of 1024 tokens and more hold about that much more than their activations on CPU).
    Checked against XLA's `memory_analysis` in the tests."""
    e, f, d, v = model.hidden_size, model.mlp_width, model.head_dim, model.vocab_size
    per_token = 3 * e + (2 * model.num_heads + 2 * model.num_kv_heads) * d + 3 * f
    # Experts, as the CPU's dense path runs them (model/moe.py): every expert's gate, up
    # and product, and its output, for every token.
    per_token += model.num_experts * (3 * model.moe_intermediate_size + e)
    return 4 * (ACTIVATION_FACTOR * tokens * per_token + 3 * rows * v + v * e)


def model_bytes(model, dtype, quant: Quantization | None = None) -> int:
    """Bytes of the weights in `dtype` (unpadded); with `quant`, its quantized weights as
    stored (a byte a code, 4 a scale per output channel; a tied model's quantized LM head
    is the embedding too, `Quantization.tied`: no float embedding is kept; "gguf": the
    file's blocks, a tied head being the embedding's own)."""
    if quant is None:
        return model.num_params() * jnp.dtype(dtype).itemsize
    decls = param_decls(model)
    names = quant.names(decls)
    dropped = names + (("embed",) if quant.tied(decls) else ())
    plain = sum(math.prod(d.shape) for n, d in decls.items() if n not in dropped)
    return plain * jnp.dtype(dtype).itemsize + sum(quant.stored_bytes(n, decls) for n in names)


def block_bytes(model, dtype, layouts: dict, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV block (K and V, every layer), as stored: with the layers and KV heads
    the layouts pad to (SmolLM2 on tp=8: 8 KV heads for 3, 32 layers for 30 — 2.8x the
    unpadded bytes), times the largest ep degree (the pool is replicated over ep). An int8
    cache (`kv_cache_dtype`) stores D + 2 bytes a token and head (codes and a bf16 scale)."""
    stored = storage_dtype(dtype, "cpu", kv_cache_dtype)  # bf16 and its u16 bits: 2 bytes
    shape = sharding.kv_shape(model, sharding.padding_for(model, layouts.values()), 1, stored)
    ep = max(lo.ep for lo in layouts.values())
    return 2 * math.prod(shape) * stored.itemsize * ep


def budget_for(config, devices, weight_bytes: int, reserve_bytes: int,
               block_bytes: int) -> Budget:
    """The device pool's budget: kv_cache_tokens, then kv_cache_gb, else `utilization` of
    the devices' free memory after the weights and `reserve_bytes`. The host tier's is filled
    in by `with_host_tier` once the pool's real size is known."""
    if config.kv_cache_tokens is not None:
        blocks = device_cache.blocks_for(config.kv_cache_tokens)
        pool = float(blocks * block_bytes)
        pool_setting = f"kv_cache_tokens={config.kv_cache_tokens}"
    elif config.kv_cache_gb is not None:
        pool, pool_setting = config.kv_cache_gb * 2**30, f"kv_cache_gb={config.kv_cache_gb}"
    else:
        pool, pool_setting = _pool_from_free(config, devices, weight_bytes, reserve_bytes)
    return Budget(pool, pool_setting, 0.0, "", weight_bytes, reserve_bytes)


def max_num_seqs(config, budget: Budget, block_bytes: int) -> int:
    """Sequences on the device at once: the configured number, or 256 (vLLM's default), as
    long as the pool has a block for each. Not sized by max_model_len per sequence: each
    takes blocks as it grows, and the scheduler preempts when the pool fills."""
    if config.max_num_seqs is not None:
        return config.max_num_seqs
    return max(1, min(DEFAULT_MAX_NUM_SEQS, int(budget.pool_bytes // block_bytes)))


def num_blocks(budget: Budget, num_seqs: int, max_len: int, block_bytes: int) -> int:
    """Blocks in the device KV pool: the budget, at most what num_seqs sequences of max_len
    could use, at least one max_len sequence."""
    per_seq = device_cache.blocks_for(max_len)
    blocks = int(budget.pool_bytes // block_bytes)
    if blocks < per_seq:
        raise ValueError(f"the device KV store ({budget.pool_setting}: "
                         f"{blocks * device_cache.BLOCK} tokens) cannot hold one sequence of "
                         f"max_model_len={max_len} ({per_seq * block_bytes / 2**30:.2f} GiB); "
                         "raise it or lower max_model_len")
    return min(blocks, num_seqs * per_seq)


def check_fits(budget: Budget, pool_bytes: int, weight_bytes: int, devices) -> None:
    """Fail at construction, naming the setting, when the device KV pool and the weights do
    not fit in the memory the devices have free."""
    free = memory.free_bytes(devices)
    if free is None or pool_bytes + weight_bytes <= free:
        return
    raise ValueError(f"EngineConfig.{budget.pool_setting}: the device KV pool needs "
                     f"{pool_bytes:,} bytes and the weights {weight_bytes:,}, but only "
                     f"{free:,} bytes are free on {devices[0].platform} "
                     f"({memory.describe(devices)}); lower it")


def with_host_tier(budget: Budget, config, devices, pool_bytes: int,
                   weight_bytes: int) -> Budget:
    """`budget` with the host tier's: host_kv_tokens (`host_tokens` takes it as is), then
    host_kv_gb, else HOST_TIER_FRACTION of the host's available RAM (less the device pool of
    `pool_bytes` and the weights on CPU, where they live in the same RAM). The tier only
    takes memory for the sequences it holds; its budget is a cap."""
    if config.host_kv_tokens is not None:
        host, setting = 0.0, f"host_kv_tokens={config.host_kv_tokens}"
    elif config.host_kv_gb is not None:
        host, setting = config.host_kv_gb * 2**30, f"host_kv_gb={config.host_kv_gb}"
    else:
        ram = memory.host_available_bytes() or ASSUMED_FREE
        if devices[0].platform == "cpu":
            ram = max(0, ram - pool_bytes - weight_bytes)
        host = HOST_TIER_FRACTION * ram
        setting = f"{HOST_TIER_FRACTION} of {ram / 2**30:.1f} GiB of available host RAM"
    return dataclasses.replace(budget, host_bytes=host, host_setting=setting)


def _pool_from_free(config, devices, weight_bytes: int, reserve_bytes: int):
    """`utilization` of what the devices have free once the weights and the activation
    reserve are taken (so a busy machine gets a smaller pool, not a failure, while the
    weights fit)."""
    free = memory.free_bytes(devices)
    where = memory.describe(devices) if free is not None else "not reported; assumed"
    free = ASSUMED_FREE if free is None else free
    share = utilization(config, devices)
    pool = share * (free - weight_bytes - reserve_bytes)
    setting = (f"memory_utilization={share} of the {free / 2**30:.1f} GiB free ({where}) "
               f"less {weight_bytes / 2**30:.2f} GiB of weights and "
               f"{reserve_bytes / 2**30:.2f} GiB of activations")
    return max(0.0, pool), setting


def weight_bytes(cfg, dtype, layouts: dict, devices, kernels,
                 quant: Quantization | None = None) -> int:
    """Bytes of the weights a runner holds: every copy it keeps (`weight_copies`), the packed
    LM head (`packed_head_bytes`) included; `quant`: the weights quantized at load."""
    packed = packed_head_bytes(cfg, dtype, layouts, devices, kernels, quant)
    return (model_bytes(cfg, dtype, quant) + packed) * weight_copies(layouts, devices)


def weight_copies(layouts: dict[str, Layout], devices) -> int:
    """Copies of the weights a runner holds: on CPU one per distinct layout, since a switch
    back to a layout then reuses the weights it had instead of re-sharding them (device
    memory is host memory there: Seesaw reloads a switch's weight shards from a host copy,
    and the layout left is that copy); one elsewhere, where device memory is the KV pool's."""
    return len(set(layouts.values())) if devices[0].platform == "cpu" else 1


def packed_head_bytes(cfg: ModelConfig, dtype, layouts: dict[str, Layout], devices,
                      kernels: KernelChoice | None, quant: Quantization | None = None) -> int:
    """Bytes a runner adds to the weights: the LM head's copy in panel order when the head is
    tied to the embedding and the kernel multiplies it in some layout (a quantized head is
    counted by `model_bytes`). Measures (through `kernels`) every matmul of every layout it
    has not seen, so that a runner made next finds them measured."""
    kernels = kernels if jnp.dtype(dtype) == jnp.bfloat16 else None
    padding = sharding.padding_for(cfg, layouts.values())
    heads = [pipeline.kernel_matmuls(cfg, padding, sharding.param_shardings(
        cfg, padding, layout, sharding.make_mesh(layout, devices), quant), kernels, layout)[1]
        for layout in set(layouts.values())]
    if not cfg.tie_embeddings or not any(heads) or (quant is not None and quant.lm_head):
        return 0
    return cfg.hidden_size * cfg.vocab_size * jnp.dtype(dtype).itemsize
