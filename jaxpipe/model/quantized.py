"""Weights stored quantized (`EngineConfig.quantization`): what a quantized weight is in the
params tree, which weights are quantized, and the shardings of their parts.

A quantized weight is a pytree, `QuantizedWeight(codes, scale)`: codes in the weight's own
shape and logical axes (so it shards, pads and moves between layouts exactly as the float
weight did), and a scale per output channel, whose axes are the weight's with the contracted
ones (`CONTRACTED`) removed: it shards with the weight's N axes. The arithmetic of each kind
is its module's (`kernels/int8.py`, `kernels/fp8.py`); `dot` is XLA's path for every caller
(`decoder.xla_dot`), the C++ int8 kernel is the step's (`runtime/pipeline.py`).

Weights are quantized once, on the devices, right after each is placed in the first layout
(`quantize`): the float copy of a weight is dropped as soon as its codes exist. A tied LM
head is quantized from the embedding's transpose [E, V] and is then the model's only copy of
it: the embedding lookup gathers the tokens' columns of the codes and dequantizes just them
(`QuantizedWeight.rows`; the per-output-channel scale of an [E, V] head is a scale per
vocabulary entry), and the float embedding is dropped (`Quantization.tied`).
`quantization="gguf"` keeps a GGUF file's own blocks instead (`GgufWeight`,
`model/gguf_quantized.py`): which weights, and in which format, is the file's
(`Quantization.formats`); a tied head is then the "embed" weight's blocks.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxpipe.kernels import fp8, int8
from jaxpipe.model import gguf_quantized
from jaxpipe.model.gguf_quantized import GgufWeight

KINDS = {"int8": int8, "fp8": fp8}  # kind -> the module of its arithmetic
# The quantized weights and their contracted (K) logical axes: `decoder._matmul`'s first n
# axes after "layers" (and "experts"); everything else of the weight is its N.
CONTRACTED = {"wq": ("embed",), "wkv": ("embed",), "wo": ("heads", "head_dim"),
              "w_gate_up": ("embed",), "w_down": ("mlp",), "w_experts_gate_up": ("embed",),
              "w_experts_down": ("moe_mlp",), "lm_head": ("embed",)}
HEAD_AXES = ("embed", "vocab")  # the quantized LM head, tied or not: [E, V]


@partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale"],
         meta_fields=["kind"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight as codes (its shape; int8 or e4m3) and a scale per output channel (f32, the
    shape without the contracted axes). As an array it offers what the model uses of one:
    shape, dtype (the codes'), a leading index (a layer of a stack) and `reshape` to a
    [..., K, N] form, which reshapes the scale to [..., N]."""

    codes: jax.Array
    scale: jax.Array
    kind: str = "int8"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.codes.dtype

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def __getitem__(self, i) -> QuantizedWeight:
        """A leading index: layer i of a stacked weight (its scale's layer i)."""
        return QuantizedWeight(self.codes[i], self.scale[i], self.kind)

    def reshape(self, *shape: int) -> QuantizedWeight:
        """The codes as `shape`, which must be the weight as [..., K, N] (or its own shape);
        the scale as [..., N]. As numpy's: a tuple or the sizes, one of them -1."""
        codes = self.codes.reshape(*shape)
        if codes.shape == self.codes.shape:
            return self
        return QuantizedWeight(codes, self.scale.reshape(*codes.shape[:-2], codes.shape[-1]),
                               self.kind)

    def rows(self, ids) -> jax.Array:
        """This [K, N] weight read as [N, K] at rows `ids` [...] (a tied LM head [E, V] read
        as the embedding [V, E]): the ids' columns of the codes times their scales, f32
        [..., K], exactly those rows of the dequantized weight. Natural order; XLA
        partitions the gather of a sharded weight."""
        codes = jnp.moveaxis(jnp.take(self.codes, ids, axis=-1), 0, -1)  # [..., K]
        return dequantize_rows(codes, jnp.take(self.scale, ids, axis=-1))

    def dot(self, x) -> jax.Array:
        """x [M, K] @ this weight as [K, N] -> [M, N] f32, through XLA (`KINDS[kind]`)."""
        return KINDS[self.kind].reference(x, self.codes, self.scale)


GGUF = "gguf"  # the kind whose weights are a GGUF file's blocks (`GgufWeight`)


def check_kind(kind: str) -> str:
    if kind not in KINDS and kind != GGUF:
        raise ValueError(f"quantization must be one of {', '.join(KINDS)}, {GGUF} (or "
                         f"'none'); got {kind!r}")
    return kind


@dataclasses.dataclass(frozen=True)
class Quantization:
    """Which weights a runner keeps quantized and how: `kind` ("int8", "fp8" or "gguf"),
    and whether the LM head is (`lm_head`; False keeps it in the model's dtype). "gguf":
    `formats`, the weights kept in the file's blocks and their formats ((name, format)
    pairs; a tied model's head is "embed"), and `lm_head` whether the head is one of them."""

    kind: str
    lm_head: bool = True
    formats: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        check_kind(self.kind)

    @property
    def gguf(self) -> bool:
        return self.kind == GGUF

    def names(self, decls: dict) -> tuple[str, ...]:
        """The quantized weights of a model (`decoder.param_decls`), "lm_head" included
        (also for tied embeddings) when the head is quantized; "gguf": those of `formats`."""
        if self.gguf:
            return tuple(n for n, _ in self.formats if n in decls)
        names = tuple(n for n in CONTRACTED if n in decls and n != "lm_head")
        return names + (("lm_head",) if self.lm_head else ())

    def tied(self, decls: dict) -> bool:
        """Whether the model's embedding is read from its quantized LM head (tied
        embeddings, the head quantized): then no float "embed" is kept."""
        return not self.gguf and self.lm_head and "lm_head" not in decls

    def axes(self, name: str, decls: dict) -> tuple[str, ...]:
        """The weight's logical axes as stored quantized (the tied head: [E, V])."""
        return HEAD_AXES if name == "lm_head" else decls[name].axes

    def wrap(self, name: str, decls: dict, fn) -> QuantizedWeight | GgufWeight:
        """`QuantizedWeight(fn(codes' axes), fn(scale's axes))` ("gguf": `GgufWeight(fn(block
        axes))`): a tree of specs or shardings for weight `name`."""
        if self.gguf:
            return gguf_quantized.wrap(name, decls[name].shape, decls[name].axes,
                                       dict(self.formats)[name], fn)
        axes = self.axes(name, decls)
        return QuantizedWeight(fn(axes), fn(scale_axes(name, axes)), self.kind)

    def stored_bytes(self, name: str, decls: dict) -> int:
        """Bytes of weight `name` as stored quantized (unpadded)."""
        if self.gguf:
            d = decls[name]
            return gguf_quantized.stored_bytes(name, d.shape, d.axes, dict(self.formats)[name])
        shape = decls[name].shape if name in decls else decls["embed"].shape[::-1]
        return quantized_bytes(name, shape, self.axes(name, decls))


def scale_axes(name: str, axes: tuple[str, ...]) -> tuple[str, ...]:
    """A quantized weight's scale axes: its axes without the contracted ones."""
    return tuple(a for a in axes if a not in CONTRACTED[name])


def dequantize_rows(codes, scale) -> jax.Array:
    """codes [..., K] (int8 or e4m3) times scale [...] -> f32 [..., K]: rows of a quantized
    weight read as [N, K], each scaled by its own output channel's scale."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def quantize(w, name: str, axes: tuple[str, ...], kind: str) -> QuantizedWeight:
    """Weight `name` (logical `axes`) quantized per output channel: reshaped to [lead, K, N]
    (the axes before the contracted ones, these, the rest), quantized by `kind`'s
    `quantize_weight`, and back to its shape."""
    k_pos = [i for i, a in enumerate(axes) if a in CONTRACTED[name]]
    lead = w.shape[:k_pos[0]]
    k = math.prod(w.shape[i] for i in k_pos)
    n_shape = w.shape[k_pos[-1] + 1:]
    codes, scale = KINDS[kind].quantize_weight(
        jnp.asarray(w, jnp.float32).reshape(*lead, k, math.prod(n_shape)))
    return QuantizedWeight(codes.reshape(w.shape), scale.reshape(*lead, *n_shape), kind)


def quantize_program(name: str, axes: tuple[str, ...], kind: str, shardings, transpose=False):
    """jit(float weight) -> its `QuantizedWeight` placed in `shardings` (a QuantizedWeight
    of NamedShardings); `transpose`: of the weight's transpose (a tied head from [V, E])."""
    def run(w):
        return quantize(w.T if transpose else w, name, axes, kind)

    return jax.jit(run, out_shardings=shardings)


def quantized_bytes(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> int:
    """Bytes of weight `name` [shape] stored quantized: a byte a code, 4 a scale."""
    n = math.prod(s for s, a in zip(shape, axes, strict=True) if a not in CONTRACTED[name])
    return math.prod(shape) + 4 * n
