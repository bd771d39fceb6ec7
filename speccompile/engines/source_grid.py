"""Weights that are already on a block grid: read the grid back instead of quantizing them again.

A model that was quantized before it reached the exporter (a GGUF file in Q4_0 / Q4_1 / Q8_0, a dequantized
GPTQ or AWQ checkpoint) has weights in which every block of B consecutive input channels of one output
column takes evenly spaced values, w = d c + m (d the block's step, c an integer code, m an offset). Quantizing
such a weight again with scales of our own moves nearly every value (SmolLM2's bundled GGUF is Q4_1: a fresh
INT4 build keeps 0.77 top-1 of it); storing the codes it already has loses nothing.

  * INT4 weights (W [K, N], blocks along K, B in 128 / 64 / 32 / 16, the largest that fits exactly): codes
    c in [-8, 7] and the step d as the DequantizeLinear scale. A grid whose codes do not sit symmetrically
    around zero (Q4_1, asymmetric GPTQ: w = d q + m with q in 0..15) also has an offset o = m + 8 d per block
    and column: W = DQ(c) + E O with E [K, K/B] the 0/1 matrix that sums each block's inputs and O [K/B, N]
    the offsets, so the MatMul becomes x DQ(c) + (x E) O, a small float16 side branch (TensorRT's
    DequantizeLinear takes no non-zero zero point, ONNX's takes integers only).
  * INT8 MatMul weights of an INT8 build (blocks along K) and INT8 embedding tables (T [V, H], blocks along H):
    symmetric codes in [-127, 127] with one step per block, stored as a blocked INT8 DequantizeLinear. Q8_0's step
    is the block's largest magnitude / 127; Q5_0's (codes -16..15), Q6_K's (-32..31 on blocks of 16), Q4_0's and
    Q3_K's are the greatest common step of the block's values: 8-bit codes hold them exactly. Grids with an
    offset (Q4_1, Q4_K, Q5_1, Q5_K) an INT8 build requantizes to 8 bits, within 1/254 of a block's largest
    magnitude: kept at 4 bits they would need the offset branch, which costs a packed CPU pass more than the
    8-bit kernel does (docs/cpu.md, Limits).

A weight counts as on a grid when every value is within GRID_TOLERANCE of its block's range of d c + m; the
tolerance is float32 rounding, far below any quantization step, so an ordinary float weight never passes.
The grid is returned as `GridScales` (block, scale, the weight minus its offsets, the offsets), which the
Q/DQ pass stores exactly as GPTQ's grids are stored.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from .gptq import GridScales
from .qdq_targets import QuantOptions, is_excluded, quantized_tables, weight_matmuls

GRID_TOLERANCE = 1e-5  # of the block's largest magnitude (float32 weights; float16 ones: their own epsilon)
INT4_GRID_BLOCKS = (128, 64, 32, 16)
INT8_GRID_BLOCKS = (128, 64, 32, 16)
INT4_LEVELS = 15  # codes 0..15 before centering to [-8, 7]
INT8_MAX = 127
EUCLID_ROUNDS = 4
CHUNK_VALUES = 1 << 22  # values an INT8 grid test reads at a time (32 MB as float64, whatever the table's width)


def _relative_tolerance(dtype: np.dtype) -> float:
    """How far (relative to its block's largest magnitude) a stored value may sit from its grid point: the
    rounding of the weight's own float type (a float16 export rounds d q + m to float16)."""
    return max(GRID_TOLERANCE, 4 * float(np.finfo(dtype).eps)) if np.issubdtype(dtype, np.floating) else GRID_TOLERANCE


def _fits(blocks: np.ndarray, step: np.ndarray, base: np.ndarray, low: int, high: int, tolerance: float) -> np.ndarray:
    """[G, N]: whether each block of `blocks` [G, B, N] is base + step c with integer c in [low, high]."""
    codes = np.rint((blocks - base[:, None, :]) / step[:, None, :])
    bound = tolerance * np.abs(blocks).max(axis=1, keepdims=True) + 1e-30
    close = np.abs(codes * step[:, None, :] + base[:, None, :] - blocks) <= bound
    return close.all(axis=1) & (codes.min(axis=1) >= low) & (codes.max(axis=1) <= high)


def _int4_steps(blocks: np.ndarray, tolerance: float) -> np.ndarray | None:
    """The step d [G, N] of blocks [G, B, N] = d q + min with q integer in 0..15, or None when some block is not."""
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    full = (hi - lo) / INT4_LEVELS  # codes that span 0..15 (Q4_1, min/max asymmetric quantizers)
    full = np.where(full > 0, full, 1.0)
    ok = _fits(blocks, full, lo, 0, INT4_LEVELS, tolerance)
    if ok.all():
        return full
    gaps = np.diff(np.sort(blocks, axis=1), axis=1)  # codes that use fewer levels: the smallest gap is the step
    gaps = np.where(gaps > 2 * tolerance * np.abs(blocks).max(axis=1, keepdims=True), gaps, np.inf).min(axis=1)
    gaps = np.where(np.isfinite(gaps), gaps, 1.0)
    ok_gaps = _fits(blocks, gaps, lo, 0, INT4_LEVELS, tolerance)
    if not (ok | ok_gaps).all():
        return None
    return np.where(ok, full, gaps)


def _first_block_fits(w: np.ndarray, tolerance: float) -> bool:
    """Whether the first block of the first few columns of W [K, N] is on an INT4 grid of some block size: every
    (block, column) is checked on its own, so a weight failing here fails the whole check (read: a few KB)."""
    k, n = w.shape
    for block in INT4_GRID_BLOCKS:
        if k % block == 0:
            corner = np.asarray(w[:block, : min(n, 8)], dtype=np.float64)
            if _int4_steps(corner.reshape(1, block, -1), tolerance) is not None:
                return True
    return False


def find_int4_grid(w: np.ndarray) -> GridScales | None:
    """The INT4 grid W [K, N] is on (blocks along K), or None. `offset` is None where no block needs one."""
    tolerance = _relative_tolerance(np.asarray(w).dtype)
    if not _first_block_fits(w, tolerance):
        return None
    w64 = np.asarray(w, dtype=np.float64)
    k, n = w64.shape
    for block in INT4_GRID_BLOCKS:
        if k % block:
            continue
        blocks = w64.reshape(k // block, block, n)
        if _int4_steps(blocks[:, :, : min(n, 8)], tolerance) is None:  # cheap rejection on a few columns
            continue
        step = _int4_steps(blocks, tolerance)
        if step is None:
            continue
        zero = np.zeros_like(step)
        if _fits(blocks, step, zero, -8, 7, tolerance).all():  # symmetric (Q4_0, symmetric GPTQ / AWQ)
            offset = None
        else:
            offset = blocks.min(axis=1) + 8.0 * step  # codes q in 0..15 become c = q - 8 in [-8, 7]
        codes = np.rint((blocks - (zero if offset is None else offset)[:, None, :]) / step[:, None, :])
        return GridScales(scale=step.astype(np.float32), weight=(codes * step[:, None, :]).reshape(k, n).astype(np.float32),
                          block=block, offset=None if offset is None else offset.astype(np.float32))
    return None


def _int8_steps(blocks: np.ndarray, tolerance: float) -> np.ndarray | None:
    """The step d [G, N] of blocks [G, B, N] = d c with integer c in [-127, 127], or None when some block is not:
    the block's largest magnitude / 127 where that fits (Q8_0), else the greatest common step of its values
    (Q5_0, Q6_K), found from the smallest gap between them as Euclid would, in floats."""
    amax = np.abs(blocks).max(axis=1)
    noise = 2 * tolerance * amax[:, None, :] + 1e-30
    zero = np.zeros_like(amax)
    step = np.where(amax > 0, amax / INT8_MAX, 1.0)
    ok = _fits(blocks, step, zero, -INT8_MAX, INT8_MAX, tolerance)
    if ok.all():
        return step
    gaps = np.diff(np.sort(blocks, axis=1), axis=1)
    common = np.where(gaps > noise, gaps, np.inf).min(axis=1)
    common = np.where(np.isfinite(common), common, 1.0)
    for _ in range(EUCLID_ROUNDS):  # a gap of 2 or 3 steps leaves remainders of one step
        remainders = np.abs(blocks - common[:, None, :] * np.rint(blocks / common[:, None, :]))
        smallest = np.where(remainders > noise, remainders, np.inf).min(axis=1)
        common = np.where(smallest < common, smallest, common)
    fits = _fits(blocks, common, zero, -INT8_MAX, INT8_MAX, tolerance)
    return np.where(ok, step, common) if (ok | fits).all() else None


def find_int8_table_grid(t: np.ndarray) -> GridScales | None:
    """The symmetric INT8 grid of an embedding table T [V, H] with blocks along H (Q8_0, Q5_0, Q6_K), or None.

    Returned in the lm_head's weight layout (as the table's other grids): scale [H/B, V], weight T^T [H, V]. Read
    about CHUNK_VALUES values at a time, so the float64 copies stay small for a large vocabulary."""
    tolerance = _relative_tolerance(np.asarray(t).dtype)
    v, h = t.shape
    for block in INT8_GRID_BLOCKS:  # each (row, block) is checked on its own: the first rows are a cheap rejection
        if h % block or _int8_steps(_column_blocks(t[: min(v, 8)], block), tolerance) is None:
            continue
        scale, weight = np.empty((h // block, v), np.float32), np.empty((h, v), np.float32)
        chunk = max(1, CHUNK_VALUES // h)
        for start in range(0, v, chunk):
            blocks = _column_blocks(t[start : start + chunk], block)
            step = _int8_steps(blocks, tolerance)
            if step is None:
                break
            scale[:, start : start + chunk] = step
            weight[:, start : start + chunk] = (np.rint(blocks / step[:, None, :]) * step[:, None, :]).reshape(h, -1)
        else:
            return GridScales(scale=scale, weight=weight, block=block)
    return None


def _column_blocks(rows: np.ndarray, block: int) -> np.ndarray:
    """Rows [R, H] of a table as float64 blocks [H / block, block, R] (blocks along H)."""
    return np.asarray(rows, dtype=np.float64).T.reshape(rows.shape[1] // block, block, len(rows))


def find_int8_grid(w: np.ndarray) -> GridScales | None:
    """The symmetric INT8 block grid a MatMul weight W [K, N] is on (blocks along K: Q8_0, Q5_0, Q6_K, Q4_0,
    Q3_K), or None."""
    return find_int8_table_grid(np.asarray(w).T)  # the table test reads T [V, H] as T^T [H, V], blocks along axis 0


MATMUL_GRIDS = {"int4": find_int4_grid, "int8": find_int8_grid}  # the scheme -> its MatMul weights' grid test


def grid_candidates(model: onnx.ModelProto, options: QuantOptions) -> dict[str, bool]:
    """The weights whose source grid the pass would keep -> whether each is an embedding table: INT4 MatMul weights
    of an INT4 build, INT8 ones (Q8_0) of an INT8 build, and embedding tables stored INT8 (`--table-format int8`)."""
    found: dict[str, bool] = {}
    if options.scheme in MATMUL_GRIDS:
        for _index, _act, weight in weight_matmuls(model):
            if not is_excluded(weight, options.exclude):
                found.setdefault(weight, False)
    if options.table_format == "int8":
        for table in quantized_tables(model, options):
            found[table.name] = True
    return found


def find_source_grid(value: np.ndarray, table: bool, scheme: str) -> GridScales | None:
    """The grid a MatMul weight [K, N] (INT4 or INT8, `scheme`'s) or an embedding table [V, H] (INT8, Q8_0) is on,
    or None."""
    return find_int8_table_grid(value) if table else MATMUL_GRIDS[scheme](value)


def source_grids(model: onnx.ModelProto, options: QuantOptions,
                 read: Callable[[str], np.ndarray] | None = None) -> dict[str, GridScales]:
    """weight (or embedding table) -> the grid it is already on, for the `grid_candidates`; `read(name)` gives an
    initializer's value (default: from the loaded model)."""
    inits = {i.name: i for i in model.graph.initializer}
    read = read or (lambda name: numpy_helper.to_array(inits[name]))
    grids: dict[str, GridScales] = {}
    for name, table in grid_candidates(model, options).items():
        grid = find_source_grid(read(name), table, options.scheme)
        if grid is not None:
            grids[name] = grid
    return grids
