"""MXFP4 checkpoints (the published gpt-oss models): their quantization config and the dequantization of their
expert tensors, with the values transformers' own dequantization gives.

An MXFP4 tensor is stored as `{name}_blocks` (uint8 [..., rows, groups, 16]) and `{name}_scales` (uint8 [..., rows,
groups]): each row is cut into groups of 32 values along its last axis; a group is 16 bytes of 4-bit FP4 (e2m1)
codes, the low nibble of byte j being value 2j and the high nibble value 2j + 1, and one shared scale 2^(s - 127)
stored as its biased exponent s. transformers multiplies each code's value by that power of two in float32 and
returns the tensor transposed, [..., groups * 32, rows]: for gpt-oss' `gate_up_proj` ([experts, 2 * inter, ...]
stored) that is [experts, hidden, 2 * inter], for `down_proj` [experts, inter, hidden].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError, UnsupportedError

FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)  # code -> value
SCALE_BIAS = 127  # a group's scale is 2^(s - SCALE_BIAS)
GROUP = 32  # values per scale (16 bytes)
QUANT_METHODS = ("mxfp4",)  # `quantization_config.quant_method` values a Hugging Face folder may declare


def dequantize_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 blocks [..., rows, groups, 16] and scales [..., rows, groups] -> float32 [..., rows, groups * 32]
    (the stored row order: a gpt-oss expert's Linear weight [out, in])."""
    blocks = np.asarray(blocks)
    codes = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), dtype=np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    exponents = np.asarray(scales, dtype=np.int32)[..., None] - SCALE_BIAS
    with np.errstate(over="ignore"):  # s = 255: +-inf for a nonzero code, as torch.ldexp gives
        values = np.ldexp(FP4_E2M1[codes], exponents).astype(np.float32, copy=False)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 2 * blocks.shape[-1])


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' layout: float32 [..., groups * 32, rows] (gpt-oss' fused `gate_up_proj` / `down_proj`)."""
    return np.swapaxes(dequantize_rows(blocks, scales), -1, -2)


def check_pair(blocks: tuple[int, ...], blocks_dtype: Any, scales: tuple[int, ...] | None, scales_dtype: Any,
               name: str, where: str) -> None:
    """InputError (one line, naming `where` and the tensor) unless `name`_blocks / `name`_scales are an MXFP4 pair."""
    if scales is None:
        raise InputError(f"{where}: {name}_blocks has no {name}_scales (an MXFP4 tensor needs both)")
    if (np.dtype(blocks_dtype) != np.uint8 or np.dtype(scales_dtype) != np.uint8 or len(blocks) < 3
            or blocks[-1] != GROUP // 2 or tuple(blocks[:-1]) != tuple(scales)):
        raise InputError(f"{where}: {name}_blocks {list(blocks)} / {name}_scales {list(scales)} are not MXFP4 "
                         f"(uint8 [..., groups, {GROUP // 2}] and uint8 [..., groups])")


def check_quantization_config(raw: dict[str, Any], where: str) -> None:
    """Refuse (one line naming `where` and the key) a `quantization_config` whose method is not MXFP4: its tensors
    would be read as plain weights."""
    if "quantization_config" not in raw or raw["quantization_config"] is None:
        return
    quant = raw["quantization_config"]
    if not isinstance(quant, dict) or not isinstance(quant.get("quant_method"), str):
        raise InputError(f"{where}: quantization_config.quant_method is missing (expected one of {', '.join(QUANT_METHODS)})")
    method = quant["quant_method"]
    if method.lower() not in QUANT_METHODS:
        raise UnsupportedError(f"{where}: quantization_config.quant_method '{method}' is not supported (only "
                               f"{', '.join(QUANT_METHODS)}: gpt-oss' experts, dequantized on load); save the model "
                               "dequantized (bf16 / fp32) first")
