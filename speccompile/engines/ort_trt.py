"""ONNX Runtime TensorRT execution provider options for a built (or exported) artifact.

The same profiles as the native engines (from the manifest limits), an engine cache and a timing cache
inside a cache directory, and strict Q/DQ handling for quantized graphs. `OrtSession` can pass
`("TensorrtExecutionProvider", tensorrt_ep_options(...))` as its first provider.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..manifest import GraphSpec, Manifest
from .config import profiles_for, required_limits


def _shapes_arg(shapes: dict[str, list[int]]) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())


def tensorrt_ep_options(manifest: Manifest, spec: GraphSpec, cache_dir: str | Path, builder_optimization_level: int = 3) -> dict[str, Any]:
    """Provider options dict for onnxruntime's TensorrtExecutionProvider (one explicit profile)."""
    limits = required_limits(manifest)
    profile = profiles_for(spec, limits, "single")[0]
    cache_dir = Path(cache_dir)
    options: dict[str, Any] = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache_dir),
        "trt_builder_optimization_level": str(builder_optimization_level),
        "trt_profile_min_shapes": _shapes_arg({n: s[0] for n, s in profile.shapes.items()}),
        "trt_profile_opt_shapes": _shapes_arg({n: s[1] for n, s in profile.shapes.items()}),
        "trt_profile_max_shapes": _shapes_arg({n: s[2] for n, s in profile.shapes.items()}),
        # Q/DQ graphs carry their own precision; fp16 for the unquantized parts only when the graph is fp32
        # and not quantized would change numerics, so it stays off (export --dtype fp16 instead).
        "trt_fp16_enable": "False",
    }
    return options
