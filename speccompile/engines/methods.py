"""Calibration-driven methods run before the Q/DQ pass: activation-aware scales, clipping, activation ranges.

All of them work on the fp32 graph and the activations calibration recorded (`ActivationStats`: per-channel
amax + a subset of rows), in numpy:

  * per-input-channel scales s (one per activation, shared by the MatMuls that read it): W <- diag(s) W and
    x <- x / s, which leaves the fp32 product unchanged. The 1/s is folded where that is exact: into the
    RMSNorm weight that produced x, or into the output columns of the MatMul whose Split half produced x
    (the gated MLP's up projection); elsewhere a Mul(x, 1/s) is inserted (a standard op TensorRT fuses).
      - AWQ (INT4, NVFP4): s = mean|x|^alpha, alpha searched on a grid for the smallest error of the
        quantized product on the calibration rows (alpha = 0 is plain round-to-nearest, so the search
        never does worse than RTN on them);
      - SmoothQuant (FP8, optional): s = amax_x^alpha / amax_w^(1 - alpha).
  * clipping search (INT4, NVFP4): per block of every weight the range ratio in CLIP_RATIOS (NVFP4:
    NVFP4_RANGE_RATIOS, 2 down to 0.7) with the smallest error weighted by the calibration second moment of
    each input channel.
  * GPTQ (engines/gptq.py, after the above): error compensation of each quantized weight on the
    calibration rows, within the scheme's blocks; its grid goes to the Q/DQ pass unchanged.
  * FP8 activation ranges: max, a percentile of |x|, or the clipped amax with the smallest fake-quant MSE,
    times a headroom factor.
  * low-rank branch (optional, `MethodOptions.low_rank`; SVDQuant's split, any scheme, after the input scales):
    W = A B + R, where A B is the best rank-r approximation of W weighted by each input channel's calibration
    RMS; A [K, r] and B [r, N] are stored in float16 and multiply the unquantized activation (x A) B, a 16-bit
    side branch added to the MatMul's output, and only R is quantized (clipping and GPTQ run on R). The fp32
    graph computes the same function (R is W minus the float16 factors' product).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from ..errors import InputError
from . import numerics as nx
from .calibrate import ActivationStats
from .initializers import Initializers, ModelInitializers
from .gptq import ACT_ORDER_DEFAULT, DEFAULT_DAMP, GPTQ_DEFAULT, GridScales, gptq_weight
from .method_graph import fold_input_scale, insert_low_rank_branch
from .method_search import (activation_fake_quant, awq_search, clip_search, evenly, fp8_range, low_rank_factors,
                            smoothquant_scale, weight_fake_quant)
from .qdq_targets import QuantOptions, is_excluded, quantized_tables, weight_matmuls

ACT_CALIB = ("max", "percentile", "mse")
ACT_HEADROOM = 2.0  # FP8: measured better than 1 on held-out text (docs/quantization.md)
ACT_CALIB = ("max", "percentile", "mse")
ACT_HEADROOM = 2.0  # FP8: measured better than 1 on held-out text (docs/quantization.md)


@dataclass
class MethodOptions:
    act_calib: str = "max"  # fp8 activation ranges: max | percentile | mse
    percentile: float = 99.99
    smoothquant: float | None = None  # FP8: SmoothQuant migration strength alpha (None: off)
    awq: bool = True  # INT4 / NVFP4: activation-aware input-channel scales
    clip: bool = True  # INT4 / NVFP4: per-block clipping search
    gptq: bool | None = None  # GPTQ error compensation on the calibration rows (engines/gptq.py); None: GPTQ_DEFAULT
    gptq_damp: float | None = None  # None: the scheme's default (DEFAULT_DAMP)
    gptq_act_order: bool | None = None  # GPTQ in decreasing Hessian-diagonal order, static groups; None: ACT_ORDER_DEFAULT
    act_headroom: float = ACT_HEADROOM  # FP8: activation ranges times this (room for values above the calibration's)
    low_rank: int = 0  # rank of a float16 branch that takes the weights' principal part out of quantization (0: off)
    source_grid: bool = True  # store weights already on an INT4 / INT8 block grid on it (engines/source_grid.py)
    search_rows: int = 256  # calibration rows used by the searches (evenly spaced over those kept)
    hessian_rows: int = 2048  # calibration rows kept for GPTQ's Hessian

    def uses_gptq(self, scheme: str) -> bool:
        return self.gptq if self.gptq is not None else GPTQ_DEFAULT[scheme]

    def damp(self, scheme: str) -> float:
        return self.gptq_damp if self.gptq_damp is not None else DEFAULT_DAMP[scheme]

    def act_order(self, scheme: str) -> bool:
        return self.gptq_act_order if self.gptq_act_order is not None else ACT_ORDER_DEFAULT[scheme]

    def validate(self) -> "MethodOptions":
        if self.act_calib not in ACT_CALIB:
            raise InputError(f"--act-calib must be one of {', '.join(ACT_CALIB)}, got {self.act_calib}")
        if not 50.0 < self.percentile <= 100.0:
            raise InputError(f"--percentile must be in (50, 100], got {self.percentile}")
        if not 1.0 <= self.act_headroom <= 64.0:
            raise InputError(f"--act-headroom must be in [1, 64], got {self.act_headroom}")
        if self.gptq_damp is not None and not 0.0 < self.gptq_damp <= 10.0:
            raise InputError(f"--gptq-damp must be in (0, 10], got {self.gptq_damp}")
        if self.smoothquant is not None and not 0.0 <= self.smoothquant <= 1.0:
            raise InputError(f"--smoothquant must be in [0, 1], got {self.smoothquant}")
        if self.low_rank < 0:
            raise InputError(f"--low-rank must be >= 0, got {self.low_rank}")
        return self

    def calibration_rows(self, scheme: str) -> int:
        """How many rows calibration keeps per activation."""
        return max(self.search_rows, self.hessian_rows if self.uses_gptq(scheme) else 0)

    @property
    def needs_rows(self) -> bool:
        return (self.awq or self.clip or self.gptq is not False or self.act_calib != "max" or self.smoothquant is not None
                or self.low_rank > 0)


@dataclass
class MethodReport:
    act_amax: dict[str, float] = field(default_factory=dict)  # activation (after renames) -> range for Q/DQ
    weight_clip: dict[str, np.ndarray] = field(default_factory=dict)
    input_scales: dict[str, dict] = field(default_factory=dict)  # activation -> {method, alpha, folded, error}
    weight_error: dict[str, float] = field(default_factory=dict)  # weight -> typical per-token relative error of its product
    weight_grid: dict[str, GridScales] = field(default_factory=dict)  # weight -> scales GPTQ quantized it with
    gptq_error_ratio: list[float] = field(default_factory=list)  # per weight: calibration product error GPTQ / without
    gptq_settings: dict = field(default_factory=dict)  # damping and activation order, when GPTQ ran
    low_rank: dict[str, int] = field(default_factory=dict)  # weight -> rank of its float16 branch
    low_rank_bytes: int = 0  # the branches' float16 factors
    clip_means: dict[str, float] = field(default_factory=dict)  # weight -> mean clipping ratio (kept when the arrays go)
    gptq_weights: list[str] = field(default_factory=list)  # weights GPTQ quantized (kept when their grids go)

    def merge(self, other: "MethodReport") -> None:
        """Add the report of other activations (a streaming build's next unit) to this one."""
        for name in ("act_amax", "weight_clip", "input_scales", "weight_error", "weight_grid", "low_rank", "clip_means"):
            getattr(self, name).update(getattr(other, name))
        self.gptq_error_ratio += other.gptq_error_ratio
        self.gptq_weights += other.gptq_weights
        self.gptq_settings = self.gptq_settings or other.gptq_settings
        self.low_rank_bytes += other.low_rank_bytes

    def release(self, weights: set[str]) -> None:
        """Forget the arrays (clipping ratios, GPTQ grids) of `weights` once they are stored; the summary stays."""
        for name in weights:
            self.weight_clip.pop(name, None)
            self.weight_grid.pop(name, None)

    def summary(self) -> dict:
        folded: dict[str, int] = {}
        for info in self.input_scales.values():
            folded[info["folded"]] = folded.get(info["folded"], 0) + 1
        out: dict = {}
        if self.input_scales:
            methods = sorted({i["method"] for i in self.input_scales.values()})
            alphas = [i["alpha"] for i in self.input_scales.values()]
            ratio = [i["error_ratio"] for i in self.input_scales.values() if i.get("error_ratio") is not None]
            out["input_scales"] = {"method": "+".join(methods), "activations": len(self.input_scales), "fold": folded,
                                   "alpha_mean": round(float(np.mean(alphas)), 3)}
            if ratio:
                out["input_scales"]["error_vs_rtn_mean"] = round(float(np.mean(ratio)), 4)
        if self.gptq_weights:
            out["gptq"] = {"weights": len(self.gptq_weights), **self.gptq_settings,
                           "error_vs_without_mean": round(float(np.mean(self.gptq_error_ratio)), 4) if self.gptq_error_ratio else None}
        if self.low_rank:
            out["low_rank"] = {"weights": len(self.low_rank), "ranks": sorted(set(self.low_rank.values())),
                               "mb": round(self.low_rank_bytes / 1e6, 1)}
        if self.clip_means:
            out["clip_search"] = {"weights": len(self.clip_means),
                                  "mean_ratio": round(float(np.mean(list(self.clip_means.values()))), 4)}
        return out


def activation_range(rows: np.ndarray, amax: float, scheme: str, methods: MethodOptions) -> float:
    """The range a Q/DQ activation scale is derived from: FP8 `--act-calib` times `--act-headroom`; NVFP4 amax."""
    if scheme != "fp8":
        return amax
    return fp8_range(evenly(rows, methods.search_rows), amax, methods.act_calib, methods.percentile) * methods.act_headroom


def split_low_rank(model: onnx.ModelProto, options: QuantOptions, rows: dict[str, np.ndarray], rank: int,
                   report: MethodReport, weights: Initializers) -> None:
    """Every quantized MatMul x W becomes x R + (x A) B: R = W - A B replaces W (what the Q/DQ pass quantizes),
    A and B float16 initializers (named with LOW_RANK_SUFFIXES: never quantized) behind a Cast in a float32 graph. The rank
    is at most half of min(K, N) (beyond that the branch costs more than the weight it takes out)."""
    for act, readers in quantized_groups(model, options).items():
        x = rows.get(act)
        if x is None or not x.size:
            continue
        moment = np.square(x.astype(np.float64)).mean(axis=0)
        for node, weight in readers:
            stored = weights.value(weight)
            r = min(rank, min(stored.shape) // 2)
            if r < 1:
                continue
            w = stored.astype(np.float32)
            a, b = low_rank_factors(w, moment, r)
            residual = w - a.astype(np.float32) @ b.astype(np.float32)
            weights.set(weight, residual.astype(stored.dtype))
            insert_low_rank_branch(model.graph, node, weight, a, b, stored.dtype, weights)
            report.low_rank[weight] = r
            report.low_rank_bytes += a.nbytes + b.nbytes


# ---------------------------------------------------------------- the pass

def quantized_groups(model: onnx.ModelProto, options: QuantOptions) -> dict[str, list[tuple[onnx.NodeProto, str]]]:
    """activation -> [(MatMul node, weight)] of the MatMuls the Q/DQ pass will quantize, in graph order."""
    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list] = {}
    for index, act, weight in weight_matmuls(model):
        if is_excluded(weight, options.exclude):
            continue
        k = inits[weight].dims[0]
        if options.scheme == "int4" and nx.pick_block(k, options.int4_block) is None:
            continue
        if options.scheme == "nvfp4" and k % options.fp4_block:
            continue
        groups.setdefault(act, []).append((model.graph.node[index], weight))
    return groups


def calibrated_tensors(model: onnx.ModelProto, options: QuantOptions) -> list[str]:
    """Every activation the methods search on: quantized MatMul inputs and tied lm_head inputs."""
    tables = [t.head_input for t in quantized_tables(model, options) if t.head is not None and not options.table_weight_only]
    return list(dict.fromkeys([*quantized_groups(model, options), *tables]))


def apply_methods(model: onnx.ModelProto, options: QuantOptions, stats: dict[str, ActivationStats],
                  methods: MethodOptions, progress=lambda _m: None, measure_errors: bool = False,
                  weights: Initializers | None = None) -> MethodReport:
    """Rewrite `model` with the input scales of `methods` (initializer values through `weights`, default: the model's
    own, loaded); return ranges and clip ratios for Q/DQ. Activations without `stats` are left alone.

    `measure_errors`: also record each weight's relative product error on the calibration rows (sensitivity)."""
    weights = weights or ModelInitializers(model)
    report = MethodReport()
    key = options.defaults_key
    if methods.uses_gptq(key):
        report.gptq_settings = {"damping": methods.damp(key), "act_order": methods.act_order(key)}
    scaled_rows = _input_scales(model, options, stats, methods, weights, report, progress)
    if methods.low_rank:
        split_low_rank(model, options, scaled_rows, methods.low_rank, report, weights)
    for table in quantized_tables(model, options):  # a tied lm_head: its input range, the table's clipping
        st = stats.get(table.head_input) if table.head is not None and not options.table_weight_only else None
        if st is None:
            continue
        report.act_amax[table.head_input] = activation_range(st.rows, st.amax, options.scheme, methods)
        if st.rows.size:
            _compensate(report, table.name, weights.value(table.name).astype(np.float32).T, st.rows, options.for_table(), methods)
    for act, readers in quantized_groups(model, options).items():  # on the final weights (after every fold)
        rows = scaled_rows.get(act)
        if rows is None or not rows.size:
            continue
        for _node, weight in readers:
            w = _compensate(report, weight, weights.value(weight).astype(np.float32), rows, options, methods)
            if measure_errors:
                report.weight_error[weight] = _product_error(w, rows, report, act, weight, options, methods)
    return report


def _input_scales(model: onnx.ModelProto, options: QuantOptions, stats: dict[str, ActivationStats], methods: MethodOptions,
                  weights: Initializers, report: MethodReport, progress) -> dict[str, np.ndarray]:
    """AWQ / SmoothQuant scales of every activation with stats, folded; the activation ranges. Returns each
    activation's calibration rows as its readers now see them (under its new name when a Mul took the scale)."""
    scheme = options.scheme
    groups = quantized_groups(model, options)
    scaled_rows: dict[str, np.ndarray] = {}
    for number, (act, readers) in enumerate(groups.items()):
        st = stats.get(act)
        if st is None:
            continue
        stored = [weights.value(w) for _n, w in readers]
        values = [w.astype(np.float32) for w in stored]
        scale = None
        info: dict = {}
        if scheme in ("int4", "nvfp4") and methods.awq and st.rows.size:
            scale, alpha, ratio = awq_search(st, values, options, methods.search_rows)
            info = {"method": "awq", "alpha": alpha, "error_ratio": round(ratio, 4)}
            if alpha == 0.0:
                scale = None
        elif scheme == "fp8" and methods.smoothquant is not None:
            scale = smoothquant_scale(st, values, methods.smoothquant)
            info = {"method": "smoothquant", "alpha": methods.smoothquant}
        name, rows, channel_amax = act, st.rows, st.channel_amax
        if scale is not None:
            for (_node, weight), w, original in zip(readers, values, stored):
                weights.set(weight, (w * scale[:, None]).astype(original.dtype))
            name, folded = fold_input_scale(model, act, scale, [n for n, _w in readers], weights)
            info["folded"] = folded
            report.input_scales[name] = info
            rows, channel_amax = rows / scale, channel_amax / scale
        del stored, values
        report.act_amax[name] = activation_range(rows, float(channel_amax.max()), scheme, methods)
        scaled_rows[name] = rows
        if number % 20 == 19:
            progress(f"  {number + 1}/{len(groups)} activations")
    return scaled_rows


def _product_error(w: np.ndarray, rows: np.ndarray, report: MethodReport, act: str, weight: str, options: QuantOptions,
                   methods: MethodOptions) -> float:
    """The relative error of the quantized product x W on the calibration rows: medians over tokens, so neither a few
    massive-activation tokens (huge outputs, they would hide everyone else's error) nor near-zero outputs (huge
    relative error, no effect) decide."""
    x = evenly(rows, methods.search_rows)
    amax = report.act_amax.get(act, float(np.abs(x).max()))
    xq = activation_fake_quant(x, options, amax)
    exact = x @ w
    got = xq @ weight_fake_quant(w, options, report.weight_clip.get(weight), report.weight_grid.get(weight))
    typical = max(float(np.median(np.square(exact).sum(axis=1))), 1e-30)
    return float(np.median(np.square(exact - got).sum(axis=1)) / typical)


def _compensate(report: MethodReport, name: str, w: np.ndarray, rows: np.ndarray, options: QuantOptions,
                methods: MethodOptions) -> np.ndarray:
    """Clipping search, then GPTQ on W [K, N] (an embedding table's T^T); returns the weight the Q/DQ pass will
    quantize (GPTQ's compensated one, kept in the grid: the graph's fp32 weight stays for weights left unquantized)."""
    blockwise = options.scheme in ("int4", "nvfp4")
    clip = clip_search(w, np.square(evenly(rows, methods.search_rows)).mean(axis=0), options) if methods.clip and blockwise else None
    if clip is not None:
        report.weight_clip[name] = clip
        report.clip_means[name] = clip.mean()
    key = options.defaults_key
    if not methods.uses_gptq(key):
        return w
    block = nx.pick_block(w.shape[0], options.int4_block) if options.scheme == "int4" else options.fp4_block
    quantized, grid = gptq_weight(w, rows, options.scheme, block, clip, methods.damp(key), methods.act_order(key))
    before = float(np.square(rows @ (w - weight_fake_quant(w, options, clip))).sum())
    after = float(np.square(rows @ (w - quantized)).sum())
    report.gptq_error_ratio.append(after / before if before > 0 else 1.0)
    report.weight_grid[name] = grid
    report.gptq_weights.append(name)
    return quantized
