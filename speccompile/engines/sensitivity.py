"""Keep the most sensitive MatMuls in higher precision until a quality target is met (`build --min-top1`).

Each quantized weight's effect is measured on calibration activations: the median over tokens of its quantized
product's squared error over the median squared output (`MethodReport.weight_error`). Weights are kept unquantized worst first; how many is decided by
quantizing the whole graph and measuring top-1 agreement with the unquantized graph over calibration
prompts held back from the fitting (`build.split_check_samples`: GPTQ fits the others closely, so agreement on
them says little of new text) in ONNX Runtime CPU (NVFP4 through its exact emulation): doubling, then
bisection, so a 120-weight model needs about 2 log2(kept) full-model measurements.

Kept weights stay fp32, or (`keep_format="fp8"`, `build --keep-format fp8`) go to FP8 weight-only per output
channel (`store_kept`): a quarter of the fp32 size, and the search measures the graph with them in FP8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx

from ..errors import UnsupportedError
from ..manifest import GraphSpec
from .calibrate import prefill_feeds
from .segments import cpu_session
from .quality import LogitComparison
from .qdq_targets import QuantOptions, weight_matmuls
from .quantize import quantize_model

KEEP_FORMATS = ("fp32", "fp8")

Progress = Callable[[str], None]


@dataclass
class SensitivityResult:
    min_top1: float
    top1: float  # calibration top-1 agreement of the chosen graph
    kept: list[str] = field(default_factory=list)
    kept_fp32_mb: float = 0.0
    measurements: dict[int, float] = field(default_factory=dict)  # number kept -> calibration top-1
    keep_format: str = "fp32"
    kept_mb: float = 0.0  # what the kept weights take in keep_format

    def summary(self) -> dict:
        return {"min_top1": self.min_top1, "calibration_top1": round(self.top1, 4), "kept": self.kept,
                "kept_fp32_mb": round(self.kept_fp32_mb, 1), "keep_format": self.keep_format, "kept_mb": round(self.kept_mb, 1),
                "measured": {str(k): round(v, 4) for k, v in sorted(self.measurements.items())}}


def store_kept(model: onnx.ModelProto, kept: Sequence[str], keep_format: str) -> None:
    """Store the kept weights (still float after the scheme's pass) in `keep_format`: fp32 leaves them, fp8 quantizes
    exactly them to FP8 weight-only (per output channel)."""
    if keep_format == "fp32" or not kept:
        return
    keep = set(kept)
    others = tuple(w for _i, _a, w in weight_matmuls(model) if w not in keep)
    quantize_model(model, QuantOptions("fp8", exclude=others, weight_only=True))


def _session(model: onnx.ModelProto, threads: int | None):
    # INT4 MatMuls at the accuracy level the runtime uses
    return cpu_session(model.SerializeToString(), threads, {"session.qdq_matmulnbits_accuracy_level": "0"})


def _logits(session, spec: GraphSpec, samples: Sequence[Sequence[int]]) -> list[np.ndarray]:
    return [session.run(["logits"], prefill_feeds(spec, ids))[0].reshape(len(ids), -1) for ids in samples]


def _fewest_reaching(top1: Callable[[int], float], total: int, target: float) -> int:
    """The smallest count with top1(count) >= target: doubling, then bisection (quality grows roughly
    monotonically with the number of weights kept); `total` when only keeping everything reaches it."""
    if top1(0) >= target:
        return 0
    low, high = 0, 1
    while high < total and top1(high) < target:
        low, high = high, min(2 * high, total)
    while high - low > 1:
        mid = (low + high) // 2
        if top1(mid) >= target:
            high = mid
        else:
            low = mid
    return high


def search_kept_weights(
    model: onnx.ModelProto,
    options: QuantOptions,
    act_amax: dict[str, float] | None,
    weight_clip: dict[str, np.ndarray],
    weight_error: dict[str, float],
    weight_grid: dict | None,
    spec: GraphSpec,
    samples: Sequence[Sequence[int]],
    min_top1: float,
    threads: int | None = None,
    progress: Progress = lambda _m: None,
    keep_format: str = "fp32",
) -> SensitivityResult:
    """The fewest worst-first weights to keep in `keep_format` for calibration top-1 >= min_top1 (`model` is not changed)."""
    from .emulate import emulate_nvfp4

    reference = _logits(_session(model, threads), spec, samples)
    order = sorted(weight_error, key=weight_error.get, reverse=True)
    measured: dict[int, float] = {}

    def top1(count: int) -> float:
        if count == len(order):
            return 1.0  # nothing quantized in the scheme (never measured: the search stops below it)
        if count not in measured:
            trial = onnx.ModelProto()
            trial.CopyFrom(model)
            kept = tuple(order[:count])
            quantize_model(trial, dataclasses.replace(options, exclude=(*options.exclude, *kept)), act_amax, weight_clip, weight_grid)
            store_kept(trial, kept, keep_format)
            if options.scheme == "nvfp4":
                emulate_nvfp4(trial)
            comparison = LogitComparison()
            for ref, got in zip(reference, _logits(_session(trial, threads), spec, samples)):
                comparison.add(ref, got)
            measured[count] = comparison.top1_agreement
            progress(f"  {count} weight(s) kept in {keep_format}: calibration top-1 {measured[count]:.4f}")
        return measured[count]

    count = _fewest_reaching(top1, len(order), min_top1)
    if count == len(order):
        raise UnsupportedError(f"--min-top1 {min_top1}: not reached unless every MatMul is kept in {keep_format} "
                               f"(best measured: {max(measured.values(), default=0.0):.4f}); lower the target")
    inits = {i.name: i for i in model.graph.initializer}
    kept = order[:count]
    mb = sum(int(np.prod(inits[w].dims)) * 4 for w in kept) / 1e6
    stored = mb if keep_format == "fp32" else sum(int(np.prod(inits[w].dims)) + 4 * inits[w].dims[1] for w in kept) / 1e6
    return SensitivityResult(min_top1, top1(count), kept, mb, measured, keep_format, stored)
