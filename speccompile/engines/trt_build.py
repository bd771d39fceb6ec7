"""The parts that need TensorRT and a GPU: import guard, GPU query, engine build. Untested without a GPU.

The CUDA queries use the driver API through ctypes (libcuda ships with the driver), so neither torch nor
cuda-python is required.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any

from ..errors import HardwareError, SpecCompileError, UnsupportedError
from .config import BuildConfig, Profile

TRT_MISSING = (
    "TensorRT is not installed (pip install tensorrt, on a machine with an NVIDIA GPU); "
    "use --onnx-only to write the quantized ONNX graphs and trtexec commands without building engines"
)


def import_tensorrt():
    """The tensorrt module, or None when it is not importable (not installed, or its libraries are missing)."""
    try:
        import tensorrt as trt  # noqa: PLC0415
    except (ImportError, OSError):
        return None
    if not hasattr(trt, "Builder"):  # the PyPI placeholder package
        return None
    return trt


def require_tensorrt():
    trt = import_tensorrt()
    if trt is None:
        raise UnsupportedError(TRT_MISSING)
    return trt


class CudaDriver:
    """Minimal CUDA driver API over ctypes: device query, memory, streams (primary context of device 0)."""

    def __init__(self, device: int = 0):
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(name)
        except OSError:
            raise HardwareError("no NVIDIA driver found (libcuda); TensorRT engines need an NVIDIA GPU") from None
        self._check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.device = dev.value
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.context = ctx

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise HardwareError(f"CUDA driver call {what} failed with error {status}")

    def name(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self._check(self.lib.cuDeviceGetName(buf, 256, self.device), "cuDeviceGetName")
        return buf.value.decode(errors="replace")

    def compute_capability(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(major), 75, self.device), "cuDeviceGetAttribute")
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, self.device), "cuDeviceGetAttribute")
        return major.value, minor.value

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(int(nbytes), 1))), "cuMemAlloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self.lib.cuMemFree_v2(ctypes.c_uint64(ptr))

    def htod(self, dst: int, src, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            self._check(self.lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)), "cuMemcpyHtoD")

    def dtoh(self, dst, src: int, nbytes: int, stream: int = 0) -> None:
        if nbytes:
            self._check(self.lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)), "cuMemcpyDtoH")

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.byref(s), 0), "cuStreamCreate")
        return s.value or 0

    def sync(self, stream: int) -> None:
        self._check(self.lib.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")


def gpu_info() -> tuple[str, tuple[int, int]]:
    """(device name, compute capability) of GPU 0, or HardwareError."""
    driver = CudaDriver()
    return driver.name(), driver.compute_capability()


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


def engine_io(trt, plan: bytes) -> dict[str, Any]:
    """Input/output names of a serialized engine (for checks)."""
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan)
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    return {
        "inputs": [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT],
        "outputs": [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT],
    }
