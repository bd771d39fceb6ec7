"""GPTQ-style error compensation for quantized weights (INT4, NVFP4 blocks; FP8 per channel), in numpy.

For a MatMul x W (W [K, N], K = input channels) and calibration rows X [T, K], the rows of W are quantized
one input channel at a time, in order; the rounding error of row k is spread over the rows not yet
quantized so that X W changes as little as possible (the optimal-brain-surgeon update with the inverse of
H = X^T X / T + damping, applied through the upper Cholesky factor U of H^-1, Hinv = U^T U, as GPTQ does):

    e = (w_k - q(w_k)) / U[k, k];   w_j <- w_j - U[k, j] e   for j > k

with the update to later batches of rows applied lazily as one matrix product. Quantization groups are
the blocks TensorRT needs along K (INT4: the block size; NVFP4: 16; FP8: all of K): a group's scale is set from the
group's current rows (times its clipping ratio) when its first row comes up, then fixed. The result is
the compensated weight on the quantization grid plus the scales (`GridScales`) that the Q/DQ pass stores
unchanged, so re-quantizing it gives back exactly the same codes.

Activation order (`act_order`, as GPTQ's "desc_act" with static groups): the rows are quantized in the
order of decreasing H diagonal (the input channels with the most calibration energy first, while the
most rows are left to absorb their error), and every group's scale is fixed up front from the original
rows, so the groups stay the contiguous blocks along K that TensorRT reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import numerics as nx

# fraction of the mean diagonal of H added to it, per scheme (measured on SmolLM2: docs/quantization.md); keys are
# `QuantOptions.defaults_key`: the scheme, or "<scheme>-weight-only" for a weight-only FP8 / NVFP4 build
DEFAULT_DAMP = {"fp8": 0.1, "int4": 3.0, "nvfp4": 3.0, "fp8-weight-only": 0.1, "nvfp4-weight-only": 3.0}
# on by default where it measured better on SmolLM2 held-out text (docs/quantization.md); --gptq / --no-gptq
GPTQ_DEFAULT = {"fp8": True, "int4": True, "nvfp4": False, "fp8-weight-only": True, "nvfp4-weight-only": True}
# activation order where it measured better on SmolLM2 held-out text (docs/quantization.md); --gptq-act-order
ACT_ORDER_DEFAULT = {"fp8": False, "int4": True, "nvfp4": False, "fp8-weight-only": False, "nvfp4-weight-only": True}
LAZY_ROWS = 128
IN_PLACE_FROM = 4096  # K above which the inverse-Hessian factor is computed in place (inverse_hessian_factor)
FACTOR_BLOCK = 512


@dataclass
class GridScales:
    """The scales that fix a weight's quantization grid (INT4 [K/B, N] float32; NVFP4 fp8 [N, K/16] + global;
    FP8 [N] float32),
    and the compensated weight [K, N] on that grid that the Q/DQ pass stores instead of the original.

    A grid read back from the weights themselves (engines/source_grid.py) also fixes the block size along K
    (`block`, else the build's) and may carry per-block offsets [K/B, N] (`offset`: the original weight is
    `weight` plus each block's offset, added by a side branch)."""

    scale: np.ndarray
    global_scale: np.float32 | None = None
    weight: np.ndarray | None = None
    block: int | None = None
    offset: np.ndarray | None = None


class GroupQuantizer(Protocol):
    """Rounds the rows of one weight; `start` fixes the scales of the group whose first row comes next."""

    group: int

    def start(self, index: int, rows: np.ndarray) -> None: ...

    def use(self, index: int) -> None:
        """Round with the scale `start` fixed for group `index` (activation order visits groups out of turn)."""

    def round(self, row: np.ndarray) -> np.ndarray: ...

    def grid(self) -> GridScales | None: ...


class Int4Rows:
    """Symmetric INT4, scale = clip * block amax / 7 per (block along K, output channel)."""

    def __init__(self, k: int, n: int, block: int, clip: np.ndarray | None):
        self.group, self.clip = block, clip
        self.scales = np.ones((k // block, n), np.float32)
        self.current = self.scales[0]

    def start(self, index: int, rows: np.ndarray) -> None:
        amax = np.abs(rows).max(axis=0).astype(np.float32)
        if self.clip is not None:
            amax = (amax * self.clip[index]).astype(np.float32)
        self.scales[index] = self.current = nx.safe_scale(amax, nx.INT4_MAX)

    def use(self, index: int) -> None:
        self.current = self.scales[index]

    def round(self, row: np.ndarray) -> np.ndarray:
        q = np.clip(np.rint(row.astype(np.float32) / self.current), -8, 7)
        return (q * self.current).astype(np.float32)

    def grid(self) -> GridScales:
        return GridScales(self.scales)


class Nvfp4Rows:
    """NVFP4 on W^T: E2M1 values, an FP8 scale per (output channel, block of 16 along K), a fixed global scale."""

    def __init__(self, k: int, n: int, block: int, clip: np.ndarray | None, global_scale: np.float32):
        self.group, self.clip, self.global_scale = block, clip, np.float32(global_scale)
        self.scales = nx.to_fp8(np.zeros((n, k // block), np.float32))
        self.effective = np.ones(n, np.float32)

    def start(self, index: int, rows: np.ndarray) -> None:
        amax = np.abs(rows).max(axis=0).astype(np.float32)
        if self.clip is not None:
            amax = (amax * self.clip[:, index]).astype(np.float32)
        self.scales[:, index] = nx.to_fp8(amax / np.float32(nx.FP4_MAX) / self.global_scale)
        self.use(index)

    def use(self, index: int) -> None:
        self.effective = (self.scales[:, index].astype(np.float32) * self.global_scale).astype(np.float32)

    def round(self, row: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            scaled = np.where(self.effective > 0, row.astype(np.float32) / self.effective, 0.0).astype(np.float32)
        return (nx.e2m1_decode(nx.e2m1_codes(scaled)) * self.effective).astype(np.float32)

    def grid(self) -> GridScales:
        return GridScales(self.scales, self.global_scale)


class Fp8Rows:
    """FP8 E4M3 with one scale per output channel (the column amax / 448, set once from the uncompensated W)."""

    def __init__(self, k: int, n: int):
        self.group = k
        self.scale = np.ones(n, np.float32)

    def start(self, index: int, rows: np.ndarray) -> None:
        self.scale = nx.safe_scale(np.abs(rows).max(axis=0), nx.FP8_MAX)

    def use(self, index: int) -> None:
        pass  # one group

    def round(self, row: np.ndarray) -> np.ndarray:
        return (nx.to_fp8(row.astype(np.float32) / self.scale).astype(np.float32) * self.scale).astype(np.float32)

    def grid(self) -> GridScales:
        return GridScales(self.scale)


def hessian(x: np.ndarray) -> np.ndarray:
    """H = X^T X / T (float64 [K, K]) of the calibration rows X [T, K]."""
    x = np.asarray(x, np.float64)
    return x.T @ x / max(len(x), 1)


def inverse_hessian_factor(h: np.ndarray, damp: float, overwrite: bool = False) -> np.ndarray:
    """Upper Cholesky factor U of (H + damp * mean diag * I)^-1 (float32 [K, K]); `overwrite`: `h` (float64) may
    be used as working memory.

    Up to K = IN_PLACE_FROM through the inverse (numpy's inv takes about four more K x K float64 arrays); above,
    in place (`factor_in_place`), which agrees with it to float64 rounding (bit for bit in float32 on the matrices
    tests/test_quant_gptq.py tries; an 8B model's K = 14336: 1.6 GB per array)."""
    h = h if overwrite and h.dtype == np.float64 else np.array(h, np.float64, copy=True)
    diag = np.diag(h).copy()
    dead = diag <= 0
    h[dead, dead] = 1.0  # a channel calibration never saw: its row is rounded without compensation
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diag(h)))
    if len(h) > IN_PLACE_FROM:
        return factor_in_place(h)
    inverse = np.linalg.inv(h)
    del h
    return np.linalg.cholesky((inverse + inverse.T) / 2).T.astype(np.float32)


def factor_in_place(h: np.ndarray, block: int = FACTOR_BLOCK) -> np.ndarray:
    """Upper Cholesky factor U of H^-1 (float32) with `h` (symmetric positive definite float64) as the only K x K
    working array: with P the order reversal, P H P = L L^T (lower Cholesky), then H^-1 = (P L^-1 P)^T (P L^-1 P)
    and P L^-1 P is upper triangular with a positive diagonal: it is U. `h` is reversed in place, both steps run
    on it a block of rows at a time, and it is reversed back: U is its upper triangle."""
    _reverse_in_place(h)
    _cholesky_lower_in_place(h, block)
    _invert_lower_in_place(h, block)
    _reverse_in_place(h)
    for row in range(1, len(h)):  # clear what lies below U
        h[row, :row] = 0.0
    return h.astype(np.float32)


def _reverse_in_place(a: np.ndarray) -> None:
    """a <- P a P (rows and columns in reverse order), one row of extra memory at a time."""
    n = len(a)
    for i in range(n // 2):
        top = a[i, ::-1].copy()
        a[i] = a[n - 1 - i, ::-1]
        a[n - 1 - i] = top
    if n % 2:
        a[n // 2] = a[n // 2, ::-1].copy()


def _cholesky_lower_in_place(a: np.ndarray, block: int) -> None:
    """Blocked right-looking Cholesky: the lower triangle of `a` becomes L (a = L L^T); the upper one is left stale."""
    n = len(a)
    for j in range(0, n, block):
        e = min(j + block, n)
        a[j:e, j:e] = np.linalg.cholesky(a[j:e, j:e])
        if e == n:
            return
        a[e:, j:e] = a[e:, j:e] @ np.linalg.inv(a[j:e, j:e]).T  # L21 = A21 L11^-T
        for i in range(e, n, block):  # trailing update of the lower block rows: A22 -= L21 L21^T
            i2 = min(i + block, n)
            a[i:i2, e:i2] -= a[i:i2, j:e] @ a[e:i2, j:e].T


def _invert_lower_in_place(a: np.ndarray, block: int) -> None:
    """The lower triangle of `a` (lower triangular L) becomes L^-1, a block column at a time from the left, each from
    the top: X_jj = L_jj^-1, X_ij = -L_ii^-1 (sum over j <= k < i of L_ik X_kj), every L_ik read before it is replaced."""
    n = len(a)
    starts = list(range(0, n, block))
    diagonal = {i: np.linalg.inv(a[i:min(i + block, n), i:min(i + block, n)]) for i in starts}
    for j in starts:
        e = min(j + block, n)
        a[j:e, j:e] = np.tril(diagonal[j])
        for i in (i for i in starts if i > j):
            i2 = min(i + block, n)
            a[i:i2, j:e] = -diagonal[i] @ (a[i:i2, j:i] @ a[j:i, j:e])


def permute_symmetric(h: np.ndarray, order: np.ndarray) -> None:
    """h <- h[np.ix_(order, order)], in place (one row or column of extra memory): rows, then columns, moved along
    the permutation's cycles."""
    for a in (h, h.T):
        done = np.zeros(len(order), bool)
        for start in range(len(order)):
            if done[start] or order[start] == start:
                continue
            saved = a[start].copy()
            i = start
            while order[i] != start:
                a[i] = a[order[i]]
                done[i] = True
                i = order[i]
            a[i] = saved
            done[i] = True


def gptq_rows(w: np.ndarray, factor: np.ndarray, quantizer: GroupQuantizer, lazy: int = LAZY_ROWS,
              groups: np.ndarray | None = None) -> np.ndarray:
    """W [K, N] quantized row by row with the error compensation; returns the quantized weight (float32).

    `groups`: each row's group when the quantizer's scales were fixed beforehand (activation order: the rows
    come permuted); None: contiguous groups, each scale set when its first row comes up."""
    w = np.array(w, dtype=np.float32, copy=True)
    k = w.shape[0]
    group = quantizer.group
    # a group's scale is set at its first row, which must have every earlier row's update by then: groups
    # start at batch starts (batches a multiple of the group), unless one group spans every row (starts at 0)
    if group < k and groups is None:
        lazy = max(group, lazy // group * group)
    out = np.empty_like(w)
    for begin in range(0, k, lazy):
        end = min(begin + lazy, k)
        errors = np.zeros((end - begin, w.shape[1]), np.float32)
        for i in range(begin, end):
            if groups is not None:
                quantizer.use(int(groups[i]))
            elif i % group == 0:
                quantizer.start(i // group, w[i: i + group])
            q = quantizer.round(w[i])
            out[i] = q
            err = (w[i] - q) / factor[i, i]
            w[i + 1: end] -= np.outer(factor[i, i + 1: end], err)
            errors[i - begin] = err
        w[end:] -= factor[begin:end, end:].T @ errors
    return out


def gptq_weight(w: np.ndarray, x: np.ndarray, scheme: str, block: int, clip: np.ndarray | None = None,
                damp: float | None = None, act_order: bool = False) -> tuple[np.ndarray, GridScales]:
    """(compensated quantized W, its grid) for `scheme` "int4" (`block` along K), "nvfp4" (blocks of `block`) or "fp8"
    (per output channel; `block` and `clip` unused); `act_order`: rows in decreasing H diagonal, static groups."""
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if scheme == "fp8":
        quantizer: GroupQuantizer = Fp8Rows(k, n)
    elif scheme == "int4":
        quantizer = Int4Rows(k, n, block, clip)
    elif scheme == "nvfp4":
        quantizer = Nvfp4Rows(k, n, block, clip, nx.nvfp4_global_scale(float(np.abs(w).max())))
    else:
        raise ValueError(f"GPTQ: no blockwise grid for scheme {scheme!r}")
    damp = DEFAULT_DAMP[scheme] if damp is None else damp
    h = hessian(x)  # the one K x K array (the factor is computed in it)
    if act_order:
        for index in range(0, k, quantizer.group):  # static groups: every scale from the original rows
            quantizer.start(index // quantizer.group, w[index: index + quantizer.group])
        order = np.argsort(-np.diag(h), kind="stable")
        permute_symmetric(h, order)
        factor = inverse_hessian_factor(h, damp, overwrite=True)
        del h
        permuted = gptq_rows(w[order], factor, quantizer, groups=order // quantizer.group)
        quantized = np.empty_like(permuted)
        quantized[order] = permuted
    else:
        factor = inverse_hessian_factor(h, damp, overwrite=True)
        del h
        quantized = gptq_rows(w, factor, quantizer)
    grid = quantizer.grid()
    grid.weight = quantized
    return quantized, grid
