"""TensorRT build configuration as plain data: optimization profiles, TensorRT 10 vs 11 flags, hardware rules.

Nothing here imports TensorRT; `trt_build.py` turns these values into API calls and `build.py` writes
them as trtexec command lines, so every decision is unit-testable on a machine without a GPU.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ArtifactError, HardwareError, InputError, UnsupportedError
from ..manifest import GraphSpec, Manifest

PRECISIONS = ("none", "fp8", "int4", "nvfp4")
DEFAULT_PREFILL_CHUNK = 256  # speccompile.runtime.generate.GenerationConfig.prefill_chunk


# ---------------------------------------------------------------- optimization profiles

@dataclass
class AxisRange:
    min: int
    opt: int
    max: int

    def validate(self, name: str) -> "AxisRange":
        if not (0 <= self.min <= self.opt <= self.max):
            raise InputError(f"profile axis {name}: need 0 <= min <= opt <= max, got {self.min}/{self.opt}/{self.max}")
        return self


@dataclass
class Profile:
    """One TensorRT optimization profile: input name -> (min, opt, max) shapes."""

    name: str
    shapes: dict[str, tuple[list[int], list[int], list[int]]]

    def covers(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        for name, shape in shapes.items():
            lo, _opt, hi = self.shapes[name]
            if any(not (a <= s <= b) for a, s, b in zip(lo, shape, hi)):
                return False
        return True


def required_limits(manifest: Manifest) -> dict[str, int]:
    """max_context / max_verify_tokens / max_batch from the manifest, or an ArtifactError naming what is missing."""
    limits = manifest.limits or {}
    missing = [k for k in ("max_context", "max_verify_tokens") if not isinstance(limits.get(k), int) or limits.get(k, 0) < 1]
    if missing:
        raise ArtifactError(
            f"manifest.json has no usable limits ({', '.join(missing)} missing); the engine's optimization "
            f"profiles are derived from them; re-export with `speccompile export --max-context N`"
        )
    return {
        "max_context": int(limits["max_context"]),
        "max_verify_tokens": int(limits["max_verify_tokens"]),
        "max_batch": int(limits.get("max_batch") or 1),
    }


def axis_ranges(
    limits: dict[str, int],
    q_range: tuple[int, int, int],
    opt_context: int | None = None,
) -> dict[str, AxisRange]:
    """Ranges for the export's dynamic axis names (batch, q_len, past_len, total_len)."""
    max_context = limits["max_context"]
    q_min, q_opt, q_max = q_range
    q_max = min(q_max, max_context)
    q_opt = min(q_opt, q_max)
    opt_past = min(opt_context if opt_context is not None else max(1, max_context // 4), max_context - q_max)
    opt_past = max(opt_past, 0)
    ranges = {
        "batch": AxisRange(1, 1, limits.get("max_batch", 1)),
        "q_len": AxisRange(q_min, q_opt, q_max),
        "past_len": AxisRange(0, opt_past, max_context - q_min),
        "total_len": AxisRange(q_min, opt_past + q_opt, max_context),
    }
    for name, r in ranges.items():
        r.validate(name)
    return ranges


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # q sizes of the 'buckets' profiles (as runtime/backends/ort_cuda.py)
BUCKET_PREFIX = "q"  # bucket profile NAME = q<Q>; the tensorrt backend captures one CUDA graph per bucket profile
PROFILE_MODES = ("single", "split", "buckets")


def profiles_for(
    spec: GraphSpec,
    limits: dict[str, int],
    mode: str = "single",
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    opt_q: int | None = None,
    opt_context: int | None = None,
) -> list[Profile]:
    """Optimization profiles for one graph.

    single: one profile, q_len 1..max(max_verify_tokens, prefill_chunk) (opt = verify size);
    split:  'verify' (q_len 1..max_verify_tokens) + 'prefill' (q_len max_verify_tokens+1..prefill_chunk):
            better kernels for each, at the cost of a second set of tactics in the engine;
    buckets: static shapes for CUDA graphs, see bucket_profiles.
    """
    if mode not in PROFILE_MODES:
        raise InputError(f"--profiles must be one of {', '.join(PROFILE_MODES)}, got {mode}")
    if prefill_chunk < 1:
        raise InputError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    if mode == "buckets":
        return bucket_profiles(spec, limits, prefill_chunk)
    verify = limits["max_verify_tokens"]
    verify_opt = opt_q or min(verify, 8)
    if mode == "single" or prefill_chunk <= verify:
        q_ranges = {"main": (1, verify_opt, max(verify, prefill_chunk))}
    else:
        q_ranges = {"verify": (1, verify_opt, verify), "prefill": (verify + 1, prefill_chunk, prefill_chunk)}
    profiles = []
    for name, q_range in q_ranges.items():
        ranges = axis_ranges(limits, q_range, opt_context)
        shapes = {}
        for tensor in spec.inputs:
            dims = []
            for d in tensor.shape:
                if isinstance(d, int):
                    dims.append((d, d, d))
                elif d in ranges:
                    r = ranges[d]
                    dims.append((r.min, r.opt, r.max))
                else:
                    raise UnsupportedError(
                        f"graph {spec.file}: input {tensor.name} has dynamic axis '{d}' with no known range "
                        f"(known: {', '.join(ranges)})"
                    )
            shapes[tensor.name] = tuple([x[i] for x in dims] for i in range(3))
        profiles.append(Profile(name, shapes))
    return profiles


def bucket_profiles(spec: GraphSpec, limits: dict[str, int], prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                    buckets: tuple[int, ...] = BUCKETS) -> list[Profile]:
    """Static shapes for CUDA graphs: one profile per q bucket (`q<Q>`, up to max_verify_tokens) with every
    axis fixed (q_len = Q, past_len = max_context: the KV rows stay allocated, unused and rejected rows
    masked; total_len = max_context + Q), plus 'prefill' (q_len 1..prefill_chunk over the same KV rows)."""
    capacity, verify, chunk = limits["max_context"], limits["max_verify_tokens"], max(1, prefill_chunk)
    axes = {f"{BUCKET_PREFIX}{q}": {"batch": (1, 1, 1), "q_len": (q, q, q), "past_len": (capacity,) * 3,
                                     "total_len": (capacity + q,) * 3}
            for q in [b for b in buckets if b < verify] + [verify]}
    axes["prefill"] = {"batch": (1, 1, 1), "q_len": (1, chunk, chunk), "past_len": (capacity,) * 3,
                       "total_len": (capacity + 1, capacity + chunk, capacity + chunk)}
    known = set(axes["prefill"])
    for tensor in spec.inputs:
        unknown = [d for d in tensor.shape if not isinstance(d, int) and d not in known]
        if unknown:
            raise UnsupportedError(f"graph {spec.file}: input {tensor.name} has dynamic axis '{unknown[0]}' with no known range")
    return [
        Profile(name, {t.name: tuple([d if isinstance(d, int) else ranges[d][i] for d in t.shape] for i in range(3))
                       for t in spec.inputs})
        for name, ranges in axes.items()
    ]


def select_profile(profiles: list[Profile], shapes: dict[str, tuple[int, ...]]) -> int:
    """Index of the first profile covering the given input shapes (the runtime's choice)."""
    for i, p in enumerate(profiles):
        if p.covers(shapes):
            return i
    raise InputError(f"no optimization profile of the engine covers input shapes {shapes}")


# ---------------------------------------------------------------- TensorRT versions and flags

def trt_major(version: str) -> int:
    m = re.match(r"(\d+)", str(version))
    if not m:
        raise InputError(f"cannot parse TensorRT version {version!r}")
    return int(m.group(1))


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", str(version))[:3])


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

# (compute capability) -> family, for messages
_FAMILIES = {
    (7, 5): "Turing", (8, 0): "Ampere", (8, 6): "Ampere", (8, 7): "Orin (Ampere)", (8, 9): "Ada",
    (9, 0): "Hopper", (10, 0): "Blackwell (B200)", (10, 1): "Thor (Blackwell)", (10, 3): "Blackwell (B300)",
    (11, 0): "Thor (Blackwell)", (12, 0): "Blackwell (RTX 50 / RTX PRO)", (12, 1): "Blackwell (GB10)",
}
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


def describe_gpu(cc: tuple[int, int], name: str = "") -> str:
    family = _FAMILIES.get(tuple(cc), "unknown family")
    return f"{name or 'this GPU'} (SM {cc[0]}.{cc[1]}, {family})"


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


# ---------------------------------------------------------------- trtexec

def _shape_arg(shapes: dict[str, list[int]]) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())


def trtexec_command(onnx_file: str, plan_file: str, profiles: list[Profile], major: int, precision: str = "none",
                    workspace_mb: int | None = None, builder_optimization_level: int = 3,
                    timing_cache: str | None = "timing.cache", weakly_typed: bool = False) -> str:
    """The equivalent trtexec command line (repeated --min/opt/maxShapes = one profile each)."""
    args = ["trtexec", f"--onnx={onnx_file}", f"--saveEngine={plan_file}"]
    for profile in profiles:
        for i, flag in enumerate(("--minShapes", "--optShapes", "--maxShapes")):
            args.append(f"{flag}={_shape_arg({n: s[i] for n, s in profile.shapes.items()})}")
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
