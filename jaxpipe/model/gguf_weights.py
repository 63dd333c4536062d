"""A GGUF file's quantized matrices kept in their blocks (`quantization="gguf"`): the decoder's
linear weights and the LM head as the file stores them, never expanded, for kernels that
decode the blocks in registers (`kernels/gguf_matmul.py`).

GGUF stores a matrix [out, in] row by row, each row its `in` weights in blocks (32 weights a
block for Q8_0 / Q4_0 / Q4_1, 256 for the K-quants) with their scales inline. A row is one
output feature, so a row of blocks is one column of the decoder's [K, N] weight: `BlockRows`
keeps a weight as [..., N, row_bytes] uint8 with N in the decoder's column order. The fused
weights are the file's rows side by side in the decoder's order: wkv the K rows then the V
rows, w_gate_up gate then up (`tensors.stack`'s [E, 2, ...] axes); layers stack along a
leading axis.

A family's value fix of a GGUF tensor (`Family.gguf_value`: llama.cpp's Q/K row interleaving)
is applied to the rows when it only reorders them, found by running it on the row numbers; a
fix that changes values keeps that weight dequantized. So does a type outside `KEPT`, or a
fused weight whose parts differ in type: `read_block_rows` leaves those out (with a log
line), and the loader's dequantized value serves them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

from jaxpipe.config.model import ModelConfig
from jaxpipe.model import gguf_quantized
from jaxpipe.model.decoder import param_decls
from jaxpipe.model.family import Family, rename
from jaxpipe.model.gguf_file import gguf_config, gguf_family, open_gguf
from jaxpipe.model.gguf_quantized import GgufWeight

log = logging.getLogger(__name__)

# The block formats kept as they are: those of the common Q4_K_M / Q8_0 files.
KEPT = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")

# The decoder's linear weights (a dense model's) and the checkpoint rows each is made of, in
# its column order (`tensors.stack`).
LINEAR = {"wq": ("q",), "wkv": ("k", "v"), "wo": ("o",), "w_gate_up": ("gate", "up"),
          "w_down": ("down",)}


@dataclass(frozen=True)
class BlockRows:
    """A weight in a GGUF block format: `data` [..., N, row_bytes] uint8, row n the K weights
    of output feature n (column n of the decoder's [K, N] weight) in `kind`'s blocks."""

    kind: str  # a GGML type's name, lower case ("q4_1")
    data: np.ndarray
    k: int

    @property
    def n(self) -> int:
        return self.data.shape[-2]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dequantize(self) -> np.ndarray:
        """The weights as f32 [..., N, K] (the gguf package's reading of the blocks)."""
        rows = self.data.reshape(-1, self.data.shape[-1])
        values = quants.dequantize(rows, GGMLQuantizationType[self.kind.upper()])
        return values.astype(np.float32).reshape(*self.data.shape[:-1], self.k)


def read_block_rows(path: Path, kinds: tuple[str, ...] = KEPT) -> dict[str, BlockRows]:
    """The linear weights of the GGUF file at `path` (a dense model's) and its LM head
    ("lm_head": the output matrix, or the token embedding when tied) whose blocks are of
    `kinds`, by decoder parameter name; the others are left out, each named in a log line."""
    reader = open_gguf(path)
    family, cfg = gguf_family(reader), gguf_config(reader)
    if cfg.is_moe:
        raise ValueError(f"{path}: GGUF blocks are read for dense models only; "
                         f"{family.name} here has {cfg.num_experts} experts")
    ours = {rename(family.gguf_names, t.name): t for t in reader.tensors}
    out = {}
    for param, parts in LINEAR.items():
        names = [f"layers.{i}.{p}" for i in range(cfg.num_layers) for p in parts]
        if all(n in ours for n in names):
            rows = _stacked(cfg, family, param, [(n, ours[n]) for n in names], kinds)
            if rows is not None:
                out[param] = BlockRows(rows[0], rows[1].reshape(
                    cfg.num_layers, -1, rows[1].shape[-1]), rows[2])
    head = ours.get("lm_head", ours.get("embed"))
    rows = _stacked(cfg, family, "lm_head", [("lm_head", head)], kinds)
    if rows is not None:
        out["lm_head"] = BlockRows(*rows)
    return out


def _stacked(cfg: ModelConfig, family: Family, param: str, tensors: list, kinds
             ) -> tuple[str, np.ndarray, int] | None:
    """(kind, the tensors' rows concatenated [sum N, row_bytes], K), or None (logged) where
    one is not in `kinds`, their kinds or K differ, or a value fix changes values."""
    types = {t.tensor_type.name.lower() for _, t in tensors}
    widths = {int(t.shape[0]) for _, t in tensors}  # GGUF's shape is [in, out]
    if len(types) != 1 or not types <= set(kinds) or len(widths) != 1:
        log.info("%s stays dequantized: its GGUF types %s are not one of %s",
                 param, sorted(types), ", ".join(kinds))
        return None
    rows = []
    for name, t in tensors:
        order = _row_order(cfg, family, name, int(t.shape[1]))
        if order is None:
            log.info("%s stays dequantized: the %s value fix of %s changes values",
                     param, family.name, name)
            return None
        rows.append(np.asarray(t.data, np.uint8)[order])
    return types.pop(), np.concatenate(rows), widths.pop()


def _row_order(cfg: ModelConfig, family: Family, name: str, n: int) -> np.ndarray | None:
    """The row permutation that the family's value fix of tensor `name` ([n, ...]) makes
    (identity for none), or None when the fix does more than reorder rows."""
    probe = np.arange(n, dtype=np.float64)[:, None] * np.ones((1, 2))
    fixed = family.gguf_value(cfg, name, probe)
    if fixed.shape != probe.shape:
        return None
    order = fixed[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(n)) or not np.array_equal(fixed,
                                                                              probe[order]):
        return None
    return order


def kept_weights(path: Path, cfg: ModelConfig) -> dict[str, GgufWeight]:
    """The weights of the GGUF file at `path` (architecture `cfg`) kept in their blocks on
    the devices (`quantization="gguf"`), as host `GgufWeight`s by parameter name; a tied
    model's head is its embedding ("embed"), whose lookup then reads the blocks too."""
    decls = param_decls(cfg)
    out = {}
    for param, rows in read_block_rows(path).items():
        name = "embed" if param == "lm_head" and "lm_head" not in decls else param
        d = decls[name]
        out[name] = gguf_quantized.host_weight(name, d.shape, d.axes, rows.kind, rows.data)
    return out
