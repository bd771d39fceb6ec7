"""The passes of a build that need the whole model in memory after the methods: quantization-aware distillation
(`--qad-steps`: the graph runs in torch) and the sensitivity search (`--min-top1`: quantized whole graphs measured),
then the Q/DQ pass on the loaded model. A streaming build without them never loads the model
(engines/quantize_graph.py); with them the weights are loaded at the start, as every build did before."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from ..manifest import GraphSpec, Manifest
from .build_options import BuildOptions
from .methods import MethodReport, quantized_groups
from .qad import QadResult
from .qdq_targets import QuantOptions
from .quantize import QuantReport, quantize_model
from .sensitivity import search_kept_weights, store_kept

Progress = Callable[[str], None]


def finish_whole_model(model: onnx.ModelProto, src_dir: Path, spec: GraphSpec, manifest: Manifest, qopts: QuantOptions,
                       method_qopts: QuantOptions, applied: MethodReport, grids: dict, samples: list[list[int]],
                       check: list[list[int]], calibrated: bool, options: BuildOptions,
                       progress: Progress) -> tuple[QuantReport, QuantOptions, dict]:
    """QAD and the --min-top1 search (as asked) on the loaded, fitted `model`, then its Q/DQ pass. Returns the pass's
    report, the options it ran with (the kept weights excluded) and the methods record of QAD and the search."""
    amax = applied.act_amax if calibrated and qopts.quantizes_activations else None
    weight_clip = applied.weight_clip if calibrated else None
    weight_grid = dict(grids)
    weight_grid.update(applied.weight_grid)
    extra: dict = {}
    if options.qad.steps:
        result = _distill(model, src_dir, spec, manifest.tokenizer.get("eos_token_ids") or [], method_qopts, weight_grid,
                          weight_clip or {}, samples, options, progress)
        if result is not None:
            weight_grid.update(result.grids)
            extra["qad"] = result.summary
    kept_weights: list[str] = []
    if calibrated and options.min_top1 is not None:
        progress(f"sensitivity: keeping the worst MatMuls in {options.keep_format} until top-1 >= {options.min_top1} on "
                 f"{len(check)} held-back calibration samples ({sum(map(len, check))} tokens)")
        kept = search_kept_weights(model, qopts, amax, weight_clip, applied.weight_error, weight_grid, spec, check,
                                   options.min_top1, options.threads, progress, options.keep_format)
        qopts = dataclasses.replace(qopts, exclude=(*qopts.exclude, *kept.kept))
        kept_weights = kept.kept
        extra["sensitivity"] = {**kept.summary(), "check_samples": len(check), "check_tokens": sum(map(len, check))}
    progress(f"quantizing {spec.role} to {options.precision}")
    report = quantize_model(model, qopts, amax, weight_clip, weight_grid)
    if kept_weights:
        store_kept(model, kept_weights, options.keep_format)
    return report, qopts, extra


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
