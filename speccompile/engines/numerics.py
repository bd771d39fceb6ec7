"""Quantization numerics in numpy: FP8 E4M3, blockwise INT4, NVFP4 (E2M1 + FP8 block scales + FP32 scale).

These are the numbers the Q/DQ graphs carry. Everything here is plain numpy (+ ml_dtypes, an onnx
dependency, for the FP8 cast) so it is usable without torch, and is the reference the tests compare
ONNX (`onnx.reference.ReferenceEvaluator`) and ONNX Runtime against.

Conventions
  * FP8 E4M3FN: finite max 448, round to nearest even, values saturated to +-448 before the cast.
  * INT4: symmetric, signed [-8, 7], scale = block amax / 7, blocks along the reduction axis (axis 0 of
    a MatMul B matrix [K, N]).
  * NVFP4 (TensorRT / ModelOpt recipe): global scale s2 = amax / (6 * 448) (FP32); per block of 16 along
    the reduction axis s_blk = fp8(block_amax / 6 / s2); q = e2m1(x / (fp8(s_blk) * s2)).
    Dequantization is two chained DequantizeLinear: scale = float(s_blk_fp8) * s2, x = e2m1(q) * scale.
  * 4-bit packing (ONNX INT4/UINT4/FLOAT4E2M1 raw data): two values per byte, the first in the low nibble.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
INT4_MAX = 7.0
NVFP4_BLOCK = 16

# E2M1 magnitudes by 3-bit code (sign is bit 3).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)  # code 0..15 -> value


# ---------------------------------------------------------------- FP8 E4M3FN

def to_fp8(x: np.ndarray) -> np.ndarray:
    """Round float32 to FP8 E4M3FN (nearest even, saturating at +-448); returns ml_dtypes.float8_e4m3fn."""
    return np.clip(np.asarray(x, dtype=np.float32), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def safe_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """amax / qmax, with 1.0 where amax is 0 or not finite (scales must be positive for TensorRT)."""
    amax = np.asarray(amax, dtype=np.float32)
    scale = amax / np.float32(qmax)
    return np.where((scale > 0) & np.isfinite(scale), scale, np.float32(1.0)).astype(np.float32)


def quantize_fp8_per_channel(w: np.ndarray, axis: int = 1, scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] -> (fp8 W, float32 scale [N]) with one scale per output channel (`axis`; `scale`: these scales)."""
    w = np.asarray(w, dtype=np.float32)
    reduce_axes = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    if scale is None:
        scale = safe_scale(np.abs(w).max(axis=reduce_axes), FP8_MAX)
    scale = np.asarray(scale, np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    return to_fp8(w / scale.reshape(shape)), scale


def fp8_activation_scale(amax: float) -> np.float32:
    return np.float32(safe_scale(np.float32(amax), FP8_MAX))


# ---------------------------------------------------------------- INT8 per row

def quantize_int8_per_row(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [R, C] -> (int8 [R, C] in [-127, 127], float32 scale [R]): symmetric, one scale per row (axis 0)."""
    w = np.asarray(w, dtype=np.float32)
    scale = safe_scale(np.abs(w).max(axis=1), 127.0)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


# ---------------------------------------------------------------- 4-bit packing

def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes (0..15), any shape -> packed bytes (row-major order, first value in the low nibble)."""
    flat = np.asarray(codes, dtype=np.uint8).ravel() & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of pack_nibbles: the first `count` 4-bit codes as uint8."""
    packed = np.asarray(packed, dtype=np.uint8).ravel()
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:count]


# ---------------------------------------------------------------- INT4 blockwise

def pick_block(k: int, requested: int, minimum: int = 16) -> int | None:
    """Largest power-of-two block <= requested (>= minimum) that divides k, or None."""
    block = requested
    while block >= minimum:
        if k % block == 0:
            return block
        block //= 2
    return None


def quantize_int4_blockwise(w: np.ndarray, block: int, clip: np.ndarray | None = None,
                            scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] -> (int8 values in [-8, 7] [K, N], float32 scales [K // block, N]); blocks along axis 0.

    `clip` [K // block, N] (ratios <= 1) shrinks each block's range: values beyond it saturate.
    `scale` [K // block, N]: use these scales (a grid chosen before, e.g. by GPTQ) instead."""
    return quantize_symmetric_blockwise(w, block, INT4_MAX, -8, 7, clip, scale)


def quantize_symmetric_blockwise(w: np.ndarray, block: int, qmax: float, low: int, high: int, clip: np.ndarray | None = None,
                                 scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] -> (int8 codes in [low, high], float32 scales amax / qmax [K // block, N]); blocks along axis 0
    (`clip`, `scale`: as quantize_int4_blockwise)."""
    blocks, scale = _blocks_and_scales(w, block, qmax, clip, scale)
    k, n = w.shape
    q = np.clip(np.rint(blocks / scale[:, None, :]), low, high).astype(np.int8).reshape(k, n)
    return q, scale


def _blocks_and_scales(w: np.ndarray, block: int, qmax: float, clip: np.ndarray | None,
                       scale: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] as blocks [K/B, B, N] (float32) and their scales [K/B, N]: `scale`, or amax (times `clip`) / qmax."""
    w = np.asarray(w, dtype=np.float32)
    k, n = w.shape
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the block size {block}")
    blocks = w.reshape(k // block, block, n)
    if scale is None:
        amax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))  # max |w| without an |w| array
        if clip is not None:
            amax = (amax * np.asarray(clip, np.float32)).astype(np.float32)
        scale = safe_scale(amax, qmax)  # [K/B, N]
    return blocks, np.asarray(scale, np.float32)


def fake_quant_int4_blockwise(w: np.ndarray, block: int, clip: np.ndarray | None = None,
                              scale: np.ndarray | None = None) -> np.ndarray:
    """dequantize_int4_blockwise(*quantize_int4_blockwise(w, block, clip, scale), block), the same numbers with one
    full-size array instead of seven (the searches call it once per candidate: AWQ's 11, clipping's 7)."""
    blocks, scale = _blocks_and_scales(w, block, INT4_MAX, clip, scale)
    k, n = w.shape
    scale = scale[:, None, :]
    out = blocks / scale
    np.rint(out, out=out)
    np.clip(out, -8, 7, out=out)
    out += 0.0  # -0.0 codes to +0.0, as the int8 round trip gives them
    out *= scale
    return out.reshape(k, n)


def dequantize_int4_blockwise(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    return (q.astype(np.float32) * np.repeat(scale, block, axis=0)).astype(np.float32)


# ---------------------------------------------------------------- FP4 E2M1 / NVFP4

# Round to nearest E2M1 value: the code (0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6) is the number of midpoints below |x|.
# A tie goes to the even code: up where the code above the midpoint is even (>=), down where the one below is (>).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest E2M1 value (ties to the even code, saturating at +-6, NaN -> 0) -> uint8 codes
    0..15 (sign in bit 3; -0 and what rounds to 0 encode as +0).

    Implemented independently of ml_dtypes (tests cross-check against ml_dtypes.float4_e2m1fn): seven comparisons
    with the midpoints of the grid, no search.
    """
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    mag = np.zeros(x.shape, dtype=np.uint8)
    for midpoint, tie_up in _E2M1_MIDPOINTS:  # NaN compares False everywhere: code 0
        mag += (a >= midpoint) if tie_up else (a > midpoint)
    sign = (np.signbit(x) & (mag != 0)).view(np.uint8)
    return mag | (sign << 3)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    return E2M1_TABLE[np.asarray(codes, dtype=np.uint8) & 0x0F]


def nvfp4_global_scale(amax: float) -> np.float32:
    """FP32 second-level scale: amax / (6 * 448) (1.0 for an all-zero tensor)."""
    return np.float32(safe_scale(np.float32(amax), FP4_MAX * FP8_MAX))


def nvfp4_quantize(x: np.ndarray, global_scale: np.float32 | None = None, block: int = NVFP4_BLOCK,
                   clip: np.ndarray | None = None, block_scale: np.ndarray | None = None,
                   block_amax: np.ndarray | None = None):
    """Blockwise NVFP4 along the LAST axis of x (`clip` [..., K // block]: ratios scaling block ranges, < 1 clipping;
    `block_scale` [..., K // block] float8_e4m3fn: use these block scales, a grid chosen before, e.g. by GPTQ).

    Returns (codes uint8 [..., K] in 0..15, block scales float8_e4m3fn [..., K // block], global scale float32).
    Used for weights (x = W^T [N, K], static global scale from the weight amax) and, with a calibrated
    global scale, as the reference of TensorRT's TRT_FP4DynamicQuantize for activations. `block_amax`: the blocks'
    max |x|, when the caller computed it already (a clipping search quantizes the same x at many ratios).
    """
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"last axis {k} is not a multiple of the NVFP4 block size {block}")
    if global_scale is None:
        global_scale = nvfp4_global_scale(float(np.abs(x).max()) if x.size else 0.0)
    global_scale = np.float32(global_scale)
    blocks = x.reshape(*x.shape[:-1], k // block, block)
    if block_scale is None:
        block_amax = np.abs(blocks).max(axis=-1) if block_amax is None else block_amax
        if clip is not None:
            block_amax = (block_amax * np.asarray(clip, np.float32)).astype(np.float32)
        scale_fp8 = to_fp8(block_amax / np.float32(FP4_MAX) / global_scale)
    else:
        scale_fp8 = np.asarray(block_scale).astype(ml_dtypes.float8_e4m3fn)
    effective = scale_fp8.astype(np.float32) * global_scale  # exactly what DQ(scale_fp8, global) computes
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(effective[..., None] > 0, blocks / effective[..., None], 0.0).astype(np.float32)
    codes = e2m1_codes(scaled).reshape(x.shape)
    return codes, scale_fp8, global_scale


def nvfp4_dequantize(codes: np.ndarray, scale_fp8: np.ndarray, global_scale: np.float32, block: int = NVFP4_BLOCK) -> np.ndarray:
    """Numpy reference of the two chained DequantizeLinear nodes (float32 arithmetic, one rounding each)."""
    scale = (np.asarray(scale_fp8).astype(np.float32) * np.float32(global_scale)).astype(np.float32)
    values = e2m1_decode(codes)
    return (values * np.repeat(scale, block, axis=-1)).astype(np.float32)


def fp8_fake_quant(x: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    """x -> float32 of fp8(x / scale) * scale (what a Q/DQ pair with that scale computes)."""
    return (to_fp8(np.asarray(x, np.float32) / np.float32(scale)).astype(np.float32) * np.float32(scale)).astype(np.float32)
