"""NumPy's statement of the quantized arithmetic (independent of jaxpipe), the reference of
the quantization tests (tests/kernel_tests/test_fp8.py, tests/model/test_quantized.py,
tests/runtime/test_pipeline.py): per-slice symmetric quantization and the float64 result of
the quantized dot, for int8 (`kernels/int8.py`'s statement) and e4m3 (`kernels/fp8.py`'s,
through ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def int8_quantize(v, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """scale = max |v| * f32(1 / 127) (1 for zeros), codes = round-half-even(v * f32(1 /
    scale)) clipped to [-127, 127], along `axis`."""
    v = np.asarray(v, np.float32)
    amax = np.max(np.abs(v), axis=axis, keepdims=True, initial=0)
    scale = np.where(amax > 0, amax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(v * (np.float32(1) / scale)), -127, 127).astype(np.int8)
    return codes, np.squeeze(scale, axis)


def fp8_quantize(v, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """scale = max |v| * f32(1 / 448) (1 for zeros), codes = e4m3(clip(v * f32(1 / scale),
    +-448))
    (ml_dtypes' cast: round to nearest even), along `axis`."""
    v = np.asarray(v, np.float32)
    amax = np.max(np.abs(v), axis=axis, keepdims=True, initial=0)
    scale = np.where(amax > 0, amax * np.float32(1 / 448), np.float32(1)).astype(np.float32)
    codes = np.clip(v * (np.float32(1) / scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return codes, np.squeeze(scale, axis)


QUANTIZE = {"int8": int8_quantize, "fp8": fp8_quantize}


def w8a8(x, w, kind: str = "int8") -> np.ndarray:
    """x [M, K] @ w [K, N] as dynamic W8A8 of `kind` computes it, in float64: x quantized per
    row, w per column, the codes' dot (exact in float64 for int8) times both scales."""
    xq, xs = QUANTIZE[kind](x, -1)
    wq, ws = QUANTIZE[kind](w, -2)
    return w8a8_codes(xq, xs, wq, ws)


def w8a8_codes(xq, xs, wq, ws) -> np.ndarray:
    """The float64 result of quantized operands: (xq @ wq) * ws[n] * xs[m]."""
    acc = np.asarray(xq, np.float64) @ np.asarray(wq, np.float64)
    return acc * np.asarray(ws, np.float64) * np.asarray(xs, np.float64)[..., None]
