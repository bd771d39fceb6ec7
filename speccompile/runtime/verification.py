"""Exact speculative verification: the logits of one verify pass against a draft -> one `Verdict`.

The invariant (docs/DESIGN.md, "Exact speculative sampling"): whatever the drafter proposes, the
emitted tokens are distributed exactly as if sampled from the processed target distribution p
(token-identical to argmax decoding when greedy).

`verify_draft` is the one entry the decode loop calls: it reads each row's target distribution
(`TargetRows`: the argmax under greedy, the processed p under sampling; the one place a pass's logits
become distributions), applies the chain rule or the tree rule, then cuts the verdict to the rows the
pass computed exactly as plain decoding (`exact_acceptance`). The rules themselves (`verify_chain`,
`verify_tree`, `greedy_path`) are pure functions of probabilities, tested on their own.

Conventions: ``p`` is the processed target distribution; ``q`` the distribution a draft token was
*actually* drawn from (one-hot for a deterministic drafter: n-gram, argmax heads, top-k tree children).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Literal, Sequence

import numpy as np

from .backends.base import StepOutput
from .drafters.base import Draft
from .sampling import SamplingParams, process_logits, sample
from .tree import TreeSpec

TreeMode = Literal["deterministic", "iid", "iid_without_replacement"]
TREE_MODES: tuple[str, ...] = ("deterministic", "iid", "iid_without_replacement")


# --------------------------------------------------------------------------------------------
# The verdict of one pass
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What one verify pass decided.

    `accepted_rows`: the accepted draft nodes (pass rows 1.., root to leaf); `tokens`: what to emit, the
    accepted nodes' tokens and then exactly one more (a correction or a bonus token); `carried`: tokens the
    rules accepted past a row the pass did not compute as plain decoding (`exact_acceptance`): not emitted
    now, proposed again as the next round's chain.
    """

    accepted_rows: list[int]
    tokens: list[int]
    carried: list[int] = field(default_factory=list)

    @property
    def kept_rows(self) -> list[int]:
        """The pass rows whose KV the cache keeps: the pending token's (0), then the accepted ones."""
        return [0, *self.accepted_rows]

    @property
    def token_rows(self) -> list[int]:
        """The pass row whose distribution chose each emitted token (for its log-probability, its trace)."""
        return self.kept_rows[: len(self.tokens)]


class TargetRows:
    """The target's distribution after each row of a verify pass, as the rules read it: the row's argmax
    (greedy; the graph's own argmax when it computes one, so the logits need not leave the device) or its
    processed distribution p (sampling)."""

    def __init__(self, out: StepOutput, params: SamplingParams):
        self.out = out
        self.params = params

    def best(self, row: int) -> int:
        """The row's argmax (ties: the lowest id)."""
        if self.out.greedy_tokens is not None:
            return int(self.out.greedy_tokens[row])
        return int(self.out.logits[row].argmax())

    @cached_property
    def probs(self) -> np.ndarray:
        """float64 [q, V]: each row's processed distribution p."""
        return process_logits(self.out.logits, self.params)


def verify_draft(draft: Draft, pending: int, out: StepOutput, params: SamplingParams,
                 rng: np.random.Generator) -> Verdict:
    """Exact verification of a chain or tree draft against the pass over the pending token + the draft.

    Greedy: follow each row's argmax; sampling: the chain rule or the tree rule on the processed rows (a
    draft distribution over another vocabulary size is aligned to the target's first). A tree laid out main
    path first (`out.plain_exact`) gets its verdict cut where it leaves the rows computed as plain decoding."""
    rows = TargetRows(out, params)
    node_tokens = [pending, *draft.tokens]
    if params.greedy:
        accepted, tokens = greedy_path(draft.tree, node_tokens, rows.best)
    elif draft.tree is not None:
        vocab = rows.probs.shape[-1]
        child = None if draft.child_probs is None else [None if c is None else align_vocab(c[None], vocab)[0]
                                                        for c in draft.child_probs]
        result = verify_tree(draft.tree, node_tokens, rows.probs, rng, child_probs=child, mode=draft.mode)
        accepted, tokens = list(result.path), list(result.tokens)
    else:
        result = verify_chain(draft.tokens, rows.probs, rng, align_vocab(draft.probs, rows.probs.shape[-1]))
        accepted, tokens = list(range(1, result.num_accepted + 1)), list(result.tokens)
    if out.plain_exact is None:
        return Verdict(accepted, tokens)
    kept, emitted = exact_acceptance(accepted, tokens, out.plain_exact)
    return Verdict(kept, emitted, tokens[len(emitted):])


def exact_acceptance(accepted_rows: list[int], emitted: list[int], plain_exact: np.ndarray) -> tuple[list[int], list[int]]:
    """A verdict cut to the rows computed exactly as plain decoding (`StepOutput.plain_exact`,
    backends/tree_layout.py).

    The first accepted row that is not exact still has an exact token (chosen from its parent's exact
    logits), so it is emitted as the step's last token, like a bonus token; neither its logits nor its KV
    row are used: `(accepted_rows[:n], emitted[:n + 1])` for the n leading exact accepted rows.
    """
    n = 0
    while n < len(accepted_rows) and plain_exact[accepted_rows[n]]:
        n += 1
    return accepted_rows[:n], emitted[: n + 1]


def align_vocab(probs: np.ndarray | None, vocab: int) -> np.ndarray | None:
    """Pad/cut a draft distribution to the target's vocabulary size (padded ids have zero mass)."""
    if probs is None or probs.shape[-1] == vocab:
        return probs
    if probs.shape[-1] > vocab:
        cut = probs[..., :vocab]
        return cut / cut.sum(axis=-1, keepdims=True)
    return np.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, vocab - probs.shape[-1])])


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


def greedy_path(tree: TreeSpec | None, node_tokens: Sequence[int], best: Callable[[int], int]) -> tuple[list[int], list[int]]:
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
    tree: TreeSpec,
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


def _verify_tree_greedy(tree: TreeSpec, tokens: list[int], target_probs: np.ndarray) -> TreeResult:
    path, emitted = greedy_path(tree, tokens, lambda row: int(target_probs[row].argmax()))
    return TreeResult(path, emitted)
