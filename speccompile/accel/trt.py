"""TensorRT as an optional dependency: the import guard, version parsing, and the check that a serialized
engine matches the TensorRT version and GPU it is about to run on."""

from __future__ import annotations

import re
from typing import Any

from ..errors import ArtifactError, HardwareError, InputError, UnsupportedError

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
    """The tensorrt module, or UnsupportedError saying how to get it."""
    trt = import_tensorrt()
    if trt is None:
        raise UnsupportedError(TRT_MISSING)
    return trt


def trt_major(version: str) -> int:
    m = re.match(r"(\d+)", str(version))
    if not m:
        raise InputError(f"cannot parse TensorRT version {version!r}")
    return int(m.group(1))


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a TensorRT version string; the build number is not part of compatibility."""
    return tuple(int(x) for x in re.findall(r"\d+", str(version))[:3])


# (compute capability) -> family, for messages
GPU_FAMILIES = {
    (7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Orin (Ampere)", (8, 9): "Ada",
    (9, 0): "Hopper", (10, 0): "Blackwell (B200)", (10, 1): "Thor (Blackwell)", (10, 3): "Blackwell (B300)",
    (11, 0): "Thor (Blackwell)", (12, 0): "Blackwell (RTX 50 / RTX PRO)", (12, 1): "Blackwell (GB10)",
}


def describe_gpu(cc: tuple[int, int], name: str = "") -> str:
    family = GPU_FAMILIES.get(tuple(cc), "unknown family")
    return f"{name or 'this GPU'} (SM {cc[0]}.{cc[1]}, {family})"


def check_engine_compat(engine: dict[str, Any] | None, trt_version: str, cc: tuple[int, int], device_name: str = "") -> None:
    """Raise HardwareError when a serialized engine was built for another TensorRT version or GPU."""
    if not engine or engine.get("kind") != "tensorrt":
        raise ArtifactError("this artifact has no TensorRT engine (build one with `speccompile build ARTIFACT --out DIR`)")
    built = str(engine.get("tensorrt_version", "?"))
    if version_tuple(built) != version_tuple(trt_version):
        raise HardwareError(
            f"engine was built with TensorRT {built} but TensorRT {trt_version} is installed; engines are tied to the "
            f"TensorRT version: rebuild with `speccompile build` (or install TensorRT {built})"
        )
    built_cc = tuple(engine.get("compute_capability") or ())
    if built_cc != tuple(cc):
        raise HardwareError(
            f"engine was built for {describe_gpu(built_cc, engine.get('device_name', ''))} but runs on "
            f"{describe_gpu(tuple(cc), device_name)}; engines are tied to the GPU: rebuild on this machine"
        )
