"""ONNX Runtime TensorRT execution provider options for a built (or exported) artifact.

The same profiles as the native engines (from the manifest limits), an engine cache and a timing cache
inside a cache directory keyed by the graph's sha256, and strict Q/DQ handling for quantized graphs.
The runtime's `OrtSession` passes `("TensorrtExecutionProvider", tensorrt_ep_options(...))` as its first provider.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..manifest import GraphSpec, Manifest
from .profiles import profiles_for, required_limits, shapes_arg


def engine_cache_dir(manifest: Manifest, spec: GraphSpec) -> Path:
    """$SPECCOMPILE_CACHE (default ~/.cache/speccompile) / the first 16 hex digits of the graph's sha256."""
    root = Path(os.environ.get("SPECCOMPILE_CACHE", "~/.cache/speccompile")).expanduser()
    return root / manifest.files.get(spec.file, "nohash")[:16]


def tensorrt_ep_options(manifest: Manifest, spec: GraphSpec, cache_dir: str | Path | None = None,
                        builder_optimization_level: int = 3) -> dict[str, Any]:
    """Provider options dict for onnxruntime's TensorrtExecutionProvider (one explicit profile).

    `cache_dir` (created if missing) holds the engine and timing caches; default `engine_cache_dir`."""
    limits = required_limits(manifest)
    profile = profiles_for(spec, limits, "single")[0]
    cache_dir = Path(cache_dir) if cache_dir is not None else engine_cache_dir(manifest, spec)
    cache_dir.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(cache_dir),
        "trt_builder_optimization_level": str(builder_optimization_level),
        "trt_profile_min_shapes": shapes_arg({n: s[0] for n, s in profile.shapes.items()}),
        "trt_profile_opt_shapes": shapes_arg({n: s[1] for n, s in profile.shapes.items()}),
        "trt_profile_max_shapes": shapes_arg({n: s[2] for n, s in profile.shapes.items()}),
        # Q/DQ graphs carry their own precision; fp16 for the unquantized parts only when the graph is fp32
        # and not quantized would change numerics, so it stays off (export --dtype fp16 instead).
        "trt_fp16_enable": "False",
    }
    return options
