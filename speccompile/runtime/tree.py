"""Draft trees: static choice-path trees (their grammar and presets: speccompile/draft_config.py) and EAGLE-2
style dynamic trees.

A tree has n nodes; node 0 is the root (the last committed token) and every other node is one
draft candidate. Nodes are indexed so that a parent always comes before its children; static
trees are sorted by (depth, choice path) like Medusa/EAGLE. For one verification pass:

* ``attention_mask(past_len)`` [n, past_len + n]: node i sees the whole past, its ancestors
  and itself;
* ``position_ids(past_len)`` [n]: past_len + depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..draft_config import load_choices, normalise_choices
from ..errors import InputError


# --------------------------------------------------------------------------------------------
# TreeSpec
# --------------------------------------------------------------------------------------------


class TreeSpec:
    """An immutable draft tree given by parent pointers and sibling ranks.

    Attributes: ``parents`` (int64, -1 for the root), ``depths`` (int64, root 0), ``choice``
    (int64, the node's rank among its siblings = the drafter's top-k rank; 0 for the root),
    ``children`` (per node, child indices ordered by choice).
    """

    def __init__(self, parents: Sequence[int] | np.ndarray, choice: Sequence[int] | np.ndarray) -> None:
        par = np.asarray(parents, dtype=np.int64).reshape(-1)
        cho = np.asarray(choice, dtype=np.int64).reshape(-1)
        _check_parents(par, cho)
        depths = np.zeros(len(par), dtype=np.int64)
        kids: list[list[int]] = [[] for _ in range(len(par))]
        for i in range(1, len(par)):
            depths[i] = depths[par[i]] + 1
            kids[par[i]].append(i)
        for lst in kids:
            lst.sort(key=lambda c: (int(cho[c]), c))
        for a in (par, cho, depths):
            a.setflags(write=False)
        self.parents = par
        self.choice = cho
        self.depths = depths
        self.children: list[list[int]] = kids
        self._ancestry: np.ndarray | None = None

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_choices(cls, choices: Iterable[Sequence[int]]) -> "TreeSpec":
        """Build from Medusa/EAGLE choice paths, e.g. [[0], [0, 0], [1]]; the root is implicit.

        Raises :class:`InputError` for malformed, duplicate or non-prefix-closed paths.
        """
        paths = normalise_choices(choices)
        order = sorted(paths, key=lambda t: (len(t), t))
        index = {(): 0}
        for i, path in enumerate(order, start=1):
            index[path] = i
        parents = [-1] + [index[path[:-1]] for path in order]
        choice = [0] + [path[-1] for path in order]
        return cls(parents, choice)

    @classmethod
    def from_parents(
        cls, parents: Sequence[int] | np.ndarray, choice: Sequence[int] | np.ndarray | None = None
    ) -> "TreeSpec":
        """Build from parent pointers (parents[0] == -1, parents[i] < i), e.g. a dynamic tree.

        ``choice`` defaults to each node's position among its siblings in index order.
        """
        par = np.asarray(parents, dtype=np.int64).reshape(-1)
        if choice is None:
            counts: dict[int, int] = {}
            cho = np.zeros(len(par), dtype=np.int64)
            for i in range(1, len(par)):
                cho[i] = counts.get(int(par[i]), 0)
                counts[int(par[i])] = int(cho[i]) + 1
            choice = cho
        return cls(par, choice)

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        """A chain of k draft tokens (k + 1 nodes including the root)."""
        if k < 0:
            raise InputError(f"chain length must be >= 0, got {k}")
        return cls(np.arange(-1, k, dtype=np.int64), np.zeros(k + 1, dtype=np.int64))

    # -- basic facts ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def n(self) -> int:
        """Number of nodes including the root."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node (= longest number of draft tokens that can be accepted)."""
        return int(self.depths.max())

    @property
    def is_chain(self) -> bool:
        """True when every node has at most one child."""
        return all(len(c) <= 1 for c in self.children)

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        return [i for i, c in enumerate(self.children) if not c]

    def ancestors(self, i: int, include_self: bool = False) -> list[int]:
        """Ancestors of node i ordered root first (the root included when i != 0)."""
        out = [i] if include_self else []
        j = int(self.parents[i])
        while j >= 0:
            out.append(j)
            j = int(self.parents[j])
        out.reverse()
        return out

    def paths(self) -> list[list[int]]:
        """Every root -> leaf path as node indices, root (0) first, one per leaf in index order."""
        return [self.ancestors(leaf, include_self=True) for leaf in self.leaves()]

    def choices(self) -> list[list[int]]:
        """The choice path of every non-root node (the inverse of :meth:`from_choices`)."""
        out: list[list[int]] = [[]]
        for i in range(1, self.n):
            out.append(out[int(self.parents[i])] + [int(self.choice[i])])
        return out[1:]

    # -- verify-graph inputs -----------------------------------------------------------------

    @property
    def ancestry(self) -> np.ndarray:
        """bool [n, n]: ancestry[i, j] is True when j is an ancestor of i or i itself."""
        if self._ancestry is None:
            anc = np.zeros((self.n, self.n), dtype=bool)
            for i in range(self.n):
                if i > 0:
                    anc[i] = anc[self.parents[i]]
                anc[i, i] = True
            anc.setflags(write=False)
            self._ancestry = anc
        return self._ancestry

    def attention_mask(self, past_len: int = 0) -> np.ndarray:
        """bool [n, past_len + n]: each node sees all past positions, its ancestors and itself."""
        if past_len < 0:
            raise ValueError(f"past_len must be >= 0, got {past_len}")
        mask = np.ones((self.n, past_len + self.n), dtype=bool)
        mask[:, past_len:] = self.ancestry
        return mask

    def position_ids(self, past_len: int = 0) -> np.ndarray:
        """int64 [n]: RoPE position of each node, past_len + depth."""
        return self.depths + np.int64(past_len)

    # -- misc ---------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeSpec):
            return NotImplemented
        return np.array_equal(self.parents, other.parents) and np.array_equal(self.choice, other.choice)

    def __hash__(self) -> int:
        return hash((self.parents.tobytes(), self.choice.tobytes()))

    def __repr__(self) -> str:
        return f"TreeSpec(n={self.n}, max_depth={self.max_depth}, leaves={len(self.leaves())})"


def _check_parents(par: np.ndarray, cho: np.ndarray) -> None:
    if len(par) == 0 or par[0] != -1:
        raise ValueError("a tree needs a root: parents[0] must be -1")
    if len(cho) != len(par):
        raise ValueError(f"choice has {len(cho)} entries for {len(par)} nodes")
    idx = np.arange(len(par))
    if np.any(par[1:] < 0) or np.any(par[1:] >= idx[1:]):
        raise ValueError("parents must satisfy 0 <= parents[i] < i for every non-root node")
    if np.any(cho < 0):
        raise ValueError("choice ranks must be >= 0")


def load_tree(spec: str | Path) -> TreeSpec:
    """The tree of a preset name (``eagle-default``, ``chain-K``, ``tree-WxD``) or of a JSON file of choice paths
    (the grammar: speccompile/draft_config.py `load_choices`)."""
    return TreeSpec.from_choices(load_choices(spec))


# --------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2)
# --------------------------------------------------------------------------------------------


@dataclass
class DraftTree:
    """A tree while it is being grown; node ids are creation order (root = 0).

    Handed to the drafter's ``expand`` callback so it can look up, for any node id, its token,
    parent, depth (position = past_len + depth) and cumulative log-prob ``score``.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    @classmethod
    def with_root(cls, root_token: int) -> "DraftTree":
        """A tree holding only the root."""
        return cls([int(root_token)], [-1], [0], [0], [0.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, rank: int, log_prob: float) -> int:
        """Append a child of ``parent``; return its id."""
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.ranks.append(int(rank))
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(self.scores[parent] + float(log_prob))
        return len(self.tokens) - 1

    def ancestors(self, i: int, include_self: bool = False) -> list[int]:
        """Ancestor ids of node i, root first."""
        out = [i] if include_self else []
        j = self.parents[i]
        while j >= 0:
            out.append(j)
            j = self.parents[j]
        return out[::-1]

    def spec(self) -> TreeSpec:
        """The tree so far as a TreeSpec in creation order (for masks over grown nodes)."""
        return TreeSpec(self.parents, self.ranks)

    def select(self, total_tokens: int, min_log_prob: float = -np.inf) -> tuple[TreeSpec, np.ndarray, np.ndarray]:
        """Keep the best ``total_tokens`` non-root nodes by cumulative log-prob (none below ``min_log_prob``).

        Returns (TreeSpec in (depth, choice path) order, node tokens, creation ids of the kept
        nodes in the new order). The kept set is always ancestor-closed: scores are capped by
        the parent's (a no-op when log-probs are <= 0) and ties prefer shallower, then older
        nodes, so a parent always ranks before its children.
        """
        capped = self._capped_scores()
        ranked = sorted((i for i in range(1, len(self)) if capped[i] >= min_log_prob), key=lambda i: (-capped[i], self.depths[i], i))
        kept = [0] + ranked[: max(0, int(total_tokens))]
        paths = self._choice_paths()
        kept.sort(key=lambda i: (len(paths[i]), paths[i], i))
        new_index = {old: new for new, old in enumerate(kept)}
        parents = [-1] + [new_index[self.parents[i]] for i in kept[1:]]
        ranks = [0] + [self.ranks[i] for i in kept[1:]]
        tokens = np.array([self.tokens[i] for i in kept], dtype=np.int64)
        return TreeSpec(parents, ranks), tokens, np.array(kept, dtype=np.int64)

    def _capped_scores(self) -> list[float]:
        capped = list(self.scores)
        for i in range(1, len(self)):
            capped[i] = min(capped[i], capped[self.parents[i]])
        return capped

    def _choice_paths(self) -> list[tuple[int, ...]]:
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(self)):
            paths.append(paths[self.parents[i]] + (self.ranks[i],))
        return paths


ExpandFn = Callable[[np.ndarray, DraftTree], tuple[np.ndarray, np.ndarray]]



class DepthLimitedTrees:
    """A static tree's choice paths cut to depth k (and at most `max_nodes` nodes), built once per k."""

    def __init__(self, choices: Iterable[Sequence[int]], max_nodes: int):
        self.choices = [list(c) for c in choices]
        self.max_nodes = max_nodes
        self._specs: dict[int, TreeSpec] = {}

    def __call__(self, k: int) -> TreeSpec:
        if k not in self._specs:
            kept = sorted((c for c in self.choices if len(c) <= k), key=lambda c: (len(c), c))
            self._specs[k] = TreeSpec.from_choices(kept[: self.max_nodes - 1])
        return self._specs[k]


def build_dynamic_tree(
    expand: ExpandFn,
    depth: int,
    top_k: int,
    total_tokens: int,
    root_token: int,
    min_prob: float = 0.0,
) -> tuple[TreeSpec, np.ndarray]:
    """Grow an EAGLE-2 dynamic tree and return (TreeSpec, node tokens [n]); node 0 = root.

    ``expand(frontier_ids, tree)`` gets the creation ids of the nodes to expand (the first
    call gets ``[0]``, the root) and the :class:`DraftTree` so far, and returns ``tokens`` and
    ``log_probs`` [len(frontier), >= top_k]: each frontier node's candidate next tokens. The
    top_k of every row become children (ranked by log-prob, stable); the children of
    ``frontier[r]`` get consecutive ids ``len(tree) + r * top_k + rank``, so a drafter can key
    its per-node state (hidden features, KV rows) by id. For ``depth`` steps, the next frontier
    is the ``top_k`` best new nodes by cumulative log-prob. Finally the best ``total_tokens``
    nodes are kept (ancestor-closed), giving a tree of at most ``total_tokens + 1`` nodes.

    ``min_prob`` > 0 makes the tree confidence-bound: nodes whose cumulative draft probability is below
    it are neither expanded nor kept, so a step the head is unsure of drafts a small tree (or none)
    and a confident step drafts deep.
    """
    floor = _log_floor(min_prob)
    tree, _ = grow_dynamic_tree(expand, depth, top_k, root_token, floor)
    spec, tokens, _ = tree.select(total_tokens, floor)
    return spec, tokens


def _log_floor(min_prob: float) -> float:
    return float(np.log(min_prob)) if min_prob > 0 else -np.inf


def grow_dynamic_tree(expand: ExpandFn, depth: int, top_k: int, root_token: int,
                      min_log_prob: float = -np.inf) -> tuple[DraftTree, int]:
    """The expansion phase of :func:`build_dynamic_tree`; returns (tree, number of expand calls).
    Nodes scoring below ``min_log_prob`` are not expanded; growth stops when none is left."""
    if depth < 0 or top_k < 1:
        raise ValueError(f"need depth >= 0 and top_k >= 1, got depth={depth}, top_k={top_k}")
    tree = DraftTree.with_root(root_token)
    frontier = [0]
    calls = 0
    for _ in range(depth):
        tokens, log_probs = expand(np.array(frontier, dtype=np.int64), tree)
        calls += 1
        new_ids = _add_children(tree, frontier, tokens, log_probs, top_k)
        new_ids.sort(key=lambda i: (-tree.scores[i], i))
        frontier = [i for i in new_ids[:top_k] if tree.scores[i] >= min_log_prob]
        if not frontier:
            break
    return tree, calls


def _add_children(
    tree: DraftTree, frontier: list[int], tokens: np.ndarray, log_probs: np.ndarray, top_k: int
) -> list[int]:
    tok = np.asarray(tokens)
    lp = np.asarray(log_probs, dtype=np.float64)
    want = (len(frontier), top_k)
    if tok.ndim != 2 or tok.shape != lp.shape or tok.shape[0] != want[0] or tok.shape[1] < top_k:
        raise ValueError(f"expand must return tokens and log_probs of shape [{want[0]}, >= {top_k}], "
                         f"got {tok.shape} and {lp.shape}")
    new_ids = []
    for row, parent in enumerate(frontier):
        order = np.argsort(-lp[row], kind="stable")[:top_k]
        for rank, j in enumerate(order):
            new_ids.append(tree.add(parent, int(tok[row, j]), rank, lp[row, j]))
    return new_ids
