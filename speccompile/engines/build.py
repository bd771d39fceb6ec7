"""`speccompile build`: exported artifact -> quantized ONNX (+ TensorRT engines), written atomically.

The output is a complete artifact (manifest, tokenizer files, graphs, sha256 of every file) that the runtime
opens like an export: with `--onnx-only` an FP8 or INT4 target runs in ONNX Runtime CPU directly.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from .. import __version__
from ..accel.compat import TRT_INT4_BLOCKS, check_tensorrt_compat
from ..accel.profiles import DEFAULT_PREFILL_CHUNK, profiles_for, required_limits
from ..atomic_dir import atomic_output
from ..errors import ArtifactError, InputError, SpecCompileError
from ..manifest import Manifest, read_manifest
from ..onnx_versions import save_model
from . import config as cfg
from .cpu_graph import quantized_cpu_graphs, reads_files
from .int8_weights import check_int8_options
from .methods import MethodOptions, apply_methods, calibrated_tensors, quantized_groups
from .qad import QadOptions, QadResult
from .quantize import DEFAULT_EXCLUDE, QuantOptions, activation_tensors, quantize_model, quantized_tables
from .sensitivity import KEEP_FORMATS, search_kept_weights, store_kept
from .source_grid import source_grids

Progress = Callable[[str], None]
TRTEXEC_SCRIPT = "build_engines.sh"
# Where each scheme runs (ONNX Runtime CPU cannot execute FLOAT4E2M1 DequantizeLinear or trt:: ops).
RUNS_ON = {
    "none": ["ort-cpu", "ort-cuda", "ort-trt", "tensorrt"],
    "fp8": ["ort-cpu", "ort-trt", "tensorrt"],
    "int4": ["ort-cpu", "ort-trt", "tensorrt"],
    "nvfp4": ["tensorrt", "ort-trt"],
    "int8": ["ort-cpu"],  # blocked INT8 weights (engines/int8_weights.py): TensorRT documents block scales for INT4 only
}


@dataclass
class BuildOptions:
    precision: str = "none"  # none | fp8 | int4 | nvfp4
    onnx_only: bool = False
    calib: Path | None = None
    calib_samples: int = 16
    calib_max_tokens: int = 256
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    int4_block: int = 128
    quantize_tables: bool = False  # embedding tables (and a tied lm_head) stored quantized too
    table_block: int = 64  # INT4 block along H of an embedding table (TensorRT: 64 or 128)
    table_format: str = "int8"  # "int8" (per row, weight-only) | "fp16" | "scheme"
    profiles: str = "single"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    opt_q: int | None = None
    opt_context: int | None = None
    workspace_mb: int | None = None
    builder_optimization_level: int = 3
    timing_cache: Path | None = None
    weakly_typed: bool = False
    threads: int | None = None
    force: bool = False
    float_dtype: str | None = None  # --fp16 / --bf16: precision of the layers that stay unquantized
    max_context: int | None = None  # limits for the engine's profiles (at most the exported ones)
    max_verify_tokens: int | None = None
    max_batch: int | None = None
    methods: MethodOptions = field(default_factory=MethodOptions)
    min_top1: float | None = None  # keep the most sensitive MatMuls unquantized until calibration top-1 >= this
    keep_format: str = "fp32"  # what --min-top1 keeps them in: fp32, or fp8 (weight-only, per channel)
    weight_only: bool = False  # fp8 / nvfp4: quantize the weights only (activations in the graph's float type)
    qad: QadOptions = field(default_factory=QadOptions)  # quantization-aware distillation (engines/qad.py)
    extra: dict = field(default_factory=dict)

    def validate(self) -> "BuildOptions":
        if self.precision not in cfg.PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(cfg.PRECISIONS)}, got {self.precision}")
        if self.calib_samples < 1:
            raise InputError(f"--calib-samples must be >= 1, got {self.calib_samples}")
        if self.calib_max_tokens < 2:
            raise InputError(f"--calib-max-tokens must be >= 2, got {self.calib_max_tokens}")
        if self.int4_block not in (16, 32, 64, 128, 256):
            raise InputError(f"--int4-block must be one of 16, 32, 64, 128, 256, got {self.int4_block}")
        if self.table_format not in ("scheme", "int8", "fp16"):
            raise InputError(f"--table-format must be int8, fp16 or scheme, got {self.table_format}")
        if self.table_block not in TRT_INT4_BLOCKS:
            raise InputError(f"--table-block must be one of {', '.join(map(str, TRT_INT4_BLOCKS))}, got {self.table_block}")
        self.methods.validate()
        if self.precision == "int8":
            check_int8_options(self)
        self.qad.validate(QuantOptions(self.precision, weight_only=self.weight_only).defaults_key)
        if self.weight_only:
            if self.precision == "none":
                raise InputError("--weight-only needs a quantized precision: --fp8 or --fp4 (--int4 is weight-only already)")
            if self.methods.smoothquant is not None:
                raise InputError("--smoothquant moves activation outliers into the weights for activation quantization; "
                                 "--weight-only leaves the activations unquantized")
            if self.methods.act_calib != "max":
                raise InputError(f"--act-calib {self.methods.act_calib}: --weight-only quantizes no activation")
        if self.min_top1 is not None and not 0.0 < self.min_top1 <= 1.0:
            raise InputError(f"--min-top1 must be in (0, 1], got {self.min_top1}")
        if self.keep_format not in KEEP_FORMATS:
            raise InputError(f"--keep-format must be one of {', '.join(KEEP_FORMATS)}, got {self.keep_format}")
        if self.keep_format != "fp32" and self.min_top1 is None:
            raise InputError(f"--keep-format {self.keep_format}: it is the format of the weights --min-top1 keeps; pass --min-top1")
        if self.calib is not None:
            path = Path(self.calib)
            if not path.is_file():
                raise InputError(f"--calib {path}: no such file")
            if path.stat().st_size == 0 or not path.read_text(errors="replace").strip():
                raise InputError(f"--calib {path}: the file is empty")
        return self


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


def _check_onnx(path: Path, run_ort: bool) -> None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise SpecCompileError(f"{path.name}: onnx checker failed after quantization: {str(exc).splitlines()[0]}") from exc
    if run_ort:
        from .calibrate import cpu_session

        try:
            cpu_session(str(path))
        except Exception as exc:  # noqa: BLE001
            raise SpecCompileError(f"{path.name}: ONNX Runtime cannot load the quantized graph: {str(exc).splitlines()[0]}") from exc


def split_check_samples(samples: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """(fit, check): every fourth calibration sample (from the second) held back for `--min-top1`'s measurements,
    so the agreement it targets is not measured on the text GPTQ, AWQ and the ranges were fitted to; a single
    sample serves both (said so in the manifest by `check_samples`)."""
    if len(samples) < 2:
        return samples, samples
    check = samples[1::4]
    return [s for i, s in enumerate(samples) if i % 4 != 1], check


def quantize_graph(src_dir: Path, manifest: Manifest, graph: str, dst: Path, options: BuildOptions, progress: Progress) -> dict:
    """Calibrate (if needed) and quantize one graph of `src_dir` into `dst` (+ `dst.data`); returns the precision record."""
    from .calibrate import calibrate_activations, load_calibration_texts, tokenize_calibration

    spec = manifest.graph(graph)
    qopts = QuantOptions(options.precision, tuple(options.exclude), options.int4_block, tables=options.quantize_tables,
                         table_block=options.table_block, table_format=options.table_format, weight_only=options.weight_only)
    methods = options.methods.validate()
    progress(f"loading {spec.file}")
    model = onnx.load(str(src_dir / spec.file), load_external_data=True)
    amax = None
    weight_clip = None
    # weights already on an INT4 / INT8 block grid are stored on it; the methods leave them alone
    grids = source_grids(model, qopts) if methods.source_grid else {}
    if grids:
        progress(f"{len(grids)} weights are already on a block grid: stored on it, not quantized again")
        grids = _tensorrt_grids(grids, model, qopts, options.onnx_only, progress)
    method_qopts = dataclasses.replace(qopts, exclude=(*qopts.exclude, *grids)) if grids else qopts
    weight_grid = dict(grids)
    method_record = {}
    calibration = None
    kept_weights: list[str] = []
    tensors = activation_tensors(model, qopts)
    if not qopts.quantizes_activations and (methods.needs_rows or options.min_top1 is not None):
        tensors = calibrated_tensors(model, method_qopts)  # no activation range to calibrate, but the methods need the rows
    samples: list[list[int]] = []
    check: list[list[int]] = []
    if tensors or options.qad.steps:
        from ..tokenizer import TextTokenizer

        texts = load_calibration_texts(options.calib)
        tokenizer = TextTokenizer(src_dir, manifest.tokenizer.get("eos_token_ids"))
        samples = tokenize_calibration(texts, tokenizer, options.calib_samples, options.calib_max_tokens)
        if options.min_top1 is not None:  # the target is measured on samples the methods did not fit (GPTQ fits its own)
            samples, check = split_check_samples(samples)
    if tensors:
        progress(f"calibrating {len(tensors)} activations on {len(samples)} samples ({sum(map(len, samples))} tokens)")
        stats = calibrate_activations(src_dir, spec, tensors, samples, options.threads, workdir=dst.parent,
                                      max_rows=methods.calibration_rows(qopts.defaults_key) if methods.needs_rows or options.min_top1 is not None else 0)
        calibration = {
            "source": str(options.calib) if options.calib else "builtin",
            "samples": len(samples),
            "tokens": sum(map(len, samples)),
            "method": methods.act_calib if options.precision == "fp8" and qopts.quantizes_activations else "max",
        }
        progress("searching input-channel scales, clipping and activation ranges on the calibration activations")
        applied = apply_methods(model, method_qopts, stats, methods, progress, measure_errors=options.min_top1 is not None)
        amax = applied.act_amax if qopts.quantizes_activations else None
        weight_clip = applied.weight_clip
        weight_grid.update(applied.weight_grid)
        method_record = applied.summary()
    result = _distill(model, src_dir, spec, manifest.tokenizer.get("eos_token_ids") or [], method_qopts, weight_grid,
                      weight_clip or {}, samples, options, progress) if options.qad.steps else None
    if result is not None:
        weight_grid.update(result.grids)
        method_record["qad"] = result.summary
        calibration = calibration or {"source": str(options.calib) if options.calib else "builtin", "samples": len(samples),
                                      "tokens": sum(map(len, samples)), "method": "none"}
    if tensors:
        if options.min_top1 is not None:
            progress(f"sensitivity: keeping the worst MatMuls in {options.keep_format} until top-1 >= {options.min_top1} on "
                     f"{len(check)} held-back calibration samples ({sum(map(len, check))} tokens)")
            kept = search_kept_weights(model, qopts, amax, weight_clip, applied.weight_error, weight_grid, spec, check,
                                       options.min_top1, options.threads, progress, options.keep_format)
            qopts = dataclasses.replace(qopts, exclude=(*qopts.exclude, *kept.kept))
            kept_weights = kept.kept
            method_record["sensitivity"] = {**kept.summary(), "check_samples": len(check), "check_tokens": sum(map(len, check))}
    progress(f"quantizing {graph} to {options.precision}")
    report = quantize_model(model, qopts, amax, weight_clip, weight_grid)
    if kept_weights:
        store_kept(model, kept_weights, options.keep_format)
    data_name = dst.name + ".data"
    save_model(model, dst, save_as_external_data=True, all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
    del model
    progress("checking the quantized graph (onnx checker" + (", ONNX Runtime load)" if "ort-cpu" in RUNS_ON[options.precision] else ")"))
    _check_onnx(dst, run_ort="ort-cpu" in RUNS_ON[options.precision])
    record = report.summary()
    record["exclude_patterns"] = list(qopts.exclude)
    if options.weight_only:
        record["weight_only"] = True
    if options.precision == "int4":
        record["int4_block"] = options.int4_block
    if calibration:
        record["calibration"] = calibration
    if method_record:
        record["methods"] = method_record
    record["runs_on"] = RUNS_ON[options.precision] if _tensorrt_blocks(report) else ["ort-cpu"]
    return record


def _distill(model: onnx.ModelProto, src_dir: Path, spec, eos_ids: list[int], qopts: QuantOptions, weight_grid: dict,
             weight_clip: dict, samples: list[list[int]], options: BuildOptions, progress: Progress) -> QadResult | None:
    """Quantization-aware distillation of every weight the pass will quantize that has no source grid (engines/qad.py)."""
    from .calibrate import prefill_feeds, sample_continuations
    from .qad import batches, distill, free_parameters, pack_rows, store_free, weight_grid_for

    inits = {i.name: i for i in model.graph.initializer}
    weights = {}
    for name in (w for group in quantized_groups(model, qopts).values() for _, w in group):
        grid = weight_grid.get(name)
        if name in weights or (grid is not None and grid.block):  # a source grid: stored exactly, nothing to fit
            continue
        weights[name] = grid or weight_grid_for(numpy_helper.to_array(inits[name]).astype(np.float32), qopts, weight_clip.get(name))
    free = free_parameters(model, set(weights))
    if not weights or (options.qad.lr == 0 and not free):
        progress("QAD: nothing to train (no weight quantized afresh: all on their source grid or excluded)")
        return None
    if options.qad.data == "generated":
        prompts = [samples[i] for i in np.linspace(0, len(samples) - 1, min(len(samples), options.qad.samples)).astype(int)]
        per_prompt = -(-options.qad.samples // len(prompts))
        progress(f"QAD: sampling {per_prompt * len(prompts)} continuations of {options.calib_max_tokens} tokens from the "
                 f"unquantized graph ({per_prompt} per calibration prompt)")
        samples = sample_continuations(src_dir, spec, prompts, per_prompt, options.calib_max_tokens, options.qad.seed,
                                       options.threads, avoid=eos_ids)
    rows = pack_rows(samples, options.calib_max_tokens)
    feeds = [prefill_feeds(spec, b) for b in batches(rows, options.qad.batch)]
    progress(f"QAD: training {len(weights)} quantized weights and {len(free)} float parameters for {options.qad.steps} steps "
             f"on {rows.size} tokens ({len(rows)} rows of {rows.shape[1]})")
    result = distill(model, qopts.scheme, weights, free, feeds, options.qad, options.threads, progress)
    store_free(model, result.free)
    return result


def _tensorrt_blocks(report) -> bool:
    """Whether every block-quantized weight uses a block TensorRT takes (INT4 64 / 128; no blocked INT8 table)."""
    tables = {name for name in report.tables if name in report.source_grid}
    return all(b in TRT_INT4_BLOCKS for b in report.blocks.values()) and not tables


def _tensorrt_grids(grids: dict, model: onnx.ModelProto, qopts: QuantOptions, onnx_only: bool, progress: Progress) -> dict:
    """The source grids to store: all of them for an ONNX-only build (saying when that makes it ONNX Runtime only),
    for a TensorRT build those TensorRT takes (INT4 blocks of 64 / 128; no blocked INT8 table), the others quantized again."""
    tables = {t.name for t in quantized_tables(model, qopts)}
    fit = {w: g for w, g in grids.items() if w not in tables and g.block in TRT_INT4_BLOCKS}
    if len(fit) == len(grids):
        return grids
    what = ", ".join(sorted({f"INT8 blocks of {g.block}" if w in tables else f"INT4 blocks of {g.block}"
                             for w, g in grids.items() if w not in fit}))
    if onnx_only:
        progress(f"{len(grids) - len(fit)} of them on grids TensorRT does not take ({what}): this build runs on ONNX "
                 "Runtime (--no-source-grid quantizes them afresh, for TensorRT)")
        return grids
    progress(f"{len(grids) - len(fit)} of them on grids TensorRT does not take ({what}): quantized again "
             "(--onnx-only keeps them exactly, on ONNX Runtime)")
    return fit


def build_artifact(src: str | Path, out: str | Path, options: BuildOptions, progress: Progress = lambda _: None) -> Manifest:
    """Quantize the target and (unless onnx_only) build TensorRT engines for every graph. Atomic: all or nothing."""
    options.validate()
    src, out = Path(src), Path(out)
    if out.exists() and src.resolve() == out.resolve():
        raise InputError("--out must differ from the input artifact")
    manifest = read_manifest(src, verify_files=True)
    limits = _apply_limit_overrides(required_limits(manifest), options, src)
    _check_float_dtype(manifest, options)
    if manifest.engine:
        raise ArtifactError(f"{src}: already holds TensorRT engines; build from the exported artifact instead")
    if manifest.precision.get("target", {}).get("scheme") and options.precision != "none":
        raise InputError(f"{src}: the target is already quantized ({manifest.precision['target']['scheme']}); build from the unquantized export")
    manifest.graph("target")  # must exist
    # ONNX Runtime CPU variants (*.ort.onnx: the fused target, int8/int4 heads) share the exported weights
    # files and use com.microsoft operators: TensorRT cannot build them, and quantizing the target leaves its
    # variants stale, so they leave the TensorRT steps. The target's come back packed (engines/cpu_graph.py); an
    # ONNX-only build keeps the others (draft model, heads: weights the build does not change).
    fused = {name: g for name, g in manifest.graphs.items() if g.extra.get("variant_of")}
    target_file = manifest.graph("target").file
    cpu_specs = {name: g for name, g in fused.items() if options.onnx_only and g.extra["variant_of"] != target_file
                 and not reads_files(src, g, _graph_files(manifest, target_file))}
    fused_files = {f for name, g in fused.items() if name not in cpu_specs for f in _graph_files(manifest, g.file)}
    for name in fused:
        del manifest.graphs[name]

    trt = gpu = build_config = None
    if not options.onnx_only:
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

    profiles: dict[str, list] = {}
    profile_problems: dict[str, str] = {}
    for name, spec in manifest.graphs.items():
        try:
            profiles[name] = profiles_for(spec, limits, options.profiles, options.prefill_chunk, options.opt_q, options.opt_context)
        except SpecCompileError as exc:
            if not options.onnx_only:
                raise
            profile_problems[name] = str(exc)  # no trtexec line for this graph; reported in the manifest
    started = time.time()
    with atomic_output(out, options.force) as tmp:
        new = Manifest.from_dict(manifest.to_dict())
        new.limits = {**new.limits, **limits}
        new.files = {}
        files: list[str] = []
        replaced: set[str] = set()
        if options.precision != "none":
            spec = manifest.graphs["target"]
            record = quantize_graph(src, manifest, "target", tmp / spec.file, options, progress)
            new.precision = {**new.precision, "target": record}
            new.graphs["target"] = dataclasses.replace(spec, dtype=f"{spec.dtype}+{options.precision}", extra={**spec.extra, "quantization": options.precision})
            replaced = set(_graph_files(manifest, spec.file))
            files += [spec.file, spec.file + ".data"]
            packed, cpu_files = quantized_cpu_graphs(src, fused, spec, tmp, options.precision, progress)
            cpu_specs.update(packed)
            files += cpu_files
        progress("copying the other files (tokenizer, drafter graphs)")
        for name in manifest.files:  # everything else listed in the source manifest, unchanged
            if name not in replaced and name not in fused_files:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / name, tmp / name)
                files.append(name)
        # TensorRT compatibility of every graph
        compat = {}
        for name, spec in new.graphs.items():
            report = check_tensorrt_compat(tmp / spec.file)
            compat[name] = report.to_dict()
            if not report.ok and not options.onnx_only:
                raise SpecCompileError(f"{spec.file}: not buildable with TensorRT: {report.errors[0]}" + (f" (+{len(report.errors) - 1} more)" if len(report.errors) > 1 else ""))
        new.precision = {**new.precision, "tensorrt_compat": compat}
        if profile_problems:
            new.precision["tensorrt_profiles"] = profile_problems
        # trtexec equivalents
        script = _trtexec_script(new, profiles, options)
        (tmp / TRTEXEC_SCRIPT).write_text(script)
        os.chmod(tmp / TRTEXEC_SCRIPT, 0o755)
        files.append(TRTEXEC_SCRIPT)
        if not options.onnx_only:
            from .trt_build import build_engine

            plans = {}
            for name, spec in new.graphs.items():
                plan_file = f"{name}.plan"
                progress(f"building TensorRT engine for {name} ({len(profiles[name])} profile(s))")
                plan = build_engine(trt, tmp / spec.file, build_config, profiles[name])
                (tmp / plan_file).write_bytes(plan)
                plans[name] = plan_file
                new.graphs[name] = dataclasses.replace(new.graphs[name], extra={**new.graphs[name].extra, "engine": plan_file})
                files.append(plan_file)
            new.engine = cfg.engine_section(trt.__version__, gpu[0], gpu[1], plans, build_config, profiles)
        new.graphs.update(cpu_specs)  # after the TensorRT steps (com.microsoft operators)
        new.created_by = f"speccompile {__version__} (build)"
        new.model = {**new.model, "built_from": str(src)}
        progress("checksumming files")
        new.record_files(tmp, sorted(set(files)))
        new.write(tmp)
    progress(f"done in {time.time() - started:.1f}s")
    return new


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
