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


@partial(jax.tree_util.register_dataclass, data_fields=["data"],
         meta_fields=["kind", "k_shape", "n_ndim"])
@dataclasses.dataclass(frozen=True)
class GgufWeight:
    """A weight as GGUF block rows: `data` [*lead, *n_shape, R] uint8 (R: a row's bytes in
    `kind`'s blocks), its contracted shape `k_shape` and the number of its N axes `n_ndim`.
    As an array it is the float weight [*lead, *k_shape, *n_shape]."""

    data: jax.Array
    kind: str  # a `gguf_blocks.FORMATS` name ("q4_1")
    k_shape: tuple[int, ...]
    n_ndim: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        n_at = self.data.ndim - 1 - self.n_ndim
        return (*self.data.shape[:n_at], *self.k_shape, *self.data.shape[n_at:-1])

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, i) -> GgufWeight:
        """A leading index: layer i of a stacked weight."""
        return GgufWeight(self.data[i], self.kind, self.k_shape, self.n_ndim)

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
        if k != math.prod(self.k_shape) or math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"GgufWeight {self.shape}: reshape to [..., K, N] keeps K "
                             f"{math.prod(self.k_shape)}; got {shape}")
        return GgufWeight(self.data.reshape(*lead, n, self.data.shape[-1]), self.kind, (k,))

    def rows(self) -> jax.Array:
        """The blocks as [*lead, N, R] (N the N axes flattened)."""
        n_at = self.data.ndim - 1 - self.n_ndim
        return self.data.reshape(*self.data.shape[:n_at], -1, self.data.shape[-1])

    def dot(self, x) -> jax.Array:
        """x [M, K] @ this weight (no lead) as [K, N] -> [M, N] f32: XLA's reference of the
        format (x quantized per block as llama.cpp does)."""
        return gguf_blocks.reference(x, self.rows(), gguf_blocks.format_of(self.kind))

    def lookup(self, tokens) -> jax.Array:
        """The rows of `tokens` [...] dequantized: [..., K] f32 (an embedding's lookup;
        only the gathered rows are decoded)."""
        rows = jnp.take(self.rows(), tokens, axis=0)  # [..., R]
        return gguf_blocks.dequantize(rows, gguf_blocks.format_of(self.kind))


def block_axes(name: str, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The logical axes of weight `name`'s blocks: its axes without the contracted ones, then
    `ROW_BYTES`."""
    return (*(a for a in axes if a not in CONTRACTED[name]), ROW_BYTES)


def k_shape(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:
    """The contracted shape of weight `name` [shape] (logical `axes`)."""
    return tuple(s for s, a in zip(shape, axes, strict=True) if a in CONTRACTED[name])


def block_shape(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str
                ) -> tuple[int, ...]:
    """The shape of weight `name` [shape]'s blocks (`block_axes`)."""
    k = math.prod(k_shape(name, shape, axes))
    rest = tuple(s for s, a in zip(shape, axes, strict=True) if a not in CONTRACTED[name])
    return (*rest, gguf_blocks.row_bytes(gguf_blocks.format_of(kind), k))


def wrap(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str, fn
         ) -> GgufWeight:
    """`GgufWeight(fn(block axes), ...)`: a tree of specs or shardings for weight `name`
    [shape] (the padded float shape) matching its weight's tree."""
    n_ndim = len(block_axes(name, axes)) - 1 - ("layers" in axes)
    return GgufWeight(fn(block_axes(name, axes)), kind, k_shape(name, shape, axes), n_ndim)


def host_weight(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str,
                rows: np.ndarray) -> GgufWeight:
    """The host weight of file rows [*lead, N, R] (`gguf_weights.BlockRows.data`) for weight
    `name` [shape] (unpadded): the N axes unflattened."""
    data = np.asarray(rows).reshape(block_shape(name, shape, axes, kind))
    return wrap(name, shape, axes, kind, lambda _: data)


def stored_bytes(name: str, shape: tuple[int, ...], axes: tuple[str, ...], kind: str) -> int:
    """Bytes of weight `name` [shape] kept in `kind`'s blocks."""
    return math.prod(block_shape(name, shape, axes, kind))
