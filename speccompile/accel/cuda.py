"""The CUDA driver API through ctypes (libcuda ships with the driver): no torch, no cuda-python."""

from __future__ import annotations

import ctypes
import ctypes.util

from ..errors import HardwareError


class CudaDriver:
    """Minimal CUDA driver API over ctypes: device query, memory, streams (primary context of the device)."""

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


def gpu_info(device: int = 0) -> tuple[str, tuple[int, int]]:
    """(device name, compute capability) of a GPU, or HardwareError."""
    driver = CudaDriver(device)
    return driver.name(), driver.compute_capability()
