"""Layouts on devices: meshes, logical-axis rules, padding for uneven splits, re-sharding.

The model names *logical* axes (`layers`, `heads`, `kv_heads`, `mlp`, `experts`, `vocab`, ...);
this module is the only place that maps them to *physical* mesh axes (`pp`, `tp`, `ep`, `dp`).
Every layout of one engine uses the same devices in the same order, arranged as a mesh
`[dp, pp, ep, tp]`.

Expert parallelism (`ep`) splits only the stacked experts (`experts` -> ep): every other
parameter, the KV store and the activations are replicated over ep, so attention, the router
and the shared expert run redundantly on the ep devices of a tp group. Tokens never move:
each device already holds every token, so it runs its own experts on the tokens routed to
them (the others' gates zeroed) and the partial outputs are summed over ep (`psum`, see
`pipeline.step_program` and `decoder.ExpertShard`). A dense model refuses ep > 1.

JAX refuses uneven splits, so sizes that a layout's degree does not divide are padded once, on
the host, into a form every layout of the engine divides (`Padding`):
  - layers: identity layers (every weight zero: x + 0 + 0 == x exactly) fill each short stage;
  - heads: KV heads are replicated and query heads zero-padded so each TP shard holds whole
    GQA groups; a zero query head attends somewhere, but its `wo` rows are zero, so the
    output is unchanged;
  - mlp / moe_mlp / vocab: zero columns (silu(0) * 0 == 0; padded logits are cut off by
    the runner);
  - experts: zero experts appended to the stack (Mixtral's 5 become 8 at ep=4). The router
    is not padded, so it scores only the real experts and a padded one is never chosen
    (padding the router with zero columns would not do: a logit of 0 can win).
Because the padded shapes are common to all layouts, re-sharding is a pure `device_put`.
A size a rule cannot split raises; nothing is ever silently replicated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.config.layout import Layout
from jaxpipe.config.model import ModelConfig
from jaxpipe.kernels.paged import row_width
from jaxpipe.kv.device_cache import BLOCK
from jaxpipe.model import gguf_quantized
from jaxpipe.model.decoder import param_decls
from jaxpipe.model.gguf_quantized import GgufWeight
from jaxpipe.model.quantized import Quantization

MESH_AXES = ("dp", "pp", "ep", "tp")
# Logical axis -> mesh axis. Axes not listed (embed, head_dim, kv_pair, gate_up, seq) are never
# split: embed is the residual stream every layer needs whole; the pair axes hold two halves
# of one fused matmul.
# The experts split like the dense MLP, over their hidden columns (`moe_mlp`): every device
# holds a slice of every expert, and `w_experts_down`'s partial products are summed with the
# rest of the MLP's. Under ep each device also holds only its own experts (`experts` -> ep);
# `router` (the router's expert scores) is never split: every device routes every token.
RULES = {"layers": "pp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "moe_mlp": "tp",
         "experts": "ep", "vocab": "tp", "batch": "dp",
         "mlp_blocks": "tp"}  # w_down's rows in GGUF blocks, split as "mlp" (gguf_quantized.py)
# Logical axes of the stacked KV store (one array for K, one for V).
KV_AXES = ("layers", "kv_blocks", "kv_heads", "seq", "head_dim")


# ---- padding -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Padding:
    """Source index of every padded position along each padded logical axis (-1: zero).

    `index[axis][i]` is the original index feeding padded position i. Axes not in `index` are
    unchanged. Built for a *set* of layouts so that one padded model serves all of them."""

    index: dict[str, tuple[int, ...]]

    def size(self, axis: str, original: int) -> int:
        return len(self.index[axis]) if axis in self.index else original

    @property
    def is_identity(self) -> bool:
        return all(list(src) == list(range(len(src))) for src in self.index.values())

    def padded_config(self, cfg: ModelConfig) -> dict[str, int]:
        """The padded sizes: num_layers, num_heads, num_kv_heads, intermediate_size, vocab."""
        return {"num_layers": self.size("layers", cfg.num_layers),
                "num_heads": self.size("heads", cfg.num_heads),
                "num_kv_heads": self.size("kv_heads", cfg.num_kv_heads),
                "intermediate_size": self.size("mlp", cfg.mlp_width),
                "vocab_size": self.size("vocab", cfg.vocab_size)}


def padding_for(cfg: ModelConfig, layouts: Iterable[Layout]) -> Padding:
    """The smallest padding every layout in `layouts` divides evenly."""
    layouts = list(layouts)
    pp = math.lcm(*(lo.pp for lo in layouts))
    tp = math.lcm(*(lo.tp for lo in layouts))
    ep = math.lcm(*(lo.ep for lo in layouts))
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"layouts {', '.join(map(str, layouts))}: expert parallelism (ep > 1) "
                         "needs a mixture-of-experts model, and this one is dense; use tp or pp")
    q_src, kv_src = _head_sources(cfg.num_heads, cfg.num_kv_heads, tp)
    return Padding({
        "layers": _layer_sources(cfg.num_layers, pp),
        "heads": q_src,
        "kv_heads": kv_src,
        "mlp": _zero_pad(cfg.mlp_width, tp),
        "moe_mlp": _zero_pad(cfg.moe_intermediate_size, tp),
        "experts": _zero_pad(cfg.num_experts, ep),
        # over tp as the weights split, and over every device of a replica for the logits
        # (`logits_spec`): a few zero columns more, cut off with the padded logits
        "vocab": _zero_pad(cfg.vocab_size, math.lcm(*(lo.tp * lo.ep * lo.pp for lo in layouts))),
    })


def _zero_pad(size: int, multiple: int) -> tuple[int, ...]:
    return tuple(range(size)) + (-1,) * (-size % multiple)


def _layer_sources(num_layers: int, pp: int) -> tuple[int, ...]:
    """Stages of equal length: the first `L % pp` stages hold one more real layer, the others
    end with an identity layer (uneven stage assignment, made even by padding)."""
    per_stage = -(-num_layers // pp)
    src: list[int] = []
    nxt = 0
    for stage in range(pp):
        real = num_layers // pp + (stage < num_layers % pp)
        src += list(range(nxt, nxt + real)) + [-1] * (per_stage - real)
        nxt += real
    return tuple(src)


def _head_sources(heads: int, kv_heads: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query-head sources, KV-head sources) so that `tp` divides both counts and each shard's
    query heads use only that shard's KV heads (padded query head i uses KV head i // G').

    KV head k is replicated r_k times; its G query heads are spread over the replicas, each
    replica padded to G' = max_k ceil(G / r_k) slots. Among KV counts that are multiples of
    `tp`, the one with fewest padded query heads (then fewest KV heads) wins: SmolLM2's 9/3
    heads become 12/4 at tp=4 and 16/8 at tp=8."""
    group = heads // kv_heads
    if kv_heads % tp == 0:
        return tuple(range(heads)), tuple(range(kv_heads))
    best = None
    for total in range(-(-kv_heads // tp) * tp, kv_heads * tp + 1, tp):
        reps = [total // kv_heads + (k < total % kv_heads) for k in range(kv_heads)]
        g_pad = max(-(-group // r) for r in reps)
        if best is None or (total * g_pad, total) < best[0]:
            best = ((total * g_pad, total), reps, g_pad)
    _, reps, g_pad = best
    q_src: list[int] = []
    kv_src: list[int] = []
    for k, r in enumerate(reps):
        heads_of_k = list(range(k * group, (k + 1) * group))
        for chunk in np.array_split(np.array(heads_of_k), r):
            kv_src.append(k)
            q_src += [int(h) for h in chunk] + [-1] * (g_pad - len(chunk))
    return tuple(q_src), tuple(kv_src)


def layer_windows(cfg: ModelConfig, padding: Padding) -> tuple[int, ...]:
    """Each padded layer's sliding window (0: none, identity layers too), in the padded
    order a pipeline's stages hold them; () when no layer has one."""
    if not cfg.sliding_layers:
        return ()
    src = padding.index.get("layers", tuple(range(cfg.num_layers)))
    return tuple(cfg.sliding_window if i in cfg.sliding_layers else 0 for i in src)


def layer_experts(cfg: ModelConfig, padding: Padding) -> tuple[bool, ...]:
    """Whether each padded layer runs its experts (False: its dense MLP; identity layers
    too, whose zero MLP is the cheaper no-op), in the padded order a pipeline's stages
    hold them; () unless the model mixes dense and MoE layers (`cfg.dense_layers`)."""
    if not cfg.dense_layers:
        return ()
    src = padding.index.get("layers", tuple(range(cfg.num_layers)))
    return tuple(i >= 0 and i not in cfg.dense_layers for i in src)


def pad_values(cfg: ModelConfig, values: dict, padding: Padding) -> dict[str, np.ndarray]:
    """Host arrays (name -> array, as `param_decls` declares) -> padded host arrays."""
    return {name: pad_value(decl, values[name], padding)
            for name, decl in param_decls(cfg).items()}


def pad_value(decl, value, padding: Padding) -> np.ndarray:
    """The host array of the parameter `decl` declares -> padded (itself where nothing pads)."""
    a = np.asarray(value)
    for dim, axis in enumerate(decl.axes):
        if axis in padding.index:
            a = _take_or_zero(a, padding.index[axis], dim)
    return a


def pad_blocks(name: str, decl, w: GgufWeight, padding: Padding) -> GgufWeight:
    """Host weight `name` (`decl`) in GGUF blocks -> padded: zero rows (zero blocks, whose
    weights are 0 in every format) where its block axes pad."""
    a = np.asarray(w.data)
    for dim, axis in enumerate(gguf_quantized.block_axes(name, decl.shape, decl.axes, w.kind)):
        if axis in padding.index:
            a = _take_or_zero(a, padding.index[axis], dim)
    return dataclasses.replace(w, data=a)


def pad_on_device(cfg: ModelConfig, values: dict, padding: Padding,
                  shardings: dict[str, NamedSharding]) -> dict:
    """Device arrays (unpadded) -> padded arrays, computed by XLA straight into `shardings`."""
    def pad(values):
        out = {}
        for name, decl in param_decls(cfg).items():
            a = values[name]
            for dim, axis in enumerate(decl.axes):
                if axis in padding.index:
                    a = _take_or_zero(a, padding.index[axis], dim, jnp)
            out[name] = a
        return out

    return jax.jit(pad, out_shardings=shardings)(values)


def _take_or_zero(a, src: tuple[int, ...], axis: int, xp=np):
    if list(src) == list(range(a.shape[axis])):
        return a
    idx = np.array(src)
    out = xp.take(a, np.maximum(idx, 0), axis=axis)
    keep = (idx >= 0).reshape([-1 if d == axis else 1 for d in range(a.ndim)])
    return xp.where(keep, out, xp.zeros((), a.dtype))


def padded_shapes(cfg: ModelConfig, padding: Padding) -> dict[str, tuple[int, ...]]:
    """name -> padded shape of every parameter."""
    return {name: tuple(padding.size(ax, n) for ax, n in zip(d.axes, d.shape, strict=True))
            for name, d in param_decls(cfg).items()}


# ---- meshes and shardings ------------------------------------------------------------------------


def make_mesh(layout: Layout, devices=None) -> Mesh:
    """The layout's mesh `[dp, pp, ep, tp]` over the first dp*pp*ep*tp devices (same order for
    every layout, so that replicated arrays are interchangeable between layouts). tp is the
    innermost axis: its psums run every layer, twice."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < layout.num_devices:
        raise ValueError(f"layout {layout} needs {layout.num_devices} devices; "
                         f"{len(devices)} are available")
    grid = np.array(devices[: layout.num_devices]).reshape(layout.dp, layout.pp, layout.ep,
                                                                 layout.tp)
    return Mesh(grid, MESH_AXES)


def spec(axes: tuple[str | None, ...], layout: Layout) -> P:
    """Logical axes -> PartitionSpec under `layout` (axes of degree 1 are left unsplit)."""
    parts = []
    for axis in axes:
        mesh_axis = RULES.get(axis)
        parts.append(mesh_axis if mesh_axis and getattr(layout, mesh_axis) > 1 else None)
    return P(*parts)


def logits_spec(layout: Layout, vocab: int) -> P:
    """The LM head's logits [rows, vocab]: the vocabulary split over tp, as the head's weights
    are, and within each tp shard over ep and pp, as far as their degrees divide `vocab`:
    there each device holds the whole tp shard and multiplies only its own slice of it,
    instead of every stage computing every logit (on cpu-8 pp=8, SmolLM2's head over 16 rows
    took 47.3 ms replicated, 10.1 ms split; AMD EPYC, avx512_bf16). tp is the major axis, so
    each device's slice lies inside the weights it holds."""
    axes, size = [], 1
    for axis in ("tp", "ep", "pp"):
        degree = getattr(layout, axis)
        if degree > 1 and vocab % (size * degree) == 0:
            axes.append(axis)
            size *= degree
    return P(None, tuple(axes) if axes else None)


def named_sharding(mesh: Mesh, layout: Layout, axes: tuple, shape: tuple[int, ...],
                   what: str) -> NamedSharding:
    """The sharding of one array; raises if a split axis is not divisible (never replicates)."""
    s = spec(axes, layout)
    for size, mesh_axis, axis in zip(shape, s, axes, strict=True):
        if mesh_axis is not None and size % getattr(layout, mesh_axis):
            raise ValueError(f"{what}: axis {axis!r} of size {size} does not split over "
                             f"{mesh_axis}={getattr(layout, mesh_axis)} (layout {layout}); "
                             "pad it first (sharding.padding_for)")
    return NamedSharding(mesh, s)


def param_shardings(cfg: ModelConfig, padding: Padding, layout: Layout, mesh: Mesh,
                    quant: Quantization | None = None) -> dict:
    """name -> NamedSharding of every (padded) parameter under `layout`; with `quant`, its
    quantized weights' as `QuantizedWeight`s of NamedShardings (codes and scale), "lm_head"
    included where the head is quantized (a tied model's too, which then has no "embed":
    `Quantization.tied`). Without `quant`: every parameter as placed in the model's dtype,
    before its weights are quantized."""
    shapes = padded_shapes(cfg, padding)
    decls = param_decls(cfg)
    out = {name: named_sharding(mesh, layout, d.axes, shapes[name], f"parameter {name!r}")
           for name, d in decls.items()}
    if quant is None:
        return out
    sizes = {a: n for name, d in decls.items() for a, n in zip(d.axes, shapes[name],
                                                                  strict=True)}
    for name in quant.names(decls):
        stored = _stored_shape(quant, name, decls, shapes, sizes)
        out[name] = quant.wrap(name, decls, lambda axes, name=name, stored=stored:
                               named_sharding(mesh, layout, axes, stored(axes),
                                              f"parameter {name!r}"))
    if quant.tied(decls):
        del out["embed"]
    return out


def _stored_shape(quant: Quantization, name: str, decls: dict, shapes: dict, sizes: dict):
    """axes -> the padded shape of (a part of) quantized weight `name` with those logical
    axes: its GGUF blocks' (`gguf_quantized.block_shape`), or the sizes of its axes."""
    if quant.gguf:
        d = decls[name]
        blocks = gguf_quantized.block_shape(name, shapes[name], d.axes, dict(quant.formats)[name])
        return lambda axes: blocks
    return lambda axes: tuple(sizes[a] for a in axes)


def param_specs(cfg: ModelConfig, layout: Layout, quant: Quantization | None = None) -> dict:
    """name -> PartitionSpec of every parameter under `layout` (`param_shardings`' specs)."""
    decls = param_decls(cfg)
    out = {name: spec(d.axes, layout) for name, d in decls.items()}
    for name in quant.names(decls) if quant is not None else ():
        out[name] = quant.wrap(name, decls, lambda axes: spec(axes, layout))
    if quant is not None and quant.tied(decls):
        del out["embed"]
    return out


def kv_shape(cfg: ModelConfig, padding: Padding, num_blocks: int, stored=None):
    """Shape of the stacked KV block pool, K or V: [L', NB, Hkv', BLOCK, D] (an int8 pool,
    `stored` int8: rows of D + 2, codes and scale, `kernels/kv_int8.py`)."""
    width = cfg.head_dim if stored is None else row_width(cfg.head_dim, stored)
    return (padding.size("layers", cfg.num_layers), num_blocks,
            padding.size("kv_heads", cfg.num_kv_heads), BLOCK, width)


def kv_sharding(cfg: ModelConfig, padding: Padding, layout: Layout, mesh: Mesh,
                num_blocks: int, stored=None) -> NamedSharding:
    return named_sharding(mesh, layout, KV_AXES, kv_shape(cfg, padding, num_blocks, stored),
                          "KV store")


# ---- moving between layouts ----------------------------------------------------------------------


def reshard(tree, shardings):
    """`tree` with every leaf on the matching sharding of `shardings` (same structure).

    Pure: returns the new tree. Leaves already on their target are returned as they are, so
    identical layouts cost nothing (no copy, no device work); leaves whose shards are already
    where the target puts them, under another layout's mesh, are relabelled (`_relabel`, no
    copy either)."""
    leaves, targets, treedef = _pairs(tree, shardings)
    if all(x.sharding == s for x, s in zip(leaves, targets, strict=True)):
        return tree
    moving = [i for i, (x, s) in enumerate(zip(leaves, targets, strict=True))
              if not _same(x.sharding, s, x.ndim)]
    moved = put([leaves[i] for i in moving], [targets[i] for i in moving])
    for i, x in zip(moving, moved, strict=True):
        leaves[i] = x
    leaves = [x if x.sharding == s else _relabel(x, s)
              for x, s in zip(leaves, targets, strict=True)]
    return jax.tree.unflatten(treedef, leaves)


def _relabel(x: jax.Array, target) -> jax.Array:
    """x on `target`, a sharding equivalent to its own (the same shards on the same devices)
    named after another mesh, over x's own buffers. A program's mesh comes from its inputs:
    given leaves named after two meshes of the same devices (a replicated norm still named
    after ep=2,tp=4 among weights moved to ep=4,tp=2), the layout's pack program took its
    output shardings from the wrong one and failed (IndivisibleError)."""
    return jax.make_array_from_single_device_arrays(
        x.shape, target, [shard.data for shard in x.addressable_shards])


def unshared(tree, other):
    """`tree` with each leaf that holds one of `other`'s buffers replaced by a copy (the same
    sharding, buffers of its own), so that a program may take `tree` donated while `other`
    lives on. `reshard` returns a leaf already in place as it was, or relabelled over the
    same buffers (`_relabel`): donating it deletes `other`'s leaf with it (a replicated
    final norm, moving from pp=8 to a tp=8 layout that packs, was deleted under the pp=8
    weights kept for the switch back)."""
    theirs = {s.data.unsafe_buffer_pointer()
              for x in jax.tree.leaves(other) for s in x.addressable_shards}

    def own(x):
        if theirs.isdisjoint(s.data.unsafe_buffer_pointer() for s in x.addressable_shards):
            return x
        return jax.device_put(x, x.sharding, may_alias=False)

    return jax.tree.map(own, tree)


def placed(tree, shardings) -> bool:
    """Whether every leaf of `tree` already has its shards where `shardings` puts them
    (`reshard` would copy nothing), found without moving anything."""
    leaves, targets, _ = _pairs(tree, shardings)
    return all(_same(x.sharding, s, x.ndim) for x, s in zip(leaves, targets, strict=True))


def _pairs(tree, shardings) -> tuple[list, list, object]:
    leaves, treedef = jax.tree.flatten(tree)
    return leaves, treedef.flatten_up_to(shardings), treedef


def put(arrays: list[jax.Array], shardings: list) -> list[jax.Array]:
    """`jax.device_put(arrays, shardings)`, across shardings. On the CPU backend every device's
    memory is the host's, so each array is assembled on the host and split into its new
    shards (two memcpys): XLA's cross-sharding transfer took 47-1325 ms (median 142 ms) per
    pp=8 <-> tp=8 move of SmolLM2's 324 MiB of weights on cpu-8 here, the host path 46-72 ms."""
    if all(_on_host_cpu(x) for x in arrays):
        return [jax.device_put(np.asarray(x), s) for x, s in zip(arrays, shardings, strict=True)]
    return jax.device_put(arrays, shardings)


def _on_host_cpu(x: jax.Array) -> bool:
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set)


def _same(a, b, ndim: int) -> bool:
    return a == b or a.is_equivalent_to(b, ndim)


def timed_reshard(tree, shardings) -> tuple[object, float]:
    """`reshard` and the seconds it took until the arrays were in place (0.0 when a no-op)."""
    start = time.perf_counter()
    out = reshard(tree, shardings)
    if out is tree:
        return tree, 0.0
    jax.block_until_ready(out)
    return out, time.perf_counter() - start


def restore_target(cfg: ModelConfig, padding: Padding, layout: Layout, mesh: Mesh, dtype):
    """name -> ShapeDtypeStruct with sharding: the target for orbax to restore an (unpadded)
    checkpoint straight into `layout`'s shardings (`orbax_dir.load_orbax(path, target)`).

    Axes padding pads are restored whole (padding needs the whole axis) and split by
    `pad_on_device` right after; every other axis is read shard by shard. With an identity
    padding the restored arrays are already in their final shardings."""
    out = {}
    for name, d in param_decls(cfg).items():
        axes = tuple(None if _is_padded(padding, ax, n) else ax
                     for ax, n in zip(d.axes, d.shape, strict=True))
        s = named_sharding(mesh, layout, axes, d.shape, f"parameter {name!r}")
        out[name] = jax.ShapeDtypeStruct(d.shape, dtype, sharding=s)
    return out


def _is_padded(padding: Padding, axis: str, size: int) -> bool:
    return axis in padding.index and list(padding.index[axis]) != list(range(size))


# ---- devices -------------------------------------------------------------------------------------


def ensure_cpu_devices(count: int) -> None:
    """Make JAX's CPU backend start with at least `count` virtual devices.

    Only possible before the backend starts; afterwards a clear error says how to fix it."""
    # lazy: JAX's private backend state, read only when virtual CPU devices are asked for
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        current = jax.config.jax_num_cpu_devices
        if current < count:
            jax.config.update("jax_num_cpu_devices", count)
        return
    have = len(jax.devices("cpu"))
    if have < count:
        raise RuntimeError(
            f"this mesh needs {count} CPU devices but JAX already started with {have}; create "
            f"the Engine before any other JAX use in this process, or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}")
