"""The step's program on a mesh: one pipeline tick of ragged token batches, one micro-batch per
stage over `pp`, tensor parallelism over `tp` inside each stage. One device is the mesh
`pp=1,tp=1` running the same program, where a tick is a whole step.

A micro-batch is one flat batch of T tokens (`step_inputs.py`): each sequence contributes a
chunk of its context or one decode token, at its own positions, with its own block-table row.
Micro-batches flow through the stages across ticks (`tick_program`; the host side is
`runtime/flow.py`): in one tick stage s runs the micro-batch that entered s ticks earlier,
and after it the activations move one stage on with `lax.ppermute`, carried to the next tick
in a donated buffer. Nothing drains between steps: a stage idles only while the pipeline
fills or drains (a layout switch, the work running out), on an idle micro-batch whose KV
writes go to an out-of-range block, which the scatter drops. Inside a stage, per layer (the
decoder's own `decoder.layer`): project q/k/v for every token, write each token's K/V into its
sequence's blocks, attend each sequence's span over its paged KV (causal inside the span;
`StepAttention`), then the output projection and the MLP.

The step is one `jax.shard_map` over the whole mesh, manual over every axis, so every
collective is spelled out: each device holds its stage's layers (`layers` over pp), its
share of heads / mlp columns (over tp), whose partial products are summed with `psum`, and
under ep its share of an MoE layer's experts (over ep: the tokens routed to them, outputs
summed with a `psum` over ep; everything else is computed alike on the ep devices). The
last stage keeps the residual of each sequence's last token in the step ([R, E]); only those
go through the LM head (`logits_program`: the bf16 kernel on each device's vocab shard, or
XLA's dot partitioned from the vocab-split weights).

With `quantization` (`model/quantized.py`) the matmul weights are `QuantizedWeight`s (codes
and per-output-channel scales, sharded alike): the int8 kernel reads the ones the kernel
choice gives it in int8 panel order (`kernel_dot`, `REORDER`), XLA's int8 or fp8 dot the
rest (`decoder.xla_dot`). Activations are quantized per row on each device, so under tp a
row-split matmul's (wo, w_down) rows are quantized per shard.

With `quantization="gguf"` the matmul weights are a GGUF file's blocks (`GgufWeight`,
`model/gguf_quantized.py`), read in the file's order: no panel order, so every one is a
`StackedWeight` and the kernel choice picks, per row count, the GGUF kernel
(`kernels/gguf_matmul.py`, reading the stack in place) or XLA's reference of the format
(`gguf_dot`). The kernel has no gated mode: the fused gate is the [M, 2F] product, then
the gate in XLA. The LM head (a tied model's: the embedding's blocks) likewise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels import (
    attention_math,
    gguf_blocks,
    gguf_matmul,
    int8_matmul,
    matmul,
    pallas_attention,
    ragged_attention,
)
from jaxpipe.kernels.matmul import StackedWeight
from jaxpipe.kernels.paged import OUT_OF_RANGE, to_storage
from jaxpipe.kv.device_cache import BLOCK, KVCache
from jaxpipe.model import decoder, gguf_quantized, quantized
from jaxpipe.model.decoder import LAYER_PARAMS, HeadParams, LayerParams, param_decls
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.quantized import Quantization, QuantizedWeight
from jaxpipe.runtime import kernel_choice, sharding
from jaxpipe.runtime.kernel_choice import PANEL_ORDER, KernelChoice, Matmul

# The weights the step reads in panel order, each with its kernel path for a number of rows
# (`runtime/kernel_choice.py`); the others are XLA's.
KernelPaths = Mapping[str, Callable[[int], str]]


def token_slots(table, rows, positions):
    """Where each token's K/V goes: (blocks [T], offsets [T]) for tokens of rows [T] (R: no
    row) at positions [T], through table [R, MB]. No row, or past the table: out of range."""
    none = jnp.full((1, table.shape[1]), OUT_OF_RANGE, table.dtype)
    index = positions // BLOCK
    blocks = jnp.concatenate([table, none])[rows, jnp.minimum(index, table.shape[1] - 1)]
    return jnp.where(index < table.shape[1], blocks, OUT_OF_RANGE), positions % BLOCK


def attend(q, k, v, mb: dict, layer, *, attention: str, max_kv: int, window=0,
           softcap: float = 0.0, scale: float | None = None):
    """Each span's queries q [Tm, H, D] over its row's paged KV (k, v [Ls, NB, Hkv, BLOCK,
    D], read at `layer`), each over its last `window` keys (0: all), scores scaled by
    `scale` (None: 1/sqrt(D)) and soft-capped at `softcap` (0: not); mb: this micro-batch's
    table, spans, rows and positions.
    `attention`: "pallas" (the Pallas kernel), "pallas-interpret" (it, in Pallas'
    interpreter) or "xla" (the reference, keys bounded by static `max_kv`). ("cpu": see
    `stage_layers`.)"""
    if attention.startswith("pallas"):
        fn = partial(pallas_attention.pallas_attention,
                     interpret=attention == "pallas-interpret")
    else:
        fn = partial(ragged_attention.reference, max_kv=max_kv)
    return fn(q, k, v, mb["table"], mb["q_start"], mb["q_len"], mb["kv_len"], layer,
              window=window, softcap=softcap, scale=scale)


def kernel_dot(x, w: StackedWeight, gated: bool = False):
    """`decoder._matmul`'s dot with a C++ kernel on a weight in panel order, on the path
    measured fastest for x's rows: the bf16 kernel (`kernels/matmul.py`), or the int8 one
    (`kernels/int8_matmul.py`, int8 panel order) on a quantized weight. Call inside
    `shard_map`."""
    stack, path = w.stacked(), w.path(x.shape[0])
    if isinstance(stack, GgufWeight):
        return gguf_dot(x, w, path, gated)
    if isinstance(stack, QuantizedWeight):
        return int8_matmul.int8_matmul(x, stack.codes, stack.scale, w.layer, gated=gated,
                                       path=path)
    return matmul.bf16_matmul(x, stack, w.layer, gated=gated, path=path)


def gguf_dot(x, w: StackedWeight, path: str, gated: bool = False):
    """x [M, K] @ layer `w.layer` of a stack of GGUF blocks: the GGUF kernel on `path`,
    reading the stack in place, or XLA's reference of the format on the layer's slice
    (`path` "xla"); `gated`: silu of the first half of the [M, 2F] product times the second,
    in XLA."""
    if path == kernel_choice.XLA:
        y = w.value().dot(x)
    else:
        stack = w.stacked()
        y = gguf_matmul.gguf_matmul(x, stack.rows(), stack.kind, w.layer, path=path)
    return matmul.silu_gate(y) if gated else y


def kernel_gated(x, w: StackedWeight):
    """`decoder.gated_mlp`'s fused gate: the kernel's `gated` mode (the [M, 2F] product is never
    written). Call inside `shard_map`."""
    return kernel_dot(x, w, gated=True)


# The layer weights the step multiplies by, and how many of their axes after "layers" are
# contracted (decoder.py's `_matmul` calls): with `packed`, those axes are K and the rest N.
MATMUL_PARAMS = {"wq": 1, "wkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}


# An MoE layer's experts, which the grouped kernel reads in place (natural order; the
# other paths slice them, `model/moe.py`): a slice per layer would copy every expert's
# weights on every step.
EXPERT_PARAMS = ("w_experts_gate_up", "w_experts_down")


def layer_params(layers: LayerParams, j, packed: KernelPaths) -> LayerParams:
    """Layer j's weights: slices, and the `packed` ones and the experts as `StackedWeight`s
    (None stays None: a parameter this config has not)."""
    def one(name, a):
        if a is None:
            return None
        if name in packed:
            return StackedWeight(a, j, packed[name])
        return StackedWeight(a, j) if name in EXPERT_PARAMS else a[j]

    return LayerParams(*(one(name, a) for name, a in zip(LAYER_PARAMS, layers, strict=True)))


def local_matmuls(shardings: dict) -> dict[str, Matmul]:
    """Each matmul weight's multiplication on one device (its shard as [K, N]; the fused
    gate where its halves are whole panel pairs), from the weights' `NamedSharding`s (a
    `QuantizedWeight` of them: int8) and padded shapes: name -> (sharding, shape). Only
    bf16 weights whose shard has an even K, what panel order pairs; int8 packs any K. A
    weight the model has not (an MoE model's dense MLP) is left out of `shardings` and of
    the result."""
    out = {}
    for name, (place, shape) in shardings.items():
        if isinstance(place, GgufWeight):
            out[name] = _gguf_matmul(name, place, shape)
            continue
        quant = _quant(place)
        local = _codes(place).shard_shape(shape)
        contracted = MATMUL_PARAMS[name]
        k, n = math.prod(local[1:1 + contracted]), math.prod(local[1 + contracted:])
        if k % 2 == 0 or quant == "int8":
            out[name] = Matmul(name, k, n, gated=name == "w_gate_up"
                               and local[-1] % matmul.PANEL == 0, quant=quant)
    return out


def _gguf_matmul(name: str, place: GgufWeight, shape: tuple[int, ...]) -> Matmul:
    """A weight in GGUF blocks (a `GgufWeight` of shardings; `shape` its padded float shape)
    as one device's [K, N] multiplication: its format as `Matmul.quant`."""
    local = place.data.shard_shape(place.data_shape(shape))  # the bytes unsplit
    n_at = len(local) - 1 - place.grouped - place.n_ndim
    n = math.prod(local[n_at:n_at + place.n_ndim])
    k = gguf_quantized.k_of(place.k_shape, local[-2] if place.grouped else None)
    return Matmul(name, math.prod(k), n, gated=name == "w_gate_up", quant=place.kind)


def _codes(w):
    """A weight's array (or sharding, spec): a quantized one's codes."""
    return w.codes if isinstance(w, QuantizedWeight) else w


def _quant(w) -> str:
    """`Matmul.quant` of a weight (or its sharding): "none", or its quantized kind."""
    return w.kind if isinstance(w, QuantizedWeight) else "none"


# Each weight storage's panel order: (pack, unpack) of the bf16 kernel's, the int8 kernel's.
REORDER = {"none": (matmul.pack, matmul.unpack), "int8": (int8_matmul.pack, int8_matmul.unpack)}


def reorder(w, direction: int, k: int | None = None):
    """w in its storage's panel order (`REORDER`; `direction` 0: pack) or back (1): a
    stacked layer weight [L', ...] as [L', k, N'] (k: its contracted size), or the LM head
    [E, V'] as it is (k None); on a quantized weight, its codes. Shape kept."""
    fn, codes = REORDER[_quant(w)][direction], _codes(w)
    out = fn(codes if k is None else codes.reshape(codes.shape[0], k, -1)).reshape(codes.shape)
    return dataclasses.replace(w, codes=out) if isinstance(w, QuantizedWeight) else out


def reorder_local(layers: dict, direction: int) -> dict:
    """Pack (`direction` 0) or unpack (1) each weight of `layers` (name -> this device's
    stacked block of a matmul weight, [L', ...]) as [L', K', N'], shape kept. Call inside
    `shard_map`."""
    return {name: reorder(w, direction, math.prod(_codes(w).shape[1:1 + MATMUL_PARAMS[name]]))
            for name, w in layers.items()}


HEAD_AXES = ("embed", "vocab")  # the LM head as the kernel reads it: [E, V]


def local_head(shardings: dict, shapes: dict, layout: Layout) -> Matmul | None:
    """The LM head's multiplication on one device, [E, V'] (tied: the embedding's shard
    transposed; quantized: its own [E, V]), from the weights' `NamedSharding`s and padded
    shapes; None for an odd E in bf16, which panel order cannot pair. Under `layout` a
    kernel's head is its slice of the device's shard (`head_slices`)."""
    name = "lm_head" if "lm_head" in shardings else "embed"
    place = shardings[name]
    if isinstance(place, GgufWeight):
        shape = shapes[name] if name == "lm_head" else shapes[name][::-1]
        mm = _gguf_matmul("lm_head", place, shape)
        count = head_slices(layout, mm.n * layout.tp, unit=1)[1]
        return dataclasses.replace(mm, n=mm.n // count, gated=False)
    if isinstance(place, QuantizedWeight):
        shape = shapes["lm_head"] if "lm_head" in shapes else shapes["embed"][::-1]
        e, v = place.codes.shard_shape(shape)
        return Matmul("lm_head", e, v // head_slices(layout, v * layout.tp)[1], quant=place.kind)
    local = place.shard_shape(shapes[name])
    e, v = local if name == "lm_head" else local[::-1]
    return Matmul("lm_head", e, v // head_slices(layout, v * layout.tp)[1]) if e % 2 == 0 else None


def head_slices(layout: Layout, vocab: int,
                unit: int = matmul.PANEL) -> tuple[tuple[str, ...], int]:
    """The mesh axes past tp over which the logits split (`sharding.logits_spec`) and how many
    slices they make of each device's tp shard of a kernel's LM head [E, vocab]: each device
    multiplies only its own slice, read in place. In panel order a slice of whole panels
    (`unit` columns) is one contiguous [E, vocab / tp / slices] block, panel order storing
    panel after panel; in GGUF blocks (`unit` 1) a vocabulary row is one contiguous row of
    blocks. ((), 1) where a slice would not be whole units: every device then multiplies its
    whole shard."""
    split = sharding.logits_spec(layout, vocab)[1] or ()
    axes = tuple(a for a in ((split,) if isinstance(split, str) else split) if a != "tp")
    count = math.prod(getattr(layout, a) for a in axes)
    if count == 1 or (vocab // layout.tp) % (count * unit):
        return (), 1
    return axes, count


def _layers_program(specs: dict, mesh, names: Iterable[str], direction: int):
    """shard_map(layers) -> layers with each device's shards of the matmul weights `names`
    packed (`direction` 0) or unpacked (1), shapes and shardings kept. specs: the
    parameters' (`sharding.param_specs`)."""
    specs = {n: specs[n] for n in names}
    return jax.shard_map(lambda ws: reorder_local(ws, direction), mesh=mesh,
                         in_specs=(specs,), out_specs=specs, check_vma=False)


def _head_program(cfg: ModelConfig, layout: Layout, mesh, direction: int,
                  quant: Quantization | None):
    """shard_map of the LM head into (`direction` 0) or out of (1) its panel order: each
    device's [E, V'] shard, a quantized head's codes (the head is its own [E, V] then);
    packing a bf16 head takes the tied embedding [V', E], transposed, or "lm_head"."""
    decls = param_decls(cfg)
    specs = sharding.param_specs(cfg, layout, quant)
    if quant is not None and quant.lm_head:
        return jax.shard_map(partial(reorder, direction=direction), mesh=mesh,
                             in_specs=(specs["lm_head"],), out_specs=specs["lm_head"],
                             check_vma=False)
    transpose = "lm_head" not in decls and direction == 0
    head_in = sharding.spec(decls["embed"].axes if transpose else HEAD_AXES, layout)

    def local(w):  # this device's [V', E] (tied, packing) or [E, V']
        return reorder(w.T if transpose else w, direction)

    return jax.shard_map(local, mesh=mesh, in_specs=(head_in,),
                         out_specs=sharding.spec(HEAD_AXES, layout), check_vma=False)


def pack_program(cfg: ModelConfig, layout: Layout, mesh, names: Iterable[str], head: bool,
                 quant: Quantization | None = None):
    """jit(params in natural order, donated) -> params as the step reads them: each device's
    shards of the matmul weights `names` in their kernel's panel order (`REORDER`: bf16's,
    or int8's for weights quantized by `quant`); with `head`, the LM head [E, V] in panel
    order too, as "lm_head" (tied bf16 embeddings: a copy of the embedding's transpose;
    the lookup keeps reading "embed")."""
    layers = _layers_program(sharding.param_specs(cfg, layout, quant), mesh, names, 0)
    lm_head = _head_program(cfg, layout, mesh, 0, quant) if head else None

    def run(params):
        out = params | layers({n: params[n] for n in names})
        if head:
            out["lm_head"] = lm_head(params["lm_head"] if "lm_head" in params
                                     else params["embed"])
        return out

    return jax.jit(run, donate_argnums=0)


def unpack_program(cfg: ModelConfig, layout: Layout, mesh, names: Iterable[str], head: bool,
                   quant: Quantization | None = None):
    """The inverse of `pack_program` (a new tree; params not donated): natural order, and no
    "lm_head" for tied bf16 embeddings (a quantized head stays: it is the only copy)."""
    keep_head = "lm_head" in param_decls(cfg) or (quant is not None and quant.lm_head)
    layers = _layers_program(sharding.param_specs(cfg, layout, quant), mesh, names, 1)
    lm_head = _head_program(cfg, layout, mesh, 1, quant) if head else None

    def run(params):
        out = params | layers({n: params[n] for n in names})
        if head and keep_head:
            out["lm_head"] = lm_head(params["lm_head"])
        elif head:
            del out["lm_head"]
        return out

    return jax.jit(run)


def kernel_rope(cfg: ModelConfig, q, kv, cos, sin):
    """(q, kv, cos, sin) as `write_and_attend` takes them, whose rotation covers whole heads:
    with a partial `rotary_dim` (Phi), q and k are rotated here and the kernel is handed
    the identity rotation. q [T, H, D], kv [T, 2, Hkv, D], cos, sin [T, R/2]."""
    if (cfg.rotary_dim or cfg.head_dim) == cfg.head_dim:
        return q, kv, cos, sin
    cos2, sin2 = (jnp.concatenate([a, a], axis=-1)[:, None] for a in (cos, sin))  # [T, 1, R]
    q = attention_math.apply_rope(q, cos2, sin2)
    kv = jnp.stack([attention_math.apply_rope(kv[:, 0], cos2, sin2), kv[:, 1]], axis=1)
    half = (q.shape[0], cfg.head_dim // 2)
    return q, kv, jnp.ones(half, jnp.float32), jnp.zeros(half, jnp.float32)


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """How a stage runs its layers. `attention`: see `attend` ("cpu": the C++ kernel, which
    also rotates q and k and writes k and v itself, `ragged_attention.write_and_attend`);
    `max_kv`: the XLA attention's static key bound; `packed`: the matmul weights in panel
    order, for the C++ bf16 kernel, each with the kernel path for a number of rows;
    `windows`: every padded layer's sliding window (0: none; `sharding.layer_windows`), ()
    for none at all; `moe_layers`: whether each padded layer runs its experts
    (`sharding.layer_experts`), () where every layer of the model is alike; `experts`: the
    experts' path chooser (`moe.experts_mlp`'s; None: `kernel_choice.experts_path`);
    `quant`: which weights are quantized and how (None: none); `head_packed`: the LM head
    is in its kernel's panel order (a tied quantized head's rows are then read from it
    there, `embedding_rows`)."""

    attention: str
    max_kv: int
    packed: KernelPaths = dataclasses.field(default_factory=dict)
    windows: tuple[int, ...] = ()
    moe_layers: tuple[bool, ...] = ()
    experts: Callable | None = None
    quant: Quantization | None = None  # the quantized weights (`model/quantized.py`)
    head_packed: bool = False  # the LM head is in its kernel's panel order (`pack_program`)


def stage_layers(cfg: ModelConfig, layers: LayerParams, x, mb: dict, cache: KVCache,
                 layout: Layout, opts: StageOptions):
    """This stage's layers over one micro-batch x [Tm, E] (mb: see `attend`): each is the
    decoder's own `decoder.layer`, with the step's paged attention (`StepAttention`: each
    token's K/V written into its blocks before the spans attend), the matmul kernels, the
    tp psum and, under ep, this device's experts. Call inside `shard_map`."""
    count = layers.wq.shape[0]
    attention = StepAttention(cfg, mb, opts, count)
    reduce = partial(lax.psum, axis_name="tp") if layout.tp > 1 else None
    shard, experts = expert_shard(layout), opts.experts or kernel_choice.experts_path
    # The fused gate needs this device's gate and up halves in whole panel pairs.
    gated = (kernel_gated if "w_gate_up" in opts.packed and cfg.mlp_act == "silu"
             and layers.w_gate_up.shape[-1] % matmul.PANEL == 0 else None)

    def body(carry, j):
        x, k, v = carry
        x, (k, v) = decoder.layer(cfg, layer_params(layers, j, opts.packed), x,
                                  partial(attention, k=k, v=v, j=j), reduce, _dot, gated,
                                  shard, experts, attention.moe_layer(j))
        return (x, k, v), None

    (x, k, v), _ = lax.scan(body, (x, *cache), jnp.arange(count),
                            unroll=unrolled(layers, opts.packed))
    return x, KVCache(k, v)


def unrolled(layers: LayerParams, packed: KernelPaths) -> bool:
    """Whether the layer loop is unrolled: unless XLA's dot multiplies an f32 weight sliced
    from the stacked layers. The kernels read their weights in place at a layer index, a
    constant once unrolled. XLA's dot copies a sliced weight first, and in an unrolled loop
    XLA hoists every layer's copies into one temporary buffer, allocated and page-faulted on
    every step: an f32 SmolLM2 decode step copied 425 MB that way, at about 3x the rolled
    loop's time (AMD EPYC family 25 model 17, avx512_bf16: `python scripts/profile_step.py
    --engine-field dtype=float32,bfloat16 --num-prompts 2 --input-len 16 --output-len 24
    --max-model-len 160`, f32 "other" ops 286 ms a step against 52 ms of matmuls; rolled,
    one layer's slices, 14 MB, live at a time). A bf16 or
    quantized weight on XLA's dot stays unrolled: rolled, XLA converts the whole stack to
    f32 outside the loop on every step (432 MB of temporaries for bf16 SmolLM2 against the
    unrolled loop's 212 MB of slices)."""
    return not any(a is not None and name in MATMUL_PARAMS and name not in packed
                   and getattr(a, "dtype", None) == jnp.float32
                   for name, a in zip(LAYER_PARAMS, layers, strict=True))


def _dot(x, w):
    """The matmul of a packed weight on the C++ kernel, of any other on XLA."""
    return kernel_dot(x, w) if isinstance(w, StackedWeight) else decoder.xla_dot(x, w)


class StepAttention:
    """A ragged step's attention for `decoder.layer`, in layer j of this stage (the padded
    model's layer stage * count + j): `(q, kv, k=, v=, j=) -> (attn, (k, v))` rotates q and
    k, writes k and v into the blocks of their rows and attends each span over its paged KV
    (k, v: the stage's pools). Call inside `shard_map`."""

    def __init__(self, cfg: ModelConfig, mb: dict, opts: StageOptions, count: int):
        self.cfg, self.mb, self.opts, self.count = cfg, mb, opts, count
        self.windows = jnp.asarray(opts.windows or (0,), jnp.int32)
        self.experts = jnp.asarray(opts.moe_layers or (True,))
        if opts.attention == "cpu":  # the angles once for every layer
            self.angles = decoder.rope_angles(cfg, mb["positions"])  # [Tm, D/2]
            self.local_angles = (decoder.rope_angles(cfg, mb["positions"], local=True)
                                 if cfg.rope_local_theta is not None and any(opts.windows)
                                 else None)
        else:
            self.slots = token_slots(mb["table"], mb["rows"], mb["positions"])

    def _padded(self, j):
        return lax.axis_index("pp") * self.count + j

    def window(self, j):
        return self.windows[self._padded(j)] if any(self.opts.windows) else 0

    def moe_layer(self, j):
        """Whether layer j runs its experts (True, static, where every layer is alike)."""
        return self.experts[self._padded(j)] if self.opts.moe_layers else True

    def __call__(self, q, kv, *, k, v, j):
        if self.opts.attention == "cpu":
            return self._kernel(q, kv, k, v, j)
        return self._xla(q, kv, k, v, j)

    def _kernel(self, q, kv, k, v, j):
        cfg, mb, w = self.cfg, self.mb, self.window(j)
        cos, sin = self.angles
        if self.local_angles is not None:  # Gemma 3: the sliding layers' own RoPE base
            cos, sin = (jnp.where(w > 0, a, b)
                        for a, b in zip(self.local_angles, self.angles, strict=True))
        q, kv, cos, sin = kernel_rope(cfg, q, kv, cos, sin)
        attn, k, v = ragged_attention.write_and_attend(
            q, kv, cos, sin, k, v, mb["table"], mb["q_start"], mb["q_len"], mb["kv_len"], j,
            window=w, softcap=cfg.attn_softcap or 0.0, scale=cfg.attn_scale)
        return attn, (k, v)

    def _xla(self, q, kv, k, v, j):
        cfg, w = self.cfg, self.window(j)
        q, kn, vn = decoder.rotate(cfg, q, kv, self.mb["positions"], w > 0)
        blocks, offsets = self.slots
        k = k.at[j, blocks, :, offsets].set(to_storage(kn, k), mode="drop")
        v = v.at[j, blocks, :, offsets].set(to_storage(vn, v), mode="drop")
        attn = attend(q, k, v, self.mb, j, attention=self.opts.attention,
                      max_kv=self.opts.max_kv, window=w, softcap=cfg.attn_softcap or 0.0,
                      scale=cfg.attn_scale)
        return attn, (k, v)


def _specs(cfg: ModelConfig, layout: Layout, quant: Quantization | None):
    specs = sharding.param_specs(cfg, layout, quant)
    layer_specs = LayerParams(*(specs.get(n) for n in LAYER_PARAMS))
    kv = sharding.spec(sharding.KV_AXES, layout)
    return layer_specs, KVCache(kv, kv)


def split_params(params: dict) -> tuple[LayerParams, HeadParams]:
    """The stacked layer weights and the head (embedding, final norm, LM head; a tied
    quantized head is the embedding too, `Quantization.tied`)."""
    embed = params["embed"] if "embed" in params else params["lm_head"]
    head = HeadParams(embed, params["final_norm"], params.get("lm_head"))
    return LayerParams(*(params.get(n) for n in LAYER_PARAMS)), head


def expert_shard(layout: Layout) -> decoder.ExpertShard | None:
    """This device's experts under `layout` (call inside `shard_map`): its index along `ep`,
    whose partial MoE outputs are summed with a psum over ep; None without ep."""
    if layout.ep == 1:
        return None
    return decoder.ExpertShard(lax.axis_index("ep"), partial(lax.psum, axis_name="ep"))


def tick_program(cfg: ModelConfig, layout: Layout, mesh, opts: StageOptions, out_rows: int):
    """jit(params, cache, act, inputs: TickInputs, prev [out_rows] i32: the last sampled
    tokens, for the new micro-batch's `feed`) -> (hidden [out_rows, E] f32: the residual of
    each row's last token of the micro-batch leaving the last stage, zeros past its R rows;
    cache, act (both donated)).

    One tick of the flowing pipeline: stage s runs the micro-batch in slot s of `inputs` (slot
    0: the one entering, embedded here; slot s > 0: the one that left stage s - 1 last tick,
    whose activations `act` [pp, Tm, E] carries), then every stage's output moves one stage on
    (`lax.ppermute`) into the returned `act`. An idle slot's tokens write no KV (rows = R).
    On one stage (pp = 1) a tick is a whole step. `opts`: how the stages run their layers
    (`StageOptions`); `out_rows` (>= R) is fixed for every bucket, so the LM head compiles
    once per number of sampled rows. `score` [S] i32 (None: S = 0): token indices of the
    leaving micro-batch whose residuals follow the rows' in `hidden` ([out_rows + S, E]):
    the prompt positions that score the next prompt token (`prompt_scores.py`)."""
    layer_specs, cache_specs = _specs(cfg, layout, opts.quant)
    embed_rows = embedding_rows(cfg, layout, mesh, opts.quant) if opts.head_packed else None
    keys = ("rows", "positions", "table", "q_start", "q_len", "kv_len", "last")
    shift = [(i, (i + 1) % layout.pp) for i in range(layout.pp)]

    def body(layers, x0, act, slots, cache, score):
        stage = lax.axis_index("pp")
        mine = {k: v[0] for k, v in slots.items()}  # this stage's slot
        x = jnp.where(stage == 0, x0, act[0])
        y, cache = stage_layers(cfg, layers, x, mine, cache, layout, opts)
        kept = jnp.concatenate([y[mine["last"]], y[score]])  # [R + S, E]
        hidden = jnp.where(stage == layout.pp - 1, kept, 0.0)
        if layout.pp > 1:  # only the last stage's rows are non-zero: the sum broadcasts them
            hidden, y = lax.psum(hidden, "pp"), lax.ppermute(y, "pp", shift)
        return hidden, y[None], cache

    slot = P("pp")
    staged = jax.shard_map(body, mesh=mesh, check_vma=False,
                           in_specs=(layer_specs, P(), slot, {k: slot for k in keys},
                                     cache_specs, P()),
                           out_specs=(P(), slot, cache_specs))

    def tick(params, cache, act, inputs, prev, score=None):
        layers, head = split_params(params)
        x0 = decoder.embed(head, fed_tokens(inputs.tokens[0], inputs.feed[0], prev),
                           cfg.embed_scale, embed_rows)  # [Tm, E]: the entering micro-batch
        score = jnp.zeros(0, jnp.int32) if score is None else score
        hidden, act, cache = staged(layers, x0, act, {k: getattr(inputs, k) for k in keys},
                                    cache, score)
        rows = hidden.shape[0] - score.shape[0]
        return jnp.concatenate([jnp.pad(hidden[:rows], ((0, out_rows - rows), (0, 0))),
                                hidden[rows:]]), cache, act

    return jax.jit(tick, donate_argnames=("cache", "act"))


def embedding_rows(cfg: ModelConfig, layout: Layout, mesh, quant: Quantization | None):
    """`decoder.embed`'s `rows` for a tied quantized LM head in int8 panel order (None for
    any other head): (head, tokens [T]) -> [T, E] f32, each device reading the tokens of
    its vocab shard from its own panels (`int8_matmul.packed_columns`), zeros for the
    others', summed over tp (one non-zero term a value: exact). The rows equal
    `QuantizedWeight.rows` on the unpacked head."""
    if quant is None or not quant.tied(param_decls(cfg)):
        return None
    spec = sharding.param_specs(cfg, layout, quant)["lm_head"]

    def local(w: QuantizedWeight, tokens):  # this device's [E, V'] in panel order
        n = w.codes.shape[-1]
        ids = tokens - (lax.axis_index("tp") * n if layout.tp > 1 else 0)
        mine = (ids >= 0) & (ids < n)
        ids = jnp.clip(ids, 0, n - 1)
        x = quantized.dequantize_rows(int8_matmul.packed_columns(w.codes, ids), w.scale[ids])
        x = jnp.where(mine[:, None], x, 0.0)
        return lax.psum(x, "tp") if layout.tp > 1 else x

    def rows(w: QuantizedWeight, tokens):
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=P(),
                             check_vma=False)(w, tokens)

    return rows


def fed_tokens(tokens, feed, prev):
    """Token ids `tokens`, except where `feed` names a row of the previous step's sampled
    tokens `prev` (still on the device) to take instead."""
    fed = jnp.take(prev, jnp.maximum(feed, 0), mode="clip")
    return jnp.where(feed >= 0, fed, tokens)


# The LM head runs on at least this many rows: for one row XLA's CPU dot takes a matrix-vector
# path that ran SmolLM2's 49152x576 bf16 head in 33.8 ms, against 1.9 ms for two rows.
HEAD_MIN_ROWS = 2


def logits_program(cfg: ModelConfig, vocab: int, layout: Layout | None = None, mesh=None,
                   packed: Callable[[int], str] | None = None,
                   quant: Quantization | None = None):
    """jit(params, hidden [R, E], rows=static n) -> logits [n, vocab] f32 of the first n rows
    (the sampled ones): the LM head only where a token is sampled. `packed`: params hold the
    head as the bf16 kernel reads it ("lm_head" [E, V] in panel order, `pack_program`), each
    device multiplies its own slice of the vocabulary (its tp shard's, split again over ep
    and pp where whole panels allow, `head_slices`, as `sharding.logits_spec` splits the
    logits) on `mesh` (`layout`'s) on the kernel path `packed(rows)`; otherwise XLA
    partitions the head's dot from the vocab-split weights as the logits' spec asks.
    `quant`: the quantized weights (a quantized head: the int8 kernel on int8 panel order,
    or XLA's dot of its kind)."""
    def head(h, w, name):
        head_spec = (sharding.param_specs(cfg, layout, quant)[name]
                     if quant is not None and quant.lm_head else sharding.spec(HEAD_AXES, layout))
        gguf = isinstance(w, GgufWeight)
        columns = _head_columns(w)
        axes, count = head_slices(layout, columns, 1 if gguf else matmul.PANEL)

        def local(h, w):  # this device's vocab shard, [E, V'] in its panel order
            path = packed(h.shape[0])
            index = 0  # this device's slice of its shard (`head_slices`), read in place
            for axis in axes:
                index = index * getattr(layout, axis) + lax.axis_index(axis)
            if gguf:  # [V', R] in GGUF blocks
                return _gguf_head(h, w, path, count, index)
            if isinstance(w, QuantizedWeight):
                return int8_matmul.int8_matmul(h, _slices(w.codes, count),
                                               w.scale.reshape(count, -1), index, path=path)
            return matmul.bf16_matmul(h, _slices(w, count), index, path=path)

        out = (sharding.logits_spec(layout, columns) if count > 1
               else sharding.spec((None, "vocab"), layout))
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), head_spec), out_specs=out,
                             check_vma=False)(h, w)

    def logits(params, hidden, rows: int):
        _, params_head = split_params(params)
        if packed:
            h = decoder.rms_norm(hidden[:rows], params_head.final_norm, cfg.rms_norm_eps)
            name = "lm_head" if "lm_head" in params else "embed"  # tied GGUF: the embedding
            return attention_math.softcap(head(h, params[name], name)[:, :vocab],
                                          cfg.final_softcap)
        n = max(rows, HEAD_MIN_ROWS)
        if hidden.shape[0] < n:
            hidden = jnp.pad(hidden, ((0, n - hidden.shape[0]), (0, 0)))
        out = decoder.logits(cfg, params_head, hidden[:n])
        if mesh is not None:  # every device computes its own logits, not all of them
            out = jax.lax.with_sharding_constraint(out, NamedSharding(
                mesh, sharding.logits_spec(layout, out.shape[-1])))
        return out[:rows, :vocab]

    return jax.jit(logits, static_argnames="rows")


def _in_stack(kernels: KernelChoice, mm: Matmul) -> bool:
    """Whether the step reads `mm`'s weight as a `StackedWeight`: in panel order, or in GGUF
    blocks. Either way its timings are measured here, before any step is traced: the step
    asks for the path per row count while it is being traced, where a timing would time
    nothing (`kernel_choice._seconds` refuses)."""
    if mm.quant in gguf_blocks.FORMATS:
        kernels.seconds(mm)
        return True
    return kernels.order(mm) == PANEL_ORDER


def _head_columns(w) -> int:
    """The (padded) vocabulary of an LM head [E, V] as a kernel reads it (int8: its codes in
    panel order; GGUF: its blocks' float shape)."""
    return (w.codes if isinstance(w, QuantizedWeight) else w).shape[-1]


def _slices(w, count: int):
    """A head's local [E, V'] in panel order as `count` stacked [E, V' / count] heads, each
    in panel order itself (whole panels, `head_slices`): a reshape, no copy."""
    e, v = w.shape
    return w.reshape(count, e, v // count)


def _gguf_head(h, w: GgufWeight, path: str, count: int, index):
    """h [M, E] @ slice `index` of `count` of the LM head in GGUF blocks w [V', R]
    (`head_slices`): the GGUF kernel on `path`, reading its rows in place, or XLA's
    reference ("xla")."""
    rows = w.rows()
    stack = rows.reshape(count, rows.shape[0] // count, rows.shape[1])
    if path == kernel_choice.XLA:
        return gguf_blocks.reference(h, stack[index], gguf_blocks.format_of(w.kind))
    return gguf_matmul.gguf_matmul(h, stack, w.kind, index, path=path)


def kernel_matmuls(cfg: ModelConfig, padding: sharding.Padding, shardings: dict,
                   kernels: KernelChoice | None,
                   layout: Layout) -> tuple[dict[str, Matmul], Matmul | None]:
    """The matmuls of a layout (its weights' `shardings`; `QuantizedWeight`s of them for
    quantized weights) that `kernels` gives to a C++ kernel (bf16's, or int8's for an int8
    weight), measuring them first if they are new: the layer weights (name -> the local
    multiplication) and the LM head (None: XLA's). fp8 weights are always XLA's. Weights in
    GGUF blocks are all kept (their order is the file's; the choice per row count may be
    XLA's reference, `gguf_dot`)."""
    if kernels is None or "fp8" in map(_quant, shardings.values()):
        return {}, None
    shapes = sharding.padded_shapes(cfg, padding)
    local = local_matmuls({n: (shardings[n], shapes[n]) for n in MATMUL_PARAMS
                                    if n in shardings})
    layers = {n: mm for n, mm in local.items() if _in_stack(kernels, mm)}
    head = local_head(shardings, shapes, layout)
    if head is None or not _in_stack(kernels, head):
        head = None
    return layers, head
