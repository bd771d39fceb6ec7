"""Logits processing and sampling one token (pure numpy, no torch).

``p`` is always the *processed* target distribution (output of :func:`process_logits`). Ties in argmax,
top-k and top-p are broken towards the lowest token id (like ``np.argmax``), so processing is a
deterministic function of the logits. The exact verification rules that use it are in verification.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from speccompile.errors import InputError

# First guess of how many candidates top-p needs; grown geometrically when a row needs more.
_TOP_P_FIRST_CANDIDATES = 1024


# --------------------------------------------------------------------------------------------
# Sampling parameters
# --------------------------------------------------------------------------------------------

DRAFTER_STREAM = 1  # the spawn key of a seed's drafter stream (`SamplingParams.drafter_rng`)


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is processed: temperature -> min-p -> top-k -> top-p -> softmax.

    ``temperature == 0`` means greedy (argmax). ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable
    the respective filters. ``seed`` seeds the runtime's random generator. ``min_p`` (vLLM's): keep the
    tokens whose probability is at least ``min_p`` times the most likely one's (after the temperature).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0

    def validate(self) -> "SamplingParams":
        """Raise :class:`InputError` (naming the field) for out-of-range values; return self."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_real(t) or not t >= 0 or math.isinf(t):
            raise InputError(f"temperature must be >= 0, got {_fmt(t)}", "temperature")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise InputError(f"top_k must be >= 0, got {_fmt(k)}", "top_k")
        if not _is_real(p) or not 0 < p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {_fmt(p)}", "top_p")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1], got {_fmt(self.min_p)}", "min_p")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0
        ):
            raise InputError(f"seed must be a non-negative integer, got {_fmt(self.seed)}", "seed")
        return self

    def rng(self) -> np.random.Generator:
        """A generator seeded from ``seed`` (fresh entropy when ``seed`` is None)."""
        return np.random.default_rng(self.seed)

    def drafter_rng(self) -> np.random.Generator:
        """A drafter's generator for one generation: seeded from ``seed`` too, on a stream independent of
        ``rng()``'s (fresh entropy when ``seed`` is None). Made anew for every generation (`Drafter.start`)."""
        if self.seed is None:
            return np.random.default_rng()
        return np.random.default_rng(np.random.SeedSequence(int(self.seed), spawn_key=(DRAFTER_STREAM,)))


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _fmt(x: object) -> str:
    """Format a flag value compactly: -1.0 -> '-1', 0.25 -> '0.25'."""
    if _is_real(x):
        return f"{float(x):g}" if isinstance(x, (float, np.floating)) else str(x)
    return repr(x)


# --------------------------------------------------------------------------------------------
# Logits processing
# --------------------------------------------------------------------------------------------


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Turn logits [V] or [N, V] into float64 probabilities of the same shape.

    Greedy gives a one-hot at the argmax. Otherwise: divide by the temperature, keep the
    ``top_k`` largest logits, softmax, drop tokens under ``min_p`` times the largest probability, keep the smallest set of most probable tokens whose
    mass reaches ``top_p`` (at least one), renormalise. Ties in argmax/top-k/top-p go to the
    lowest token id. Top-k is selected on the logits as given (dividing by a positive
    temperature preserves their order), and then only k exponentials are computed.
    """
    params.validate()
    x = np.asarray(logits)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape [V] or [N, V] with V > 0, got {x.shape}")
    rows = x.reshape(-1, x.shape[-1])
    if not np.issubdtype(rows.dtype, np.floating):
        rows = rows.astype(np.float64)
    if params.greedy:
        out = _one_hot_argmax(rows)
    elif 0 < params.top_k < rows.shape[1]:
        out = _process_top_k(rows, params)
    else:
        z = np.divide(rows, float(params.temperature), dtype=np.float64)  # a fresh float64 array
        weights = _min_p_(_exp_shifted_(z), params.min_p)
        out = _nucleus(weights, float(params.top_p)) if params.top_p < 1 else _normalise_(weights)
    return out.reshape(x.shape)


def _one_hot_argmax(rows: np.ndarray) -> np.ndarray:
    out = np.zeros(rows.shape, dtype=np.float64)
    out[np.arange(rows.shape[0]), np.argmax(rows, axis=1)] = 1.0
    return out


def _exp_shifted_(z: np.ndarray) -> np.ndarray:
    """exp(z - rowmax(z)) in place on float64 ``z`` (-inf entries become exactly 0)."""
    top = z.max(axis=1, keepdims=True)
    if not np.all(np.isfinite(top)):
        raise ValueError("every logits row needs a finite maximum (got NaN, +inf or all -inf)")
    z -= top
    np.exp(z, out=z)
    return z


def _min_p_(w: np.ndarray, min_p: float) -> np.ndarray:
    """Min-p in place on weights whose row maximum is 1 (`_exp_shifted_`): a weight is its probability over the
    largest one's, so the tokens under `min_p` are zeroed (the largest always stays)."""
    if min_p > 0:
        w[w < min_p] = 0.0
    return w


def _normalise_(w: np.ndarray) -> np.ndarray:
    w /= w.sum(axis=1, keepdims=True)
    return w


def _process_top_k(rows: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Top-k (then optional top-p) on the k selected entries only; scattered back to [N, V]."""
    idx = _top_k_indices(rows, int(params.top_k))
    z = np.take_along_axis(rows, idx, axis=1).astype(np.float64) / float(params.temperature)
    weights = _min_p_(_exp_shifted_(z), params.min_p)
    small = _nucleus(weights, float(params.top_p)) if params.top_p < 1 else _normalise_(weights)
    out = np.zeros(rows.shape, dtype=np.float64)
    np.put_along_axis(out, idx, small, axis=1)
    return out


def _top_k_indices(rows: np.ndarray, k: int) -> np.ndarray:
    """Token ids of the k largest entries of each row, ascending: [N, k].

    ``argpartition`` picks arbitrarily among entries tied with the k-th largest value; rows
    where that matters are redone so the lowest ids win.
    """
    v = rows.shape[1]
    idx = np.argpartition(rows, v - k, axis=1)[:, v - k :]
    vals = np.take_along_axis(rows, idx, axis=1)
    kth = vals.min(axis=1)
    ties_in = (vals == kth[:, None]).sum(axis=1)
    ties_all = (rows == kth[:, None]).sum(axis=1)
    for r in np.flatnonzero(ties_in != ties_all):
        keep = _keep_largest(rows[r : r + 1], kth[r : r + 1], np.array([k]))[0]
        idx[r] = np.flatnonzero(keep)
    return np.sort(idx, axis=1)


def _keep_largest(x: np.ndarray, threshold: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Mask of the ``count[r]`` largest entries per row, given the count-th largest value.

    Entries strictly above ``threshold`` are kept; entries equal to it fill the remaining
    slots in order of increasing index.
    """
    thr = threshold[:, None]
    above = x > thr
    ties = x == thr
    slots = count - above.sum(axis=1)
    if np.array_equal(ties.sum(axis=1), slots):  # common case: no tie straddles the cut
        return above | ties
    return above | (ties & (np.cumsum(ties, axis=1) <= slots[:, None]))


def _nucleus(w: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p on non-negative weights [N, W] (any scale); returns normalised [N, W].

    Keeps, per row, the smallest set of largest entries whose share of the row mass reaches
    ``top_p`` (ties broken towards the lower index). Only the head of each row is sorted:
    ``m`` candidates first, more only while some row's cut is not provably among them.
    """
    width = w.shape[1]
    total = w.sum(axis=1)
    m = min(width, _TOP_P_FIRST_CANDIDATES)
    while m < width:
        out = _nucleus_in_head(w, total, top_p, m)
        if out is not None:
            return out
        m = m * 8 if m * 8 <= width // 2 else width
    return _nucleus_full(w, total, top_p)


def _nucleus_in_head(w: np.ndarray, total: np.ndarray, top_p: float, m: int) -> np.ndarray | None:
    """Top-p using only the m largest entries per row; None if some row's cut may lie outside."""
    n_rows, width = w.shape
    idx = np.sort(np.argpartition(w, width - m, axis=1)[:, width - m :], axis=1)
    head = np.take_along_axis(w, idx, axis=1) / total[:, None]
    order = np.argsort(-head, axis=1, kind="stable")  # decreasing share; ties -> lower index
    head = np.take_along_axis(head, order, axis=1)
    count = (np.cumsum(head, axis=1) < top_p).sum(axis=1) + 1
    # The cut must be strictly above the smallest candidate: then no entry outside the
    # candidates can tie with it or belong to the nucleus.
    if np.any(count >= m) or not np.all(head[np.arange(n_rows), count - 1] > head[:, -1]):
        return None
    kept = np.where(np.arange(m)[None, :] < count[:, None], head, 0.0)
    kept /= kept.sum(axis=1, keepdims=True)
    out = np.zeros(w.shape, dtype=np.float64)
    np.put_along_axis(out, np.take_along_axis(idx, order, axis=1), kept, axis=1)
    return out


def _nucleus_full(w: np.ndarray, total: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p by sorting whole rows (values only) and masking at the cut value."""
    n_rows, width = w.shape
    head = -np.sort(-w, axis=1)
    count = np.minimum((np.cumsum(head / total[:, None], axis=1) < top_p).sum(axis=1) + 1, width)
    keep = _keep_largest(w, head[np.arange(n_rows), count - 1], count)
    out = np.where(keep, w, 0.0)
    out /= out.sum(axis=1, keepdims=True)
    return out


# --------------------------------------------------------------------------------------------
# Sampling one token
# --------------------------------------------------------------------------------------------


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from ``probs`` [V] (need not be normalised) by inverse CDF.

    Uses exactly one uniform draw. Never returns a zero-probability token, even when float
    rounding pushes the scaled uniform onto the last CDF value.
    """
    if type(probs) is not np.ndarray:
        probs = np.asarray(probs)
    cdf = probs.cumsum()
    total = cdf[-1]
    if not total > 0:
        raise ValueError("cannot sample from a distribution with zero total mass")
    # side='right' finds i with cdf[i-1] <= u < cdf[i], so probs[i] > 0 whenever i < V.
    i = int(cdf.searchsorted(rng.random() * total, side="right"))
    if i == len(cdf) or not probs[i] > 0:
        i = int(np.flatnonzero(probs > 0)[-1])
    return i
