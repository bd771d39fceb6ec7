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
from onnx import helper, numpy_helper

from ..errors import InputError
from . import numerics as nx
from .calibrate import ActivationStats
from .gptq import ACT_ORDER_DEFAULT, DEFAULT_DAMP, GPTQ_DEFAULT, GridScales, gptq_weight
from .quantize import (LOW_RANK_SUFFIXES, QuantOptions, add_side_branch, float16_constant, is_excluded, quantized_tables,
                       weight_matmuls)

ACT_CALIB = ("max", "percentile", "mse")
ACT_HEADROOM = 2.0  # FP8: measured better than 1 on held-out text (docs/quantization.md)
AWQ_GRID = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 11))
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# NVFP4: E2M1's levels are not evenly spaced (..., 3, 4, 6), so a block can also fit better with its largest value
# on a lower level (ratio > 1, e.g. 1.5: the max on 4); steps of 1/16 reach every FP8 block scale in the range
NVFP4_RANGE_RATIOS = tuple(2.0 - i / 16 for i in range(21)) + (0.7,)
MSE_RATIOS = tuple(round(r, 3) for r in np.linspace(0.5, 1.0, 21))


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
        if self.weight_grid:
            out["gptq"] = {"weights": len(self.weight_grid), **self.gptq_settings,
                           "error_vs_without_mean": round(float(np.mean(self.gptq_error_ratio)), 4) if self.gptq_error_ratio else None}
        if self.low_rank:
            out["low_rank"] = {"weights": len(self.low_rank), "ranks": sorted(set(self.low_rank.values())),
                               "mb": round(self.low_rank_bytes / 1e6, 1)}
        if self.weight_clip:
            out["clip_search"] = {"weights": len(self.weight_clip),
                                  "mean_ratio": round(float(np.mean([c.mean() for c in self.weight_clip.values()])), 4)}
        return out


# ---------------------------------------------------------------- fake quantization (numpy)

def weight_fake_quant(w: np.ndarray, options: QuantOptions, clip: np.ndarray | None = None,
                      grid: GridScales | None = None) -> np.ndarray:
    """W [K, N] as the Q/DQ graph of `options.scheme` will see it (float32; on `grid` when GPTQ chose one)."""
    if options.scheme == "fp8":
        q, scale = nx.quantize_fp8_per_channel(w, axis=1, scale=grid.scale if grid else None)
        return q.astype(np.float32) * scale
    if options.scheme == "int4":
        block = nx.pick_block(w.shape[0], options.int4_block)
        q, scale = nx.quantize_int4_blockwise(w, block, clip, grid.scale if grid else None)
        return nx.dequantize_int4_blockwise(q, scale, block)
    w_t = np.ascontiguousarray(w.T)
    if grid is None:
        codes, s8, s2 = nx.nvfp4_quantize(w_t, block=options.fp4_block, clip=clip)
    else:
        codes, s8, s2 = nx.nvfp4_quantize(w_t, grid.global_scale, options.fp4_block, block_scale=grid.scale)
    return nx.nvfp4_dequantize(codes, s8, s2, options.fp4_block).T


def activation_fake_quant(x: np.ndarray, options: QuantOptions, amax: float) -> np.ndarray:
    """x [T, K] after the activation Q/DQ of the scheme (INT4 and weight-only builds: unchanged)."""
    if not options.quantizes_activations:
        return x
    if options.scheme == "fp8":
        return nx.fp8_fake_quant(x, nx.fp8_activation_scale(amax))
    if options.scheme == "nvfp4":
        codes, s8, s2 = nx.nvfp4_quantize(x, nx.nvfp4_global_scale(amax), options.fp4_block)
        return nx.nvfp4_dequantize(codes, s8, s2, options.fp4_block)
    return x


def evenly(rows: np.ndarray, count: int) -> np.ndarray:
    """At most `count` rows, evenly spaced over all of them (calibration rows come sample after sample)."""
    if len(rows) <= count:
        return rows
    return rows[np.linspace(0, len(rows) - 1, count).astype(np.int64)]


def fp8_range(rows: np.ndarray, amax: float, method: str, percentile: float = 99.99) -> float:
    """The activation range an FP8 per-tensor scale is derived from (scale = range / 448)."""
    if method == "max" or rows.size == 0 or amax <= 0:
        return amax
    magnitude = np.abs(rows)
    if method == "percentile":
        return float(min(amax, max(np.percentile(magnitude, percentile), amax * 1e-3)))
    errors = [float(np.square(nx.fp8_fake_quant(rows, nx.fp8_activation_scale(amax * r)) - rows).mean()) for r in MSE_RATIOS]
    return float(amax * MSE_RATIOS[int(np.argmin(errors))])


def activation_range(rows: np.ndarray, amax: float, scheme: str, methods: MethodOptions) -> float:
    """The range a Q/DQ activation scale is derived from: FP8 `--act-calib` times `--act-headroom`; NVFP4 amax."""
    if scheme != "fp8":
        return amax
    return fp8_range(evenly(rows, methods.search_rows), amax, methods.act_calib, methods.percentile) * methods.act_headroom


# ---------------------------------------------------------------- searches

def product_error(x: np.ndarray, weights: list[np.ndarray], scale: np.ndarray, options: QuantOptions, amax: float) -> float:
    """sum_j ||x W_j - Qa(x / s) Qw(diag(s) W_j)||^2 on the calibration rows x."""
    xq = activation_fake_quant(x / scale, options, amax)
    return float(sum(np.square(x @ w - xq @ weight_fake_quant(w * scale[:, None], options)).sum() for w in weights))


def awq_search(stats: ActivationStats, weights: list[np.ndarray], options: QuantOptions, rows: int) -> tuple[np.ndarray, float, float]:
    """(s, alpha, error / error of plain RTN) minimizing `product_error` over s = mean|x|^alpha."""
    x = evenly(stats.rows, rows)
    mean_abs = np.maximum(np.abs(x).mean(axis=0), 1e-6)
    best = (np.ones_like(mean_abs), 0.0, None)
    base = None
    for alpha in AWQ_GRID:
        s = np.power(mean_abs, alpha).astype(np.float32)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        amax = float((stats.channel_amax / s).max())
        err = product_error(x, weights, s, options, amax)
        if base is None:
            base = err
        if best[2] is None or err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], (best[2] / base if base else 1.0)


def smoothquant_scale(stats: ActivationStats, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """s_k = amax_x,k^alpha / amax_w,k^(1 - alpha) (input channel k; weights of all readers of x)."""
    w_amax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    s = np.power(np.maximum(stats.channel_amax, 1e-5), alpha) / np.power(np.maximum(w_amax, 1e-5), 1.0 - alpha)
    return np.clip(s, 1e-2, 1e2).astype(np.float32)


def clip_search(w: np.ndarray, second_moment: np.ndarray, options: QuantOptions) -> np.ndarray:
    """Per-block clipping ratios (the shape the quantizer takes) with the smallest sum_k E[x_k^2] (w - q)^2."""
    h = second_moment.astype(np.float32)
    if options.scheme == "int4":
        block = nx.pick_block(w.shape[0], options.int4_block)
        shape = (w.shape[0] // block, w.shape[1])

        def block_error(q: np.ndarray) -> np.ndarray:
            return (np.square(w - q) * h[:, None]).reshape(shape[0], block, shape[1]).sum(axis=1)
    else:
        block = options.fp4_block
        shape = (w.shape[1], w.shape[0] // block)

        def block_error(q: np.ndarray) -> np.ndarray:
            return (np.square(w - q) * h[:, None]).T.reshape(shape[0], shape[1], block).sum(axis=2)
    best_err = best = None
    for ratio in NVFP4_RANGE_RATIOS if options.scheme == "nvfp4" else CLIP_RATIOS:
        clip = np.full(shape, ratio, np.float32)
        err = block_error(weight_fake_quant(w, options, clip))
        if best is None:
            best, best_err = clip, err
        else:
            better = err < best_err
            best = np.where(better, clip, best)
            best_err = np.where(better, err, best_err)
    return best


def low_rank_factors(w: np.ndarray, second_moment: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 A [K, r], B [r, N] with A B the best rank-r approximation of W [K, N] in the norm that weights
    input channel k by its calibration RMS (SVD of diag(d) W, d = sqrt(E[x_k^2]), then A = U S / d)."""
    d = np.sqrt(second_moment.astype(np.float64) + 0.01 * float(second_moment.mean()) + 1e-30)
    u, sv, vt = np.linalg.svd(d[:, None] * w.astype(np.float64), full_matrices=False)
    a = (u[:, :rank] * sv[:rank]) / d[:, None]
    return a.astype(np.float16), vt[:rank].astype(np.float16)


def split_low_rank(model: onnx.ModelProto, options: QuantOptions, rows: dict[str, np.ndarray], rank: int,
                   report: MethodReport) -> None:
    """Every quantized MatMul x W becomes x R + (x A) B: R = W - A B replaces W (what the Q/DQ pass quantizes),
    A and B float16 initializers (named with LOW_RANK_SUFFIXES: never quantized) behind a Cast in a float32 graph. The rank
    is at most half of min(K, N) (beyond that the branch costs more than the weight it takes out)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    for act, readers in quantized_groups(model, options).items():
        x = rows.get(act)
        if x is None or not x.size:
            continue
        moment = np.square(x.astype(np.float64)).mean(axis=0)
        for node, weight in readers:
            stored = numpy_helper.to_array(inits[weight])
            r = min(rank, min(stored.shape) // 2)
            if r < 1:
                continue
            w = stored.astype(np.float32)
            a, b = low_rank_factors(w, moment, r)
            residual = w - a.astype(np.float32) @ b.astype(np.float32)
            inits[weight].CopyFrom(numpy_helper.from_array(residual.astype(stored.dtype), weight))
            _insert_branch(graph, node, weight, a, b, stored.dtype)
            report.low_rank[weight] = r
            report.low_rank_bytes += a.nbytes + b.nbytes


def _insert_branch(graph: onnx.GraphProto, matmul: onnx.NodeProto, weight: str, a: np.ndarray, b: np.ndarray,
                   dtype: np.dtype) -> None:
    """After `matmul` (y = x W): y = (x W) + (x A) B, A and B float16 behind their Casts."""
    factors = []
    at = list(graph.node).index(matmul)
    for suffix, value in zip(LOW_RANK_SUFFIXES, (a, b)):
        init, cast, name = float16_constant(weight + suffix, value, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        graph.initializer.append(init)
        for node in cast:
            graph.node.insert(at, node)
            at += 1
        factors.append(name)
    add_side_branch(graph, matmul, factors[0], factors[1], "low_rank")


# ---------------------------------------------------------------- graph surgery

def fold_input_scale(model: onnx.ModelProto, act: str, scale: np.ndarray, readers: list[onnx.NodeProto]) -> tuple[str, str]:
    """Make `readers` see act / scale. Returns (tensor they now read, where 1/scale went)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    producer = producers.get(act)
    only_readers = uses.get(act, 0) == len(readers) and act not in {o.name for o in graph.output}
    if producer is not None and producer.op_type == "Mul" and only_readers:
        for side in producer.input:
            init = inits.get(side)
            if init is not None and uses.get(side) == 1 and int(np.prod(init.dims)) == scale.size:
                value = numpy_helper.to_array(init).astype(np.float32)
                init.CopyFrom(numpy_helper.from_array((value / scale.reshape(value.shape)).astype(value.dtype), side))
                return act, "norm weight"
        for side in producer.input:
            column = _split_columns(side, producers, inits, uses)
            if column is not None and column[2] - column[1] == scale.size:
                weight, start, stop = column
                value = numpy_helper.to_array(inits[weight]).astype(np.float32).copy()
                value[:, start:stop] /= scale[None, :]
                inits[weight].CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(inits[weight]).dtype), weight))
                return act, "previous matmul"
    taken = {n for node in graph.node for n in (*node.input, *node.output)} | set(inits)
    inv_name, out = f"{act}_inv_input_scale", f"{act}_scaled"
    while inv_name in taken or out in taken:
        inv_name, out = inv_name + "_", out + "_"
    graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), inv_name))
    mul = helper.make_node("Mul", [act, inv_name], [out], name=f"{act}/InputScale")
    first = min(list(graph.node).index(r) for r in readers)
    graph.node.insert(first, mul)
    for reader in readers:
        reader.input[0] = out
    return out, "mul"


def _split_columns(tensor: str, producers, inits, uses) -> tuple[str, int, int] | None:
    """(weight, first column, end column) when `tensor` is one output of a last-axis Split of MatMul(x, weight)."""
    split = producers.get(tensor)
    if split is None or split.op_type != "Split" or uses.get(tensor) != 1 or len(split.input) < 2:
        return None
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    matmul = producers.get(split.input[0])
    if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in inits:
        return None
    if uses.get(split.input[0]) != 1 or axis not in (-1, 1, 2):
        return None
    sizes = _constant(split.input[1], producers, inits)
    if sizes is None:
        return None
    sizes = sizes.astype(int).tolist()
    index = list(split.output).index(tensor)
    start = int(sum(sizes[:index]))
    return matmul.input[1], start, start + int(sizes[index])


def _constant(name: str, producers, inits) -> np.ndarray | None:
    """The value of an initializer or Constant-node output, else None."""
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        value = next((a for a in node.attribute if a.name == "value"), None)
        return numpy_helper.to_array(value.t) if value is not None else None
    return None


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
                  methods: MethodOptions, progress=lambda _m: None, measure_errors: bool = False) -> MethodReport:
    """Rewrite `model` (weights loaded) with the input scales of `methods`; return ranges and clip ratios for Q/DQ.

    `measure_errors`: also record each weight's relative product error on the calibration rows (sensitivity)."""
    scheme = options.scheme
    report = MethodReport()
    key = options.defaults_key
    if methods.uses_gptq(key):
        report.gptq_settings = {"damping": methods.damp(key), "act_order": methods.act_order(key)}
    inits = {i.name: i for i in model.graph.initializer}
    groups = quantized_groups(model, options)
    scaled_rows: dict[str, np.ndarray] = {}
    for number, (act, readers) in enumerate(groups.items()):
        st = stats.get(act)
        if st is None:
            continue
        weights = [numpy_helper.to_array(inits[w]).astype(np.float32) for _n, w in readers]
        scale = None
        info: dict = {}
        if scheme in ("int4", "nvfp4") and methods.awq and st.rows.size:
            scale, alpha, ratio = awq_search(st, weights, options, methods.search_rows)
            info = {"method": "awq", "alpha": alpha, "error_ratio": round(ratio, 4)}
            if alpha == 0.0:
                scale = None
        elif scheme == "fp8" and methods.smoothquant is not None:
            scale = smoothquant_scale(st, weights, methods.smoothquant)
            info = {"method": "smoothquant", "alpha": methods.smoothquant}
        name, rows, channel_amax = act, st.rows, st.channel_amax
        if scale is not None:
            for (_node, weight), w in zip(readers, weights):
                inits[weight].CopyFrom(numpy_helper.from_array((w * scale[:, None]).astype(numpy_helper.to_array(inits[weight]).dtype), weight))
            name, folded = fold_input_scale(model, act, scale, [n for n, _w in readers])
            inits = {i.name: i for i in model.graph.initializer}
            info["folded"] = folded
            report.input_scales[name] = info
            rows, channel_amax = rows / scale, channel_amax / scale
        amax = float(channel_amax.max())
        report.act_amax[name] = activation_range(rows, amax, scheme, methods)
        scaled_rows[name] = rows
        if number % 20 == 19:
            progress(f"  {number + 1}/{len(groups)} activations")
    if methods.low_rank:
        split_low_rank(model, options, scaled_rows, methods.low_rank, report)
    inits = {i.name: i for i in model.graph.initializer}
    for table in quantized_tables(model, options):  # a tied lm_head: its input range, the table's clipping
        st = stats.get(table.head_input) if table.head is not None and not options.table_weight_only else None
        if st is None:
            continue
        rows = st.rows
        report.act_amax[table.head_input] = activation_range(rows, st.amax, scheme, methods)
        if rows.size:
            w = numpy_helper.to_array(inits[table.name]).astype(np.float32).T
            _compensate(report, inits[table.name], w, rows, options.for_table(), methods)
    for act, readers in quantized_groups(model, options).items():  # on the final weights (after every fold)
        rows = scaled_rows.get(act)
        if rows is None or not rows.size:
            continue
        for _node, weight in readers:
            w = numpy_helper.to_array(inits[weight]).astype(np.float32)
            w = _compensate(report, inits[weight], w, rows, options, methods)
            if measure_errors:
                x = evenly(rows, methods.search_rows)
                amax = report.act_amax.get(act, float(np.abs(x).max()))
                xq = activation_fake_quant(x, options, amax)
                exact = x @ w
                got = xq @ weight_fake_quant(w, options, report.weight_clip.get(weight), report.weight_grid.get(weight))
                # medians over tokens: neither a few massive-activation tokens (huge outputs, they would hide
                # everyone else's error) nor near-zero outputs (huge relative error, no effect) decide
                typical = max(float(np.median(np.square(exact).sum(axis=1))), 1e-30)
                report.weight_error[weight] = float(np.median(np.square(exact - got).sum(axis=1)) / typical)
    return report


def _compensate(report: MethodReport, init: onnx.TensorProto, w: np.ndarray, rows: np.ndarray, options: QuantOptions,
                methods: MethodOptions) -> np.ndarray:
    """Clipping search, then GPTQ on W [K, N] (an embedding table's T^T); returns the weight the Q/DQ pass will
    quantize (GPTQ's compensated one, kept in the grid: the graph's fp32 weight stays for weights left unquantized)."""
    blockwise = options.scheme in ("int4", "nvfp4")
    clip = clip_search(w, np.square(evenly(rows, methods.search_rows)).mean(axis=0), options) if methods.clip and blockwise else None
    if clip is not None:
        report.weight_clip[init.name] = clip
    key = options.defaults_key
    if not methods.uses_gptq(key):
        return w
    block = nx.pick_block(w.shape[0], options.int4_block) if options.scheme == "int4" else options.fp4_block
    quantized, grid = gptq_weight(w, rows, options.scheme, block, clip, methods.damp(key), methods.act_order(key))
    before = float(np.square(rows @ (w - weight_fake_quant(w, options, clip))).sum())
    after = float(np.square(rows @ (w - quantized)).sum())
    report.gptq_error_ratio.append(after / before if before > 0 else 1.0)
    report.weight_grid[init.name] = grid
    return quantized
