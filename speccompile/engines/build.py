"""`speccompile build`: exported artifact -> quantized ONNX (+ TensorRT engines), written atomically.

The output is a complete artifact (manifest, tokenizer files, graphs, sha256 of every file) that the runtime
opens like an export: with `--onnx-only` an FP8 or INT4 target runs in ONNX Runtime CPU directly.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from .. import __version__
from ..accel.compat import check_tensorrt_compat
from ..accel.profiles import profiles_for, required_limits
from ..atomic_dir import atomic_output
from ..errors import ArtifactError, InputError, SpecCompileError
from ..manifest import Manifest, read_manifest, remember_verified
from . import config as cfg
from .build_options import BuildOptions
from .cpu_graph import quantized_cpu_graphs, reads_files
from .output_size import check_build_space
from .quantize_graph import quantize_graph

Progress = Callable[[str], None]
TRTEXEC_SCRIPT = "build_engines.sh"


def _apply_limit_overrides(limits: dict[str, int], options: BuildOptions, src: Path) -> dict[str, int]:
    """--max-context / --max-verify-tokens / --max-batch narrow the exported limits (never widen them)."""
    limits = dict(limits)
    for key, flag in (("max_context", "--max-context"), ("max_verify_tokens", "--max-verify-tokens"), ("max_batch", "--max-batch")):
        value = getattr(options, key)
        if value is None:
            continue
        exported = limits.get(key, 1)
        if value < 1 or value > exported:
            raise InputError(f"{flag} must be in 1..{exported} (the limit {src} was exported with), got {value}")
        limits[key] = int(value)
    return limits


def _check_float_dtype(manifest: Manifest, options: BuildOptions) -> None:
    """Under strong typing (TensorRT 11, or 10 by default) the graph's dtype is the precision."""
    if options.float_dtype is None or options.weakly_typed:
        return
    graph_dtype = manifest.graph("target").dtype.split("+")[0]
    if graph_dtype != options.float_dtype:
        raise InputError(
            f"--{options.float_dtype}: the target graph is {graph_dtype}; with strongly typed TensorRT the graph's dtype "
            f"is the precision: re-export with `speccompile export ... --dtype {options.float_dtype}` "
            "(or, TensorRT 10 only, add --weakly-typed)"
        )


def _graph_files(manifest: Manifest, graph_file: str) -> list[str]:
    return [f for f in manifest.files if f == graph_file or f.startswith(graph_file + ".")]


def _say_finer_source(manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
    """An INT4 build of a GGUF whose layer weights are stored above 4 bits (Gemma 3 270M's "Q4_K_M" is mostly Q5_0 /
    Q6_K / Q8_0) runs a less accurate model than the file: said, with the build that keeps them."""
    from ..models.gguf_types import stored_bits

    if options.precision != "int4":
        return
    finer = {name: n for name, n in manifest.model.get("stored_types", {}).items() if (stored_bits(name) or 0) > 4}
    if finer:
        kinds = ", ".join(f"{n} {name}" for name, n in finer.items())
        progress(f"{sum(finer.values())} layer weights of the source are stored above 4 bits ({kinds}): --int4 takes them "
                 "to 4 bits, less accurate than the file (`speccompile eval` says how much); --int8 keeps them at 8 bits "
                 "(as stored where the file's grid is symmetric: Q8_0, Q6_K, Q5_0)")


def build_artifact(src: str | Path, out: str | Path, options: BuildOptions, progress: Progress = lambda _: None) -> Manifest:
    """Quantize the target and (unless onnx_only) build TensorRT engines for every graph. Atomic: all or nothing."""
    options.validate()
    src, out = Path(src), Path(out)
    if out.exists() and src.resolve() == out.resolve():
        raise InputError("--out must differ from the input artifact")
    manifest = read_manifest(src, verify_files=True)
    limits = _apply_limit_overrides(required_limits(manifest), options, src)
    _check_source(src, manifest, options, progress)
    fused, cpu_specs, fused_files = _take_cpu_variants(src, manifest, options.onnx_only)
    target_file = manifest.graph("target").file
    packs = any(g.extra.get("variant_of") == target_file and "ort-cpu" in g.extra.get("backends", ()) for g in fused.values())
    check_build_space(src, out, manifest, options, packs)  # before any work (the source's file list, as exported)
    trt, gpu, build_config = _tensorrt_setup(options) if not options.onnx_only else (None, None, None)
    profiles, profile_problems = _profiles(manifest, limits, options)
    started = time.time()
    with atomic_output(out, options.force) as tmp:
        new = Manifest.from_dict(manifest.to_dict())
        new.limits = {**new.limits, **limits}
        new.files = {}
        files: list[str] = []
        replaced: set[str] = set()
        known: dict[str, str] = {}  # sha256 computed while writing, or the source's for an unchanged copy
        if options.precision != "none":
            spec = manifest.graphs["target"]
            digests: dict[str, str] = {}
            record = quantize_graph(src, manifest, "target", tmp / spec.file, options, progress, digests)
            known.update({str(Path(spec.file).parent / name): digest for name, digest in digests.items()})
            new.precision = {**new.precision, "target": record}
            new.graphs["target"] = dataclasses.replace(spec, dtype=f"{spec.dtype}+{options.precision}", extra={**spec.extra, "quantization": options.precision})
            replaced = set(_graph_files(manifest, spec.file))
            files += [spec.file, spec.file + ".data"]
            packed, cpu_files = quantized_cpu_graphs(src, fused, spec, tmp, options.precision, progress,
                                                     integer_head=options.table_format == "int8-row")
            cpu_specs.update(packed)
            files += cpu_files
        progress("copying the other files (tokenizer, drafter graphs)")
        for name in manifest.files:  # everything else listed in the source manifest, unchanged
            if name not in replaced and name not in fused_files:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / name, tmp / name)
                files.append(name)
                known[name] = manifest.files[name]
        _record_compat(new, tmp, options.onnx_only)
        if profile_problems:
            new.precision["tensorrt_profiles"] = profile_problems
        (tmp / TRTEXEC_SCRIPT).write_text(_trtexec_script(new, profiles, options))  # trtexec equivalents
        os.chmod(tmp / TRTEXEC_SCRIPT, 0o755)
        files.append(TRTEXEC_SCRIPT)
        if not options.onnx_only:
            files += _build_engines(new, tmp, trt, gpu, build_config, profiles, progress)
        new.graphs.update(cpu_specs)  # after the TensorRT steps (com.microsoft operators)
        new.created_by = f"speccompile {__version__} (build)"
        new.model = {**new.model, "built_from": str(src)}
        progress("checksumming files")
        new.record_files(tmp, sorted(set(files)), known)
        new.write(tmp)
    remember_verified(out, {name: digest for name, digest in known.items() if name in new.files})
    progress(f"done in {time.time() - started:.1f}s")
    return new


def _take_cpu_variants(src: Path, manifest: Manifest, onnx_only: bool) -> tuple[dict, dict, set[str]]:
    """Take the ONNX Runtime CPU variants out of `manifest`'s graphs: (all of them, those an ONNX-only build keeps
    as they are, the files of those it does not).

    The variants (*.ort.onnx: the fused target, int8/int4 heads) share the exported weights files and use
    com.microsoft operators: TensorRT cannot build them, and quantizing the target leaves its variants stale, so
    they leave the TensorRT steps. The target's come back packed (engines/cpu_graph.py); an ONNX-only build keeps
    the others (draft model, heads: weights the build does not change)."""
    fused = {name: g for name, g in manifest.graphs.items() if g.extra.get("variant_of")}
    target_file = manifest.graph("target").file
    kept = {name: g for name, g in fused.items() if onnx_only and g.extra["variant_of"] != target_file
            and not reads_files(src, g, _graph_files(manifest, target_file))}
    dropped_files = {f for name, g in fused.items() if name not in kept for f in _graph_files(manifest, g.file)}
    for name in fused:
        del manifest.graphs[name]
    return fused, kept, dropped_files


def _check_source(src: Path, manifest: Manifest, options: BuildOptions, progress: Progress) -> None:
    """Refuse a source this build cannot start from: engines already built, a target already quantized, no target;
    say what an INT4 build of a finer GGUF loses (`_say_finer_source`)."""
    _check_float_dtype(manifest, options)
    if manifest.engine:
        raise ArtifactError(f"{src}: already holds TensorRT engines; build from the exported artifact instead")
    if manifest.precision.get("target", {}).get("scheme") and options.precision != "none":
        raise InputError(f"{src}: the target is already quantized ({manifest.precision['target']['scheme']}); build from the unquantized export")
    manifest.graph("target")  # must exist
    if not options.onnx_only and any(t.name.startswith("past_state.") for t in manifest.graph("target").inputs):
        raise InputError(f"{src}: a hybrid linear-attention target runs on ort-cpu only: build it with --onnx-only "
                         "(no TensorRT engines)", "onnx_only")
    _say_finer_source(manifest, options, progress)


def _tensorrt_setup(options: BuildOptions) -> tuple:
    """(tensorrt module, (GPU name, compute capability), build config) for an engine build; refuses what the GPU
    cannot run before any work."""
    from ..accel.cuda import gpu_info
    from ..accel.trt import require_tensorrt

    trt = require_tensorrt()
    gpu = gpu_info()
    cfg.check_hardware(options.precision, gpu[1], gpu[0])
    build_config = cfg.make_build_config(
        trt.__version__, options.precision, options.weakly_typed, options.workspace_mb,
        options.builder_optimization_level, str(options.timing_cache) if options.timing_cache else None,
    )
    if options.float_dtype and options.weakly_typed:
        build_config.builder_flags.append(options.float_dtype.upper())
    return trt, gpu, build_config


def _profiles(manifest: Manifest, limits: dict[str, int], options: BuildOptions) -> tuple[dict[str, list], dict[str, str]]:
    """Each graph's optimization profiles, and (ONNX-only builds) why a graph has none (reported in the manifest)."""
    profiles: dict[str, list] = {}
    problems: dict[str, str] = {}
    for name, spec in manifest.graphs.items():
        try:
            profiles[name] = profiles_for(spec, limits, options.profiles, options.prefill_chunk, options.opt_q, options.opt_context)
        except SpecCompileError as exc:
            if not options.onnx_only:
                raise
            problems[name] = str(exc)  # no trtexec line for this graph
    return profiles, problems


def _record_compat(new: Manifest, tmp: Path, onnx_only: bool) -> None:
    """TensorRT compatibility of every graph into the manifest; an engine build refuses the first that fails."""
    compat = {}
    for name, spec in new.graphs.items():
        report = check_tensorrt_compat(tmp / spec.file)
        compat[name] = report.to_dict()
        if not report.ok and not onnx_only:
            raise SpecCompileError(f"{spec.file}: not buildable with TensorRT: {report.errors[0]}" + (f" (+{len(report.errors) - 1} more)" if len(report.errors) > 1 else ""))
    new.precision = {**new.precision, "tensorrt_compat": compat}


def _build_engines(new: Manifest, tmp: Path, trt, gpu: tuple, build_config, profiles: dict[str, list],
                   progress: Progress) -> list[str]:
    """Build one TensorRT engine (`<graph>.plan`) per graph, recorded in the manifest; the files written."""
    from .trt_build import build_engine

    plans = {}
    for name, spec in new.graphs.items():
        plan_file = f"{name}.plan"
        progress(f"building TensorRT engine for {name} ({len(profiles[name])} profile(s))")
        plan = build_engine(trt, tmp / spec.file, build_config, profiles[name])
        (tmp / plan_file).write_bytes(plan)
        plans[name] = plan_file
        new.graphs[name] = dataclasses.replace(new.graphs[name], extra={**new.graphs[name].extra, "engine": plan_file})
    new.engine = cfg.engine_section(trt.__version__, gpu[0], gpu[1], plans, build_config, profiles)
    return list(plans.values())


def _trtexec_script(manifest: Manifest, profiles: dict, options: BuildOptions) -> str:
    lines = [
        "#!/bin/sh",
        "# TensorRT engines for this artifact with trtexec (what `speccompile build` does with the Python API).",
        "# TensorRT 10.x: strongly typed via --stronglyTyped; TensorRT 11+: always strongly typed (flag dropped).",
        "set -e",
        'cd "$(dirname "$0")"',
        'MAJOR=$(trtexec --help 2>&1 | sed -n "s/.*TensorRT v\\([0-9]*\\)[0-9][0-9][0-9][0-9].*/\\1/p" | head -n 1)',
        'if [ "${MAJOR:-10}" -lt 11 ]; then TYPING="--stronglyTyped"; else TYPING=""; fi',
        "",
    ]
    weak = options.weakly_typed
    for name, spec in manifest.graphs.items():
        if name not in profiles:
            lines.append(f"# {spec.file}: no optimization profile (unknown dynamic axes); build it by hand")
            continue
        cmd = cfg.trtexec_command(
            spec.file, f"{name}.plan", profiles[name], 10 if weak else 11, options.precision, options.workspace_mb,
            options.builder_optimization_level, "timing.cache", weak,
        )
        lines.append(cmd if weak else f"{cmd} $TYPING")
    lines.append("")
    return "\n".join(lines)
