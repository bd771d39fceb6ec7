"""One graph of an artifact quantized, streaming: memory bounded by about one layer's weights, not the model's.

  1. the structure is read without weights (`load_graph`); weights already on a source grid are found reading a few
     KB of each weight (the whole weight only when it is on one);
  2. calibration runs the unquantized graph one segment at a time (engines/calibrate.py, engines/segments.py);
     after each segment, the units (engines/units.py) whose activations are complete are fitted by the methods,
     quantized and written to the output's external data file, and forgotten (engines/unit_pass.py);
  3. the Q/DQ rewrite places the stored weights in the graph; initializers nothing changed are copied across in
     the same file; the structure is saved, then checked (onnx checker, ONNX Runtime one segment at a time).

`--qad-steps` and `--min-top1` need the whole model after the methods (training runs the graph in torch; the
search measures quantized whole graphs): with them the weights are loaded at the start and stay, as before
(engines/whole_model.py); the numbers are the same either way.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

from ..accel.compat import TRT_INT4_BLOCKS
from ..manifest import Manifest
from ..onnx_versions import save_model
from ..weights_file import WeightsWriter, load_graph
from .build_options import BuildOptions
from .calibrate import ActivationStats, calibration_steps, load_calibration_texts, tokenize_calibration
from .graph_check import check_graph
from .methods import calibrated_tensors
from .qdq_targets import QuantOptions, activation_tensors, quantized_tables
from .source_grid import find_source_grid, grid_candidates, source_grids
from .unit_pass import UnitPass
from .units import Unit, plan_units
from .whole_model import finish_whole_model
from .working_graph import ExternalSink, WorkingGraph

Progress = Callable[[str], None]
# Where each scheme runs (ONNX Runtime CPU cannot execute FLOAT4E2M1 DequantizeLinear or trt:: ops).
RUNS_ON = {
    "none": ["ort-cpu", "ort-cuda", "ort-trt", "tensorrt"],
    "fp8": ["ort-cpu", "ort-trt", "tensorrt"],
    "int4": ["ort-cpu", "ort-trt", "tensorrt"],
    "nvfp4": ["tensorrt", "ort-trt"],
    "int8": ["ort-cpu"],  # blocked INT8 weights (engines/int8_weights.py): TensorRT documents block scales for INT4 only
}


def split_check_samples(samples: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """(fit, check): every fourth calibration sample (from the second) held back for `--min-top1`'s measurements,
    so the agreement it targets is not measured on the text GPTQ, AWQ and the ranges were fitted to; a single
    sample serves both (said so in the manifest by `check_samples`)."""
    if len(samples) < 2:
        return samples, samples
    check = samples[1::4]
    return [s for i, s in enumerate(samples) if i % 4 != 1], check


def build_quant_options(options: BuildOptions) -> QuantOptions:
    return QuantOptions(options.precision, tuple(options.exclude), options.int4_block, int8_block=options.int8_block, tables=options.quantize_tables,
                        table_block=options.table_block, table_format=options.table_format, weight_only=options.weight_only)


def quantize_graph(src_dir: Path, manifest: Manifest, graph: str, dst: Path, options: BuildOptions, progress: Progress,
                   digests: dict[str, str] | None = None) -> dict:
    """Calibrate (if needed) and quantize one graph of `src_dir` into `dst` (+ `dst.data`); returns the precision record.
    `digests` gets the sha256 of the weights file (name relative to `dst`'s folder), computed while it was written."""
    spec = manifest.graph(graph)
    qopts = build_quant_options(options)
    methods = options.methods.validate()
    writer = WeightsWriter(dst.parent / (dst.name + ".data"), threaded=True)
    sink = ExternalSink(writer)
    work = WorkingGraph(load_graph(src_dir / spec.file), src_dir, sink)
    hold = bool(options.qad.steps) or options.min_top1 is not None
    if hold:
        progress(f"loading {spec.file} (--qad-steps and --min-top1 work on the whole model)")
        work.load_all()
    grids = _source_grids(work, qopts, options, hold, progress) if methods.source_grid else {}
    method_qopts = dataclasses.replace(qopts, exclude=(*qopts.exclude, *grids)) if grids else qopts
    tensors = activation_tensors(work.model, qopts)
    if not qopts.quantizes_activations and (methods.needs_rows or options.min_top1 is not None):
        tensors = calibrated_tensors(work.model, method_qopts)  # no activation range to calibrate, but the methods need the rows
    samples: list[list[int]] = []
    check: list[list[int]] = []
    if tensors or options.qad.steps:
        from ..tokenizer import TextTokenizer

        tokenizer = TextTokenizer(src_dir, manifest.tokenizer.get("eos_token_ids"))
        samples = tokenize_calibration(load_calibration_texts(options.calib), tokenizer, options.calib_samples, options.calib_max_tokens)
        if options.min_top1 is not None:  # the target is measured on samples the methods did not fit (GPTQ fits its own)
            samples, check = split_check_samples(samples)
    calibration = {"source": str(options.calib) if options.calib else "builtin", "samples": len(samples),
                   "tokens": sum(map(len, samples)),
                   "method": methods.act_calib if options.precision == "fp8" and qopts.quantizes_activations else "max"}
    with writer:
        tables = grid_candidates(work.model, qopts)
        units = UnitPass(work, qopts, method_qopts, methods, {n: tables[n] for n in grids}, sink, hold,
                         options.min_top1 is not None, progress)
        max_rows = methods.calibration_rows(qopts.defaults_key) if methods.needs_rows or options.min_top1 is not None else 0
        _run_units(units, plan_units(work.model, method_qopts, list(grids), set(tensors)), src_dir, spec, tensors, samples,
                   max_rows, options, dst.parent, progress)
        method_record = units.report.summary()
        if hold:
            report, qopts, extra = finish_whole_model(work.model, src_dir, spec, manifest, qopts, method_qopts, units.report,
                                                      grids, samples, check, bool(tensors), options, progress)
            method_record.update(extra)
            if "qad" in extra and not tensors:
                calibration["method"] = "none"
        else:
            progress(f"quantizing {graph} to {options.precision}")
            report = units.rewrite()
        work.externalize()
        copied = work.copy_sources(writer)
        progress(f"{copied} unchanged initializers copied")
        save_model(work.model, dst)
    if digests is not None:
        digests[dst.name + ".data"] = writer.sha256
    run_ort = "ort-cpu" in RUNS_ON[options.precision]
    progress("checking the quantized graph (onnx checker" + (", ONNX Runtime on a few tokens, one segment at a time)" if run_ort else ")"))
    check_graph(dst.parent, dataclasses.replace(spec, file=dst.name), run_ort, threads=options.threads, workdir=dst.parent,
                parameters=options.segment_parameters)
    return _record(report, qopts, options, calibration if tensors or "qad" in method_record else None, method_record)


def _run_units(units: UnitPass, plan: list[Unit], src_dir: Path, spec, tensors: list[str], samples: list[list[int]],
               max_rows: int, options: BuildOptions, workdir: Path, progress: Progress) -> None:
    """Every unit, each as soon as calibration completed its activations (those without any: first)."""
    stats: dict[str, ActivationStats] = {}
    waiting = list(plan)

    def run(unit: Unit, given: dict[str, ActivationStats]) -> None:
        started = time.time()
        units.run(unit, given)
        waiting.remove(unit)
        names = ", ".join(unit.weights[:2]) + (f" +{len(unit.weights) - 2}" if len(unit.weights) > 2 else "")
        progress(f"  unit {len(plan) - len(waiting)}/{len(plan)} ({names}): {time.time() - started:.1f} s")

    def run_ready() -> None:
        for unit in [u for u in waiting if all(a in stats for a in u.acts)]:
            run(unit, {a: stats.pop(a) for a in unit.acts})

    run_ready()
    if tensors:
        progress(f"calibrating {len(tensors)} activations on {len(samples)} samples ({sum(map(len, samples))} tokens), "
                 "one segment of the graph at a time; each unit of weights quantized as soon as its activations are done")
        for step in calibration_steps(src_dir, spec, tensors, samples, options.threads, workdir, max_rows, options.segment_parameters):
            stats.update(step)
            run_ready()
    for unit in list(waiting):  # activations calibration never reached
        run(unit, {a: stats.pop(a) for a in unit.acts if a in stats})


def _record(report, qopts: QuantOptions, options: BuildOptions, calibration: dict | None, method_record: dict) -> dict:
    record = report.summary()
    record["exclude_patterns"] = list(qopts.exclude)
    if options.weight_only:
        record["weight_only"] = True
    if options.precision == "int4":
        record["int4_block"] = options.int4_block
    if options.precision == "int8":
        record["int8_block"] = options.int8_block
    if calibration:
        record["calibration"] = calibration
    if method_record:
        record["methods"] = method_record
    record["runs_on"] = RUNS_ON[options.precision] if _tensorrt_blocks(report) else ["ort-cpu"]
    return record


def _source_grids(work: WorkingGraph, qopts: QuantOptions, options: BuildOptions, hold: bool, progress: Progress) -> dict:
    """Weights already on an INT4 / INT8 block grid (stored on it; the methods leave them alone) -> their grid (a
    whole-model build) or block (a streaming one, which finds the grid again when it stores the weight)."""
    if hold:
        grids = source_grids(work.model, qopts)
    else:
        grids = {}
        for name, table in grid_candidates(work.model, qopts).items():
            grid = find_source_grid(work.value(name), table, qopts.scheme)
            if grid is not None:
                grids[name] = grid.block
    if grids:
        progress(f"{len(grids)} weights are already on a block grid: stored on it, not quantized again")
        blocks = {name: g if isinstance(g, int) else g.block for name, g in grids.items()}
        grids = {name: grids[name] for name in tensorrt_grids(blocks, work.model, qopts, options.onnx_only, progress)}
    return grids


def _tensorrt_blocks(report) -> bool:
    """Whether every block-quantized weight uses a block TensorRT takes (INT4 64 / 128; no blocked INT8 table)."""
    tables = {name for name in report.tables if name in report.source_grid}
    return all(b in TRT_INT4_BLOCKS for b in report.blocks.values()) and not tables


def tensorrt_grids(blocks: dict[str, int], model, qopts: QuantOptions, onnx_only: bool, progress: Progress) -> dict[str, int]:
    """The source grids to store (weight -> block): all of them for an ONNX-only build (saying when that makes it ONNX
    Runtime only), for a TensorRT build those TensorRT takes (INT4 blocks of 64 / 128; no blocked INT8 table), the
    others quantized again."""
    tables = {t.name for t in quantized_tables(model, qopts)}
    fit = {w: b for w, b in blocks.items() if w not in tables and b in TRT_INT4_BLOCKS}
    if len(fit) == len(blocks) or "tensorrt" not in RUNS_ON[qopts.scheme]:  # an INT8 build is ONNX Runtime's anyway
        return blocks
    what = ", ".join(sorted({f"INT8 blocks of {b}" if w in tables else f"INT4 blocks of {b}"
                             for w, b in blocks.items() if w not in fit}))
    if onnx_only:
        progress(f"{len(blocks) - len(fit)} of them on grids TensorRT does not take ({what}): this build runs on ONNX "
                 "Runtime (--no-source-grid quantizes them afresh, for TensorRT)")
        return blocks
    progress(f"{len(blocks) - len(fit)} of them on grids TensorRT does not take ({what}): quantized again "
             "(--onnx-only keeps them exactly, on ONNX Runtime)")
    return fit
