"""The searches of the quantization methods, in numpy: fake quantization of weights and activations as the Q/DQ graph
computes them, AWQ input scales, SmoothQuant scales, clipping ratios, FP8 activation ranges and low-rank factors
(what each does and why: engines/methods.py, docs/quantization.md). They read one weight (or one activation's
calibration rows) and return numbers; nothing here touches a graph.
"""

from __future__ import annotations

import numpy as np

from . import numerics as nx
from .calibrate import ActivationStats
from .gptq import GridScales
from .qdq_targets import QuantOptions

AWQ_GRID = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 11))
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# NVFP4: E2M1's levels are not evenly spaced (..., 3, 4, 6), so a block can also fit better with its largest value
# on a lower level (ratio > 1, e.g. 1.5: the max on 4); steps of 1/16 reach every FP8 block scale in the range
NVFP4_RANGE_RATIOS = tuple(2.0 - i / 16 for i in range(21)) + (0.7,)
MSE_RATIOS = tuple(round(r, 3) for r in np.linspace(0.5, 1.0, 21))


# ---------------------------------------------------------------- fake quantization (numpy)

def weight_fake_quant(w: np.ndarray, options: QuantOptions, clip: np.ndarray | None = None,
                      grid: GridScales | None = None) -> np.ndarray:
    """W [K, N] as the Q/DQ graph of `options.scheme` will see it (float32; on `grid` when GPTQ chose one)."""
    if options.scheme == "fp8":
        q, scale = nx.quantize_fp8_per_channel(w, axis=1, scale=grid.scale if grid else None)
        return q.astype(np.float32) * scale
    if options.scheme == "int4":
        return nx.fake_quant_int4_blockwise(w, nx.pick_block(w.shape[0], options.int4_block), clip, grid.scale if grid else None)
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


# ---------------------------------------------------------------- searches

def product_error(x: np.ndarray, weights: list[np.ndarray], scale: np.ndarray, options: QuantOptions, amax: float,
                  exact: list[np.ndarray] | None = None) -> float:
    """sum_j ||x W_j - Qa(x / s) Qw(diag(s) W_j)||^2 on the calibration rows x (`exact`: the x W_j, when known)."""
    xq = activation_fake_quant(x / scale, options, amax)
    exact = exact if exact is not None else [x @ w for w in weights]
    return float(sum(np.square(e - xq @ weight_fake_quant(w * scale[:, None], options)).sum() for w, e in zip(weights, exact)))


def awq_search(stats: ActivationStats, weights: list[np.ndarray], options: QuantOptions, rows: int) -> tuple[np.ndarray, float, float]:
    """(s, alpha, error / error of plain RTN) minimizing `product_error` over s = mean|x|^alpha."""
    x = evenly(stats.rows, rows)
    mean_abs = np.maximum(np.abs(x).mean(axis=0), 1e-6)
    best = (np.ones_like(mean_abs), 0.0, None)
    base = None
    exact = [x @ w for w in weights]  # the same for every alpha
    for alpha in AWQ_GRID:
        s = np.power(mean_abs, alpha).astype(np.float32)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        amax = float((stats.channel_amax / s).max())
        err = product_error(x, weights, s, options, amax, exact)
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
            return _weighted_square_error(w, q, h).reshape(shape[0], block, shape[1]).sum(axis=1)
    else:
        block = options.fp4_block
        shape = (w.shape[1], w.shape[0] // block)

        def block_error(q: np.ndarray) -> np.ndarray:
            return _weighted_square_error(w, q, h).T.reshape(shape[0], shape[1], block).sum(axis=2)
    fake_quant = nvfp4_fake_quantizer(w, options.fp4_block) if options.scheme == "nvfp4" else (
        lambda clip: weight_fake_quant(w, options, clip))
    best_err = best = None
    for ratio in NVFP4_RANGE_RATIOS if options.scheme == "nvfp4" else CLIP_RATIOS:
        clip = np.full(shape, ratio, np.float32)
        err = block_error(fake_quant(clip))
        if best is None:
            best, best_err = clip, err
        else:
            better = err < best_err
            best = np.where(better, clip, best)
            best_err = np.where(better, err, best_err)
    return best


def nvfp4_fake_quantizer(w: np.ndarray, block: int):
    """clip -> `weight_fake_quant(w, nvfp4 options, clip)`, bit for bit, with what no ratio changes (W^T, the global
    scale, the blocks' amax) computed once."""
    w_t = np.ascontiguousarray(w.T)
    global_scale = nx.nvfp4_global_scale(float(np.abs(w_t).max()) if w_t.size else 0.0)
    block_amax = np.abs(w_t.reshape(*w_t.shape[:-1], -1, block)).max(axis=-1)

    def fake_quant(clip: np.ndarray) -> np.ndarray:
        codes, s8, s2 = nx.nvfp4_quantize(w_t, global_scale, block, clip=clip, block_amax=block_amax)
        return nx.nvfp4_dequantize(codes, s8, s2, block).T

    return fake_quant


def _weighted_square_error(w: np.ndarray, q: np.ndarray, h: np.ndarray) -> np.ndarray:
    """(w - q)^2 h[k] elementwise, computed in `q`'s array (a fresh fake-quantized weight)."""
    np.subtract(w, q, out=q)
    np.square(q, out=q)
    q *= h[:, None]
    return q


def low_rank_factors(w: np.ndarray, second_moment: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 A [K, r], B [r, N] with A B the best rank-r approximation of W [K, N] in the norm that weights
    input channel k by its calibration RMS (SVD of diag(d) W, d = sqrt(E[x_k^2]), then A = U S / d)."""
    d = np.sqrt(second_moment.astype(np.float64) + 0.01 * float(second_moment.mean()) + 1e-30)
    u, sv, vt = np.linalg.svd(d[:, None] * w.astype(np.float64), full_matrices=False)
    a = (u[:, :rank] * sv[:rank]) / d[:, None]
    return a.astype(np.float16), vt[:rank].astype(np.float16)
