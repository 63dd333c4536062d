"""A weight kept in a GGUF file's quantized blocks in the params tree (`quantization="gguf"`):
`GgufWeight`, the pytree beside `quantized.QuantizedWeight`, and how it is laid out, sharded,
padded and counted.

The blocks are the file's rows (`gguf_weights.BlockRows`): row n holds the K weights of
output feature n. On the devices a weight is `data` [*lead, *n_shape, R] uint8: the layer
axis (if any), the decoder's output (N) axes unflattened, then one row's bytes. So its
logical axes are the weight's without the contracted ones (`quantized.CONTRACTED`), plus
`ROW_BYTES` (never split): it shards over layers (pp) and its N axes as the float weight
did, and padded N entries (layers, vocab, heads) are zero rows, i.e. zero blocks, whose
weights are all 0 in every format. The contracted shape is static (`k_shape`), so the
weight offers what the model uses of an array: `shape` (the float weight's), a leading
index and `reshape` to [..., K, N], and `dot` is XLA's reference of the format
(`kernels/gguf_blocks.py`); the step's kernel reads the stack in place
(`runtime/pipeline.py`).

The row-split weights (`wo`, `w_down`: tensor parallelism splits their K) keep each row's
bytes as groups of whole blocks along a logical axis of their own (`GROUPS`), before the
bytes: `data` [*lead, *n_shape, G, R / G] (`grouped`). One group spans `k_shape` of the
float K (`wo`: (1, head_dim), a head, where head_dim is whole blocks, so its axis is
"heads" and pads and splits as the float weight's heads do; `w_down`: one block,
"mlp_blocks"), so a tp shard holds whole blocks of its K slice, and its rows are the
groups' bytes side by side: the blocks of a row of K / tp weights, read as any row is.

A tied model's token embedding is kept as the blocks too (as "embed": the LM head multiplies
by it, and `lookup` gathers the token rows and dequantizes only those), so no float copy of
the embedding exists.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.kernels import gguf_blocks

ROW_BYTES = "row_bytes"  # the logical axis of a row's bytes: never split
# The contracted (K) axes of each weight kept in blocks: `quantized.CONTRACTED`'s, and the
# tied embedding's [V, E] (its rows are the head's).
CONTRACTED = {"wq": ("embed",), "wkv": ("embed",), "wo": ("heads", "head_dim"),
              "w_gate_up": ("embed",), "w_down": ("mlp",), "lm_head": ("embed",),
              "embed": ("embed",)}
# The row-split weights' group axes (`grouping`): wo's rows in heads, w_down's in blocks.
GROUPS = {"wo": "heads", "w_down": "mlp_blocks"}


@partial(jax.tree_util.register_dataclass, data_fields=["data"],
         meta_fields=["kind", "k_shape", "n_ndim", "grouped"])
@dataclasses.dataclass(frozen=True)
class GgufWeight:
    """A weight as GGUF block rows: `data` [*lead, *n_shape, R] uint8 (R: a row's bytes in
    `kind`'s blocks), its contracted shape `k_shape` and the number of its N axes `n_ndim`.
    As an array it is the float weight [*lead, *k_shape, *n_shape]. `grouped`: `data` is
    [*lead, *n_shape, G, R / G], each row's blocks in G groups of the float K shape
    `k_shape` (the K of the groups together: `k_dims`)."""

    data: jax.Array
    kind: str  # a `gguf_blocks.FORMATS` name ("q4_1")
    k_shape: tuple[int, ...]
    n_ndim: int = 1
    grouped: bool = False

    @property
    def _n_at(self) -> int:
        return self.data.ndim - 1 - self.grouped - self.n_ndim

    @property
    def k_dims(self) -> tuple[int, ...]:
        """The contracted shape of the weight this holds (a tp shard's, in a shard_map)."""
        return k_of(self.k_shape, self.data.shape[-2] if self.grouped else None)

    @property
    def shape(self) -> tuple[int, ...]:
        n_at = self._n_at
        return (*self.data.shape[:n_at], *self.k_dims,
                *self.data.shape[n_at:n_at + self.n_ndim])

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, i) -> GgufWeight:
        """A leading index: layer i of a stacked weight."""
        return GgufWeight(self.data[i], self.kind, self.k_shape, self.n_ndim, self.grouped)

    def reshape(self, *shape) -> GgufWeight:
        """The weight as `shape`: its own, or [*lead, K, N] (N the N axes flattened, in
        order; one size may be -1, as numpy's)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(math.prod(self.shape) // known if d == -1 else d for d in shape)
        if shape == self.shape:
            return self
        *lead, k, n = shape
        if k != math.prod(self.k_dims) or math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"GgufWeight {self.shape}: reshape to [..., K, N] keeps K "
                             f"{math.prod(self.k_dims)}; got {shape}")
        rows = self.rows()
        return GgufWeight(rows.reshape(*lead, n, rows.shape[-1]), self.kind, (k,))

    def rows(self) -> jax.Array:
        """The blocks as [*lead, N, R] (N the N axes flattened; a grouped weight's groups
        side by side: each row's blocks in order)."""
        n_at = self._n_at
        n = math.prod(self.data.shape[n_at:n_at + self.n_ndim])
        r = math.prod(self.data.shape[n_at + self.n_ndim:])
        return self.data.reshape(*self.data.shape[:n_at], n, r)

    def data_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of `data` for the float weight [shape] (this weight's meta, e.g. a
        `GgufWeight` of shardings, and a padded shape), its row's bytes as 0."""
        lead = len(shape) - len(self.k_shape) - self.n_ndim
        groups = (math.prod(shape[lead:lead + len(self.k_shape)]) // math.prod(self.k_shape),)
        return (*shape[:lead], *shape[len(shape) - self.n_ndim:],
                *(groups if self.grouped else ()), 0)

    def dot(self, x) -> jax.Array:
        """x [M, K] @ this weight (no lead) as [K, N] -> [M, N] f32: XLA's reference of the
        format (x quantized per block as llama.cpp does)."""
        return gguf_blocks.reference(x, self.rows(), gguf_blocks.format_of(self.kind))

    def lookup(self, tokens) -> jax.Array:
        """The rows of `tokens` [...] dequantized: [..., K] f32 (an embedding's lookup;
        only the gathered rows are decoded)."""
        rows = jnp.take(self.rows(), tokens, axis=0)  # [..., R]
        return gguf_blocks.dequantize(rows, gguf_blocks.format_of(self.kind))


def k_of(unit: tuple[int, ...], groups: int | None) -> tuple[int, ...]:
    """The contracted shape of `groups` groups of float K shape `unit` (None: `unit` is the
    whole K, ungrouped)."""
    return unit if groups is None else (groups * unit[0], *unit[1:])


def grouping(name: str, k: tuple[int, ...], kind: str) -> tuple[str, tuple[int, ...]] | None:
    """(the logical axis, the float K shape of one group) of row-split weight `name` (K shape
    `k`) in `kind`'s blocks (`GROUPS`); None for the others, and for a `wo` whose head_dim is
    not whole blocks (its K is then never split: `check_splits`)."""
    axis, block = GROUPS.get(name), gguf_blocks.format_of(kind).block
    if axis == "heads" and k[-1] % block == 0:
        return axis, (1, k[-1])
    if axis == "mlp_blocks":
        return axis, (block,)
    return None


def block_axes(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str
               ) -> tuple[str, ...]:
    """The logical axes of weight `name` [shape]'s blocks: its axes without the contracted
    ones, its group axis where it has one (`grouping`), then `ROW_BYTES`."""
    group = grouping(name, k_shape(name, shape, axes), kind)
    rest = tuple(a for a in axes if a not in CONTRACTED[name])
    return (*rest, group[0], ROW_BYTES) if group else (*rest, ROW_BYTES)


def k_shape(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:
    """The contracted shape of weight `name` [shape] (logical `axes`)."""
    return tuple(s for s, a in zip(shape, axes, strict=True) if a in CONTRACTED[name])


def block_shape(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str
                ) -> tuple[int, ...]:
    """The shape of weight `name` [shape]'s blocks (`block_axes`)."""
    fmt, k = gguf_blocks.format_of(kind), k_shape(name, shape, axes)
    rest = tuple(s for s, a in zip(shape, axes, strict=True) if a not in CONTRACTED[name])
    group = grouping(name, k, kind)
    if group is None:
        return (*rest, gguf_blocks.row_bytes(fmt, math.prod(k)))
    unit = math.prod(group[1])
    return (*rest, math.prod(k) // unit, gguf_blocks.row_bytes(fmt, unit))


def wrap(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str, fn
         ) -> GgufWeight:
    """`GgufWeight(fn(block axes), ...)`: a tree of specs or shardings for weight `name`
    [shape] (the float shape) matching its weight's tree."""
    group = grouping(name, k_shape(name, shape, axes), kind)
    n_ndim = len(block_axes(name, shape, axes, kind)) - 1 - bool(group) - ("layers" in axes)
    return GgufWeight(fn(block_axes(name, shape, axes, kind)), kind,
                      group[1] if group else k_shape(name, shape, axes), n_ndim, bool(group))


def check_splits(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str,
                 tp: int) -> None:
    """Raise, naming the weight and its format, where `tp` cannot split weight `name`
    [shape] (unpadded) in `kind`'s blocks as the float weight splits: a row-split weight's
    K must be whole blocks on every shard (`grouping`). wo's heads are padded to whole
    shards (`sharding.Padding`); w_down's blocks are not (its K is not padded)."""
    if tp == 1 or name not in GROUPS:
        return
    k, block = k_shape(name, shape, axes), gguf_blocks.format_of(kind).block
    group = grouping(name, k, kind)
    if group is None:
        raise ValueError(f"quantization='gguf': {name} is {kind} (blocks of {block} weights) "
                         f"and its heads are {k[-1]} wide, so tp={tp} cannot split its rows "
                         "by heads; use pp, or quantization='none' / 'int8' for tp > 1")
    groups = math.prod(k) // math.prod(group[1])
    if group[0] == "mlp_blocks" and groups % tp:  # (heads are padded to whole shards)
        raise ValueError(f"quantization='gguf': {name} is {kind} (blocks of {block} "
                         f"weights): its rows of {math.prod(k)} are {groups} groups of "
                         f"{math.prod(group[1])}, which tp={tp} does not split; use a tp "
                         f"dividing {groups}, pp, or quantization='none' / 'int8'")


def host_weight(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str,
                rows: np.ndarray) -> GgufWeight:
    """The host weight of file rows [*lead, N, R] (`gguf_weights.BlockRows.data`) for weight
    `name` [shape] (unpadded): the N axes unflattened."""
    data = np.asarray(rows).reshape(block_shape(name, shape, axes, kind))
    return wrap(name, shape, axes, kind, lambda _: data)


def stored_bytes(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str) -> int:
    """Bytes of weight `name` [shape] kept in `kind`'s blocks."""
    return math.prod(block_shape(name, shape, axes, kind))
