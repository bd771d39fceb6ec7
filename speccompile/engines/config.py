"""TensorRT build configuration as plain data: TensorRT 10 vs 11 flags, hardware rules, the manifest's engine
section, trtexec command lines (the optimization profiles are in `accel/profiles.py`, shared with the runtime).

Nothing here imports TensorRT; `trt_build.py` turns these values into API calls and `build.py` writes
them as trtexec command lines, so every decision is unit-testable on a machine without a GPU.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from ..accel.profiles import Profile, shapes_arg
from ..accel.trt import describe_gpu, trt_major, version_tuple
from ..errors import HardwareError, InputError, UnsupportedError

PRECISIONS = ("none", "fp8", "int4", "nvfp4", "int8")


# ---------------------------------------------------------------- TensorRT versions and flags

@dataclass
class BuildConfig:
    """Everything needed to build one engine, independent of the TensorRT Python API."""

    trt_version: str
    precision: str = "none"
    strongly_typed: bool = True
    network_flags: list[str] = field(default_factory=list)  # NetworkDefinitionCreationFlag names
    builder_flags: list[str] = field(default_factory=list)  # BuilderFlag names
    workspace_mb: int | None = None
    builder_optimization_level: int = 3
    timing_cache: str | None = None
    profiles: list[Profile] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_WEAK_PRECISION_FLAGS = {"none": ["FP16"], "fp8": ["FP16", "FP8"], "int4": ["FP16", "INT4"], "nvfp4": ["FP16", "FP4"]}


def make_build_config(
    trt_version: str,
    precision: str = "none",
    weakly_typed: bool = False,
    workspace_mb: int | None = None,
    builder_optimization_level: int = 3,
    timing_cache: str | None = None,
    profiles: list[Profile] | None = None,
) -> BuildConfig:
    """TensorRT 10: strong typing is a network flag (STRONGLY_TYPED); --weakly-typed uses FP16/FP8/INT4/FP4
    builder flags instead. TensorRT 11+: networks are always strongly typed, there are no such flags, and
    precision comes only from the graph's dtypes and Q/DQ nodes."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision}")
    if not 0 <= builder_optimization_level <= 5:
        raise InputError(f"--builder-optimization-level must be 0..5, got {builder_optimization_level}")
    if workspace_mb is not None and workspace_mb < 1:
        raise InputError(f"--workspace-mb must be >= 1, got {workspace_mb}")
    major = trt_major(trt_version)
    if major < 10:
        raise UnsupportedError(f"TensorRT {trt_version} is too old: speccompile builds with TensorRT 10 or newer")
    if precision == "nvfp4" and version_tuple(trt_version) < (10, 8):
        raise UnsupportedError(f"--fp4: NVFP4 needs TensorRT 10.8 or newer (found {trt_version})")
    if major >= 11:
        if weakly_typed:
            raise UnsupportedError(f"--weakly-typed: TensorRT {trt_version} networks are always strongly typed (no FP16/FP8/INT4 builder flags)")
        network_flags, builder_flags, strongly = [], [], True
    elif weakly_typed:
        network_flags, builder_flags, strongly = [], list(_WEAK_PRECISION_FLAGS[precision]), False
    else:
        network_flags, builder_flags, strongly = ["STRONGLY_TYPED"], [], True
    return BuildConfig(
        trt_version=str(trt_version),
        precision=precision,
        strongly_typed=strongly,
        network_flags=network_flags,
        builder_flags=builder_flags,
        workspace_mb=workspace_mb,
        builder_optimization_level=builder_optimization_level,
        timing_cache=timing_cache,
        profiles=list(profiles or []),
    )


# ---------------------------------------------------------------- hardware rules

NVFP4_CCS = {(10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1)}


@dataclass(frozen=True)
class HardwareRule:
    precision: str
    needs: str  # human description
    allowed: frozenset | None = None  # explicit set of CCs, or
    min_cc: tuple[int, int] | None = None
    denied: frozenset = frozenset()

    def allows(self, cc: tuple[int, int]) -> bool:
        cc = tuple(cc)
        if cc in self.denied:
            return False
        if self.allowed is not None:
            return cc in self.allowed
        return self.min_cc is None or cc >= self.min_cc


HARDWARE_RULES = {
    "none": HardwareRule("none", "a Turing or newer GPU (compute capability >= 7.5)", min_cc=(7, 5)),
    "int4": HardwareRule("int4", "an Ampere or newer GPU (compute capability >= 8.0) for INT4 weight-only GEMMs", min_cc=(8, 0)),
    "fp8": HardwareRule(
        "fp8", "FP8 tensor cores: Ada, Hopper or Blackwell (compute capability >= 8.9; not Orin)",
        min_cc=(8, 9), denied=frozenset({(8, 7)}),
    ),
    "nvfp4": HardwareRule(
        "nvfp4", "NVFP4 tensor cores: Blackwell (SM100/SM103, SM120/SM121) or Thor",
        allowed=frozenset(NVFP4_CCS),
    ),
}


def check_hardware(precision: str, cc: tuple[int, int], device_name: str = "") -> None:
    """Refuse a precision the GPU cannot run, with a one-line reason."""
    rule = HARDWARE_RULES[precision or "none"]
    if not rule.allows(tuple(cc)):
        flag = {"fp8": "--fp8", "int4": "--int4", "nvfp4": "--fp4"}.get(precision, "a TensorRT engine")
        raise HardwareError(
            f"{flag} needs {rule.needs}; {describe_gpu(cc, device_name)} cannot run it "
            f"(use --onnx-only to write the quantized ONNX graph without an engine)"
        )


# ---------------------------------------------------------------- engine manifest section

def engine_section(
    trt_version: str, device_name: str, cc: tuple[int, int], plans: dict[str, str], config: BuildConfig,
    profiles: dict[str, list[Profile]],
) -> dict[str, Any]:
    """What the manifest records about built engines (the runtime refuses a mismatch)."""
    return {
        "kind": "tensorrt",
        "tensorrt_version": str(trt_version),
        "device_name": device_name,
        "compute_capability": [int(cc[0]), int(cc[1])],
        "plans": dict(plans),
        "strongly_typed": config.strongly_typed,
        "network_flags": list(config.network_flags),
        "builder_flags": list(config.builder_flags),
        "builder_optimization_level": config.builder_optimization_level,
        "profiles": {g: [asdict(p) for p in ps] for g, ps in profiles.items()},
    }


# ---------------------------------------------------------------- trtexec

def trtexec_command(onnx_file: str, plan_file: str, profiles: list[Profile], major: int, precision: str = "none",
                    workspace_mb: int | None = None, builder_optimization_level: int = 3,
                    timing_cache: str | None = "timing.cache", weakly_typed: bool = False) -> str:
    """The equivalent trtexec command line (repeated --min/opt/maxShapes = one profile each)."""
    args = ["trtexec", f"--onnx={onnx_file}", f"--saveEngine={plan_file}"]
    for profile in profiles:
        for i, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
            args.append(f"{flag}={shapes_arg({n: s[i] for n, s in profile.shapes.items()})}")
    if major < 11:
        if weakly_typed:
            args += [f"--{f.lower()}" for f in _WEAK_PRECISION_FLAGS[precision]]
        else:
            args.append("--stronglyTyped")
    if workspace_mb:
        args.append(f"--memPoolSize=workspace:{workspace_mb}M")
    args.append(f"--builderOptimizationLevel={builder_optimization_level}")
    if timing_cache:
        args.append(f"--timingCacheFile={timing_cache}")
    return " ".join(shlex.quote(a) for a in args)
