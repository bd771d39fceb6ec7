"""Logits processing and exact speculative verification (pure numpy, no torch).

The invariant (docs/DESIGN.md, "Exact speculative sampling"): whatever the drafter proposes, the
emitted tokens are distributed exactly as if sampled from the processed target distribution p
(token-identical to argmax decoding when greedy).

Conventions used throughout:

* ``p`` is always the *processed* target distribution (output of :func:`process_logits`).
* ``q`` is the distribution a draft token was *actually* drawn from. A deterministic drafter
  (n-gram, argmax heads, top-k tree children) has a one-hot ``q``.
* Ties in argmax, top-k and top-p are broken towards the lowest token id (like ``np.argmax``),
  so processing is a deterministic function of the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Sequence

import numpy as np

from speccompile.errors import InputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from speccompile.runtime.tree import TreeSpec

TreeMode = Literal["deterministic", "iid", "iid_without_replacement"]
TREE_MODES: tuple[str, ...] = ("deterministic", "iid", "iid_without_replacement")

# First guess of how many candidates top-p needs; grown geometrically when a row needs more.
_TOP_P_FIRST_CANDIDATES = 1024


# --------------------------------------------------------------------------------------------
# Sampling parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is processed: temperature -> top-k -> top-p -> softmax.

    ``temperature == 0`` means greedy (argmax). ``top_k == 0`` and ``top_p == 1`` disable
    the respective filters. ``seed`` seeds the runtime's random generator.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0

    def validate(self) -> "SamplingParams":
        """Raise :class:`InputError` (naming the CLI flag) for out-of-range values; return self."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_real(t) or not t >= 0 or math.isinf(t):
            raise InputError(f"--temperature must be >= 0, got {_fmt(t)}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise InputError(f"--top-k must be >= 0, got {_fmt(k)}")
        if not _is_real(p) or not 0 < p <= 1:
            raise InputError(f"--top-p must be in (0, 1], got {_fmt(p)}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0
        ):
            raise InputError(f"--seed must be a non-negative integer, got {_fmt(self.seed)}")
        return self

    def rng(self) -> np.random.Generator:
        """A generator seeded from ``seed`` (fresh entropy when ``seed`` is None)."""
        return np.random.default_rng(self.seed)


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
    ``top_k`` largest logits, softmax, keep the smallest set of most probable tokens whose
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
        weights = _exp_shifted_(z)
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


def _normalise_(w: np.ndarray) -> np.ndarray:
    w /= w.sum(axis=1, keepdims=True)
    return w


def _process_top_k(rows: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Top-k (then optional top-p) on the k selected entries only; scattered back to [N, V]."""
    idx = _top_k_indices(rows, int(params.top_k))
    z = np.take_along_axis(rows, idx, axis=1).astype(np.float64) / float(params.temperature)
    weights = _exp_shifted_(z)
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


# --------------------------------------------------------------------------------------------
# Chain verification
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainResult:
    """Outcome of verifying a chain: the accepted drafts followed by exactly one more token."""

    tokens: list[int]
    num_accepted: int


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(p - q, 0) (unnormalised; :func:`sample` scales), or p when that has zero mass.

    Why the fallback is exact: the chance of rejecting a draft drawn from q is
    sum_x q(x) * (1 - min(1, p(x)/q(x))) = sum_x max(q(x) - p(x), 0) = sum_x max(p(x) - q(x), 0),
    i.e. exactly the residual mass. A zero residual therefore means rejection has probability
    zero in exact arithmetic (p == q on every token); the branch is reached only through float
    rounding, and emitting from p there keeps the output distributed as p.
    """
    r = p - q
    np.maximum(r, 0.0, out=r)
    return r if r.sum() > 0 else p


def _residual_one_hot(p: np.ndarray, token: int) -> np.ndarray:
    """max(p - onehot(token), 0) = p without the token (unnormalised; see :func:`_residual`)."""
    r = p.copy()
    r[token] = 0.0
    return r if r.sum() > 0 else p


def verify_chain(
    draft_tokens: Sequence[int] | np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator | None,
    draft_probs: np.ndarray | None = None,
    greedy: bool = False,
) -> ChainResult:
    """Verify k draft tokens against processed target rows ``target_probs`` [k+1, V].

    Row i is the target distribution for draft position i; row k gives the bonus token.
    ``draft_probs`` [k, V] is the distribution each draft was drawn from (None = one-hot,
    i.e. a deterministic drafter). Accept x_i if u < p_i(x_i)/q_i(x_i); at the first
    rejection emit a sample of norm(max(p_i - q_i, 0)); if all are accepted emit a bonus
    sample of p_k. Greedy: accept while x_i == argmax p_i, then emit argmax.
    """
    drafts = [int(t) for t in draft_tokens]
    k = len(drafts)
    _check_rows(target_probs, k + 1, "target_probs")
    if draft_probs is not None and not greedy:
        _check_rows(draft_probs, k, "draft_probs")
    if greedy:
        return _verify_chain_greedy(drafts, target_probs)
    if rng is None:
        raise ValueError("rng is required unless greedy=True")
    if draft_probs is None:  # one-hot q: accept x with probability p(x)
        for i, x in enumerate(drafts):
            if not rng.random() < target_probs[i, x]:
                residual = _residual_one_hot(target_probs[i], x)
                return ChainResult(drafts[:i] + [sample(residual, rng)], i)
    else:
        for i, x in enumerate(drafts):
            qx = draft_probs[i, x]
            if not qx > 0:
                raise ValueError(f"draft token {x} at position {i} has probability 0 under its draft_probs")
            if not rng.random() * qx < target_probs[i, x]:  # u < p(x)/q(x) without dividing
                residual = _residual(target_probs[i], draft_probs[i])
                return ChainResult(drafts[:i] + [sample(residual, rng)], i)
    return ChainResult(drafts + [sample(target_probs[k], rng)], k)


def _verify_chain_greedy(drafts: list[int], target_probs: np.ndarray) -> ChainResult:
    path, tokens = greedy_path(None, [-1, *drafts], lambda row: int(target_probs[row].argmax()))
    return ChainResult(tokens, len(path))


def greedy_path(tree: "TreeSpec | None", node_tokens: Sequence[int], best: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Greedy verification from each row's argmax `best(row)` (computed from the logits, or by the graph):
    follow the child (chain: the next draft) whose token is the parent row's best; returns (accepted node
    indices, their tokens + the best token of the last accepted row). Node 0 is the pending token."""
    path: list[int] = []
    node = 0
    while True:
        token = best(node)
        children = tree.children[node] if tree is not None else ([node + 1] if node + 1 < len(node_tokens) else [])
        nxt = next((c for c in children if node_tokens[c] == token), None)
        if nxt is None:
            return path, [int(node_tokens[c]) for c in path] + [token]
        path.append(nxt)
        node = nxt


def _check_rows(a: np.ndarray, rows: int, name: str) -> None:
    if getattr(a, "ndim", 0) != 2 or a.shape[0] < rows:
        raise ValueError(f"{name} must be [>= {rows}, V], got shape {getattr(a, 'shape', None)}")


# --------------------------------------------------------------------------------------------
# Tree verification
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeResult:
    """Outcome of verifying a tree.

    ``path``: accepted node indices from the root's child down (the root, node 0, excluded).
    ``tokens``: the accepted nodes' tokens followed by exactly one more token.
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        """Number of accepted draft nodes."""
        return len(self.path)


def verify_tree(
    tree: "TreeSpec",
    node_tokens: Sequence[int] | np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator | None,
    greedy: bool = False,
    child_probs: np.ndarray | Sequence[np.ndarray | None] | None = None,
    mode: TreeMode = "deterministic",
) -> TreeResult:
    """Walk the tree from the root, accepting at most one child per level.

    ``target_probs[i]`` is the processed target distribution after node i (node 0 = root =
    last committed token). Modes:

    * ``deterministic``: children are a deterministic drafter's picks (e.g. its top-k). Try
      them in order; accept child c if u < p(c) / mass(p), else set p(c) = 0 and go on.
    * ``iid``: the children of u were drawn i.i.d. from ``child_probs[u]`` (SpecInfer):
      accept with p(c)/q(c), else p = norm(max(p - q, 0)).
    * ``iid_without_replacement``: drawn without replacement (RSD): as ``iid``, and after a
      rejection c is also removed from q, which is renormalised.

    If no child is accepted the final token is sampled from the residual p; at a leaf it is
    a bonus sample of the leaf's p. Greedy: follow the child whose token is argmax p.
    """
    if mode not in TREE_MODES:
        raise ValueError(f"unknown tree mode {mode!r}; expected one of {', '.join(TREE_MODES)}")
    tokens = node_tokens.tolist() if isinstance(node_tokens, np.ndarray) else [int(t) for t in node_tokens]
    n = tree.n
    if len(tokens) != n:
        raise ValueError(f"node_tokens has {len(tokens)} entries for a tree of {n} nodes")
    _check_rows(target_probs, n, "target_probs")
    if greedy:
        return _verify_tree_greedy(tree, tokens, target_probs)
    if rng is None:
        raise ValueError("rng is required unless greedy=True")
    if mode != "deterministic" and child_probs is None:
        raise ValueError(f"mode {mode!r} needs child_probs")

    path: list[int] = []
    node = 0
    while True:
        kids = tree.children[node]
        p = target_probs[node]
        if kids:
            if mode == "deterministic":
                chosen, p = _try_children_deterministic(kids, tokens, p, rng)
            else:
                q = np.asarray(child_probs[node], dtype=np.float64)  # type: ignore[index]
                if q.shape != p.shape:
                    raise ValueError(f"child_probs[{node}] has shape {q.shape}, expected {p.shape}")
                chosen, p = _try_children_iid(kids, tokens, p, q, rng, mode == "iid_without_replacement")
            if chosen is not None:
                path.append(chosen)
                node = chosen
                continue
        final = sample(p, rng)
        return TreeResult(path, [tokens[c] for c in path] + [final])


def _try_children_deterministic(
    kids: Sequence[int], tokens: list[int], p: np.ndarray, rng: np.random.Generator
) -> tuple[int | None, np.ndarray]:
    """Try one-hot children in order; return (accepted child or None, residual p).

    The residual stays implicit while children are tried: rejected tokens are removed by
    subtracting their mass, and accepting with probability p(c) / mass is the test
    u * mass < p(c). A repeated token has residual probability 0 and is skipped.
    """
    mass = float(p.sum())
    rejected: list[int] = []
    for c in kids:
        t = tokens[c]
        pt = 0.0 if t in rejected else float(p[t])
        if not pt > 0:
            continue
        if rng.random() * mass < pt:
            return c, p if not rejected else _without(p, rejected)
        rejected.append(t)
        mass -= pt
    return None, _without(p, rejected)


def _without(p: np.ndarray, tokens: list[int]) -> np.ndarray:
    """p with ``tokens`` set to 0 (unnormalised), or p itself if nothing would remain.

    Nothing remains only through float rounding (the last child holding all the mass is
    accepted with certainty); see :func:`_residual` for why p is then an exact choice.
    """
    if not tokens:
        return p
    r = p.copy()
    r[tokens] = 0.0
    return r if r.sum() > 0 else p


def _try_children_iid(
    kids: Sequence[int],
    tokens: list[int],
    p: np.ndarray,
    q: np.ndarray,
    rng: np.random.Generator,
    without_replacement: bool,
) -> tuple[int | None, np.ndarray]:
    """SpecInfer / RSD multi-candidate acceptance; return (accepted child or None, residual p).

    p and q are kept unnormalised next to their masses (python floats), so each rejection
    costs one pass: norm(max(p/|p| - q/|q|, 0)) is max(p - (|p|/|q|) q, 0) up to scale.
    """
    p_mass = float(p.sum())
    q_mass = float(q.sum())
    q_private = False
    for c in kids:
        t = tokens[c]
        qt = float(q[t])
        if not qt > 0:
            raise ValueError(f"child token {t} (node {c}) has probability 0 under its child_probs")
        if rng.random() * qt * p_mass < p[t] * q_mass:  # u < (p(t)/|p|) / (q(t)/|q|)
            return c, p
        r = q * (p_mass / q_mass)
        np.subtract(p, r, out=r)
        np.maximum(r, 0.0, out=r)
        r_mass = float(r.sum())
        if r_mass > 0:  # otherwise keep p: see _residual for why that is exact
            p, p_mass = r, r_mass
        if without_replacement:
            if not q_private:
                q, q_private = q.copy(), True
            q[t] = 0.0
            q_mass = float(q.sum())
            if not q_mass > 0:
                break
    return None, p


def _verify_tree_greedy(tree: "TreeSpec", tokens: list[int], target_probs: np.ndarray) -> TreeResult:
    path, emitted = greedy_path(tree, tokens, lambda row: int(target_probs[row].argmax()))
    return TreeResult(path, emitted)
