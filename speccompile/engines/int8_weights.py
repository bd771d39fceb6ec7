"""INT8 weight-only quantization (`build --int8`): the accuracy-first choice for ONNX Runtime CPU.

Every quantized MatMul weight W [K, N] is stored as symmetric INT8 codes in blocks of 32 consecutive inputs
per output column (llama.cpp's Q8_0 grid: one scale per block, codes in [-127, 127]; `--int8-block 64`: blocks
of 64, which the packed CPU graph runs at blocks of 64 too, faster and still row-exact), behind a blocked
`DequantizeLinear(axis=0, block_size=B)`; activations stay float. Round to nearest on blocks of 32 loses little
(docs/cpu.md), so the build needs no calibration. A weight already on such a grid (a Q8_0 GGUF) keeps its codes
(engines/source_grid.py's find_int8_grid).

Where it runs: ONNX Runtime (the fused CPU graph packs the same codes for MatMulNBits at 8 bits,
engines/cpu_graph.py); TensorRT documents block scales for INT4 only, so an INT8 build is ONNX-only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InputError
from .numerics import quantize_symmetric_blockwise

INT8_BLOCK = 32  # the default: llama.cpp's Q8_0 grid
INT8_BLOCKS = (32, 64)  # --int8-block: 64 halves the scales and runs the packed CPU graph faster (docs/cpu.md)
INT8_MAX = 127


def quantize_int8_blockwise(w: np.ndarray, block: int = INT8_BLOCK, scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] -> (int8 codes [K, N] in [-127, 127], float32 scales [K / block, N]); blocks along K.
    `scale`: use these scales (a source grid) instead of amax / 127."""
    return quantize_symmetric_blockwise(w, block, INT8_MAX, -INT8_MAX, INT8_MAX, scale=scale)


def check_int8_options(options) -> None:
    """What `build --int8` accepts (engines/build.py's BuildOptions): ONNX only, no calibration-driven method."""
    if not options.onnx_only:
        raise InputError("--int8: blocked INT8 weights run on ONNX Runtime only (TensorRT documents block scales for INT4 "
                         "alone): add --onnx-only")
    methods = options.methods
    if methods.low_rank or methods.smoothquant is not None or options.min_top1 is not None or options.qad.steps:
        raise InputError("--int8 rounds to nearest on blocks of 32 (no --low-rank, --smoothquant, --min-top1 or --qad-steps)")
    options.methods = dataclasses.replace(methods, awq=False, clip=False, gptq=False)
