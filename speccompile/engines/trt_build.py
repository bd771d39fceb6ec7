"""The engine build with the TensorRT Python API (needs TensorRT and a GPU; untested without one).

The import guard and the GPU query are shared with the runtime: `accel/trt.py`, `accel/cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

from ..accel.profiles import Profile
from ..errors import SpecCompileError
from .config import BuildConfig


class _Logger:
    def __init__(self, trt, verbose: bool = False):
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)


def build_engine(trt, onnx_path: Path, config: BuildConfig, profiles: list[Profile], verbose: bool = False) -> bytes:
    """Parse the ONNX file and build a serialized engine (plan) with the given profiles and flags."""
    logger = _Logger(trt, verbose).logger
    builder = trt.Builder(logger)
    flags = 0
    for name in config.network_flags:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecCompileError(f"{onnx_path.name}: TensorRT ONNX parser failed: {errors or 'unknown error'}")
    build_config = builder.create_builder_config()
    for name in config.builder_flags:
        build_config.set_flag(getattr(trt.BuilderFlag, name))
    if config.workspace_mb:
        build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_mb << 20)
    build_config.builder_optimization_level = config.builder_optimization_level
    for profile in profiles:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile.shapes.items():
            p.set_shape(name, tuple(lo), tuple(opt), tuple(hi))
        build_config.add_optimization_profile(p)
    cache_path = Path(config.timing_cache) if config.timing_cache else None
    cache = build_config.create_timing_cache(cache_path.read_bytes() if cache_path and cache_path.is_file() else b"")
    build_config.set_timing_cache(cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, build_config)
    if plan is None:
        raise SpecCompileError(f"{onnx_path.name}: TensorRT engine build failed (see the TensorRT log above)")
    if cache_path is not None:
        cache_path.write_bytes(bytes(build_config.get_timing_cache().serialize()))
    return bytes(plan)
