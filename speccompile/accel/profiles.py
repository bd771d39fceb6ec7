"""TensorRT optimization profiles as plain data: the (min, opt, max) shape of every graph input, derived
from the manifest limits. `engines` builds engines with them (and records them in the manifest's engine
section); the runtime reads them back and picks the profile covering each step's shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ArtifactError, InputError, UnsupportedError, check_at_least, check_one_of
from ..manifest import GraphSpec, Manifest

DEFAULT_PREFILL_CHUNK = 256  # the runtime's prefill chunk (q_len of a prefill pass)


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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        """A profile as the manifest's engine section records it (`dataclasses.asdict`)."""
        return cls(data["name"], {k: tuple(v) for k, v in data["shapes"].items()})


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
    check_one_of("profiles", mode, PROFILE_MODES)
    check_at_least("prefill_chunk", prefill_chunk, 1)
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


def engine_profiles(manifest: Manifest, graph: str) -> list[Profile]:
    """The optimization profiles graph `graph`'s engine was built with (manifest engine section)."""
    return [Profile.from_dict(p) for p in (manifest.engine or {}).get("profiles", {}).get(graph, [])]


def shapes_arg(shapes: dict[str, list[int]]) -> str:
    """`name:1x8x64,...`: the shape list format of trtexec and of the TensorRT EP's profile options."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes.items())
