"""How much a build writes, estimated from the source graph's structure before any weight is read, so that a
build that cannot fit its output's file system is refused before hours of work instead of failing at the end.

Per weight the Q/DQ pass quantizes (qdq_targets.py: the MatMul weights not excluded, the tables with
--quantize-lm-head): its codes (CODE_BYTES per element) plus its scales (SCALE_BYTES per element: float32 per
block of 32, or of --int4-block where smaller; FP8 scales per channel; NVFP4's FP8 per 16), erring high; INT4 / INT8 builds of an export with a fused CPU graph write the packed
copy of those codes too (engines/cpu_graph.py: blocks of 32, a float32 scale each). Every other initializer is
copied at its stored size, every other file of the source as it is; TensorRT engines (without --onnx-only) hold
the quantized weights once more.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from ..export.output_size import MARGIN, check_disk_space
from ..manifest import Manifest
from ..weights_file import load_graph
from .build_options import BuildOptions
from .nbits import KERNEL_BLOCK
from .qdq_targets import is_excluded, quantized_tables, weight_matmuls

CODE_BYTES = {"int4": 0.5, "nvfp4": 0.5, "int8": 1.0, "fp8": 1.0}
SCALE_BYTES = {"int4": 4 / 32, "nvfp4": 1 / 16, "int8": 4 / 32, "fp8": 0.01}
PACKED_BYTES = {"int4": 0.5 + 4 / KERNEL_BLOCK, "int8": 1.0 + 4 / KERNEL_BLOCK}  # MatMulNBits codes + scales


def _nbytes(init: onnx.TensorProto) -> int:
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    return int(np.prod(init.dims, dtype=np.int64)) * itemsize


def estimate_build_bytes(src: Path, manifest: Manifest, options: BuildOptions, packs_cpu_graph: bool) -> int:
    """Bytes `build` writes for the artifact in `src` with `options` (see the module docstring)."""
    from .quantize_graph import build_quant_options

    spec = manifest.graph("target")
    files = [f for f in manifest.files if f != spec.file and not f.startswith(spec.file + ".")]
    copied = sum((src / f).stat().st_size for f in files if (src / f).is_file())
    if options.precision == "none":
        return copied + sum((src / f).stat().st_size for f in manifest.files if f not in files) + MARGIN
    model = load_graph(src / spec.file)
    qopts = build_quant_options(options)
    quantized = {w for _, _, w in weight_matmuls(model) if not is_excluded(w, qopts.exclude)}
    quantized |= {t.name for t in quantized_tables(model, qopts)}
    elements = sum(int(np.prod(i.dims, dtype=np.int64)) for i in model.graph.initializer if i.name in quantized)
    kept = sum(_nbytes(i) for i in model.graph.initializer if i.name not in quantized)
    scale_bytes = 4 / options.int4_block if options.precision == "int4" and options.int4_block < 32 else SCALE_BYTES[options.precision]
    per_element = CODE_BYTES[options.precision] + scale_bytes
    total = copied + kept + elements * per_element
    if packs_cpu_graph and options.precision in PACKED_BYTES:
        total += elements * PACKED_BYTES[options.precision]
    if not options.onnx_only:
        total += elements * per_element
    return int(total) + MARGIN


def check_build_space(src: Path, out: Path, manifest: Manifest, options: BuildOptions, packs_cpu_graph: bool) -> None:
    """InputError about --out when its file system has less room than the build writes (before any work)."""
    folder = next(p for p in (out.absolute().parent, *out.absolute().parents) if p.exists())
    check_disk_space(folder, estimate_build_bytes(src, manifest, options, packs_cpu_graph), out, "build")
