"""A head drafter's tree plus the prompt-lookup continuation as one more branch.

A head (EAGLE, EAGLE-3, MTP, Medusa) predicts well one or two tokens ahead; n-gram prompt lookup is
right for many tokens in a row wherever the text repeats something in the context (a name, a list
item, code). Each step the lookup's chain is walked down the head's tree: tokens the tree already has
cost nothing, the rest hang below the deepest shared node as a new branch. All children are
deterministic proposals with distinct tokens per parent, so tree verification stays exact.

How much of the chain is verified: per matched-suffix length, the acceptance rate of lookup tokens
(geometric model, as the adaptive controller keeps it); the i-th new token is kept while
rate^i beats its verify cost (the extra cost of one more verified token relative to a one-token pass,
from the loop's cost fit; without adaptive speculation the whole chain is verified). A suffix length whose tokens are all
cut is still tried with one token every `probe_every` steps, so its rate stays current.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..adaptive import geometric_acceptance_update
from ..tree import TreeSpec
from .base import Draft
from .ngram import NgramDrafter


class LookupBranchDrafter:
    """Wraps a deterministic tree/chain drafter; adds the n-gram lookup chain to every proposal."""

    cheap_proposals = False
    enabled = True  # False: the inner drafter's proposals only (benchmarks compare both)

    def __init__(self, inner, lookup: NgramDrafter | None = None, max_nodes: int | None = None,
                 prior: float = 0.5, alpha: float = 0.08, probe_every: int = 8):
        self.inner = inner
        self.lookup = lookup or NgramDrafter()
        self.max_nodes = int(max_nodes if max_nodes is not None else getattr(inner, "max_nodes", 64))
        self.name = f"{inner.name}+lookup"
        self.prior = prior
        self.alpha = alpha
        self.probe_every = probe_every
        self.rate: dict[int, float] = {}
        self._cut_streak: dict[int, int] = {}
        self._costs: Callable[[], tuple[float, float]] | None = None
        self._last: tuple[Draft, int, list[int], int] | None = None  # inner draft, its node count, chain nodes, key
        self.reset()

    # -- what the loop reads off the inner drafter -------------------------------------------

    def __getattr__(self, name: str):
        """Everything not defined here (observe, draft_nodes, plans_tree, set_tree, session, the planner, ...)
        is the inner drafter's."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.inner.reset()
        self.lookup.reset()
        self._last = None

    def plan_with(self, costs, fresh: bool = False) -> None:
        """Costs for the inner planner and for sizing the lookup branch; `fresh` forgets learned rates."""
        self._costs = costs
        if hasattr(self.inner, "plan_with"):
            self.inner.plan_with(costs, fresh)
        if fresh:
            self.rate.clear()
            self._cut_streak.clear()

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, tokens: list[int], k: int) -> Draft:
        inner = self.inner.propose(tokens, k)
        self._last = None
        if not self.enabled:
            return inner
        chain = self.lookup.propose(tokens, k).tokens
        key = self.lookup.last_match_len
        if not chain or not _deterministic(inner):
            return inner
        parents, node_tokens = _nodes_of(inner)
        inner_n = len(parents)
        child_of = {(parents[c], node_tokens[c]): c for c in range(1, inner_n)}  # (parent, token) -> node
        chain_nodes: list[int] = []
        node = 0
        added = 0
        keep_new = self._new_tokens_paying(key)
        for token in chain:
            child = child_of.get((node, token))
            if child is None:
                if added >= keep_new or len(parents) >= self.max_nodes:
                    break
                parents.append(node)
                node_tokens.append(int(token))
                child = len(parents) - 1
                added += 1
            chain_nodes.append(child)
            node = child
        self._cut_streak[key] = 0 if added or len(chain_nodes) == len(chain) else self._cut_streak.get(key, 0) + 1
        self._last = (inner, inner_n, chain_nodes, key)
        if not added:
            return inner
        merged = TreeSpec.from_parents(parents)
        levels = inner.depth if inner.tokens else 0
        if merged.is_chain:
            return Draft(node_tokens[1:], levels=levels)
        return Draft(node_tokens[1:], tree=merged, mode="deterministic", levels=levels)

    def _new_tokens_paying(self, key: int) -> int:
        """How many lookup tokens not already in the inner tree to verify for a match of this length."""
        if self._costs is None:  # not adaptive: verify the whole chain
            return self.max_nodes
        slope = self._costs()[0]
        rate = min(self.rate.get(key, self.prior), 0.999)
        if slope <= 0:
            return self.max_nodes
        paying = int(np.floor(np.log(slope) / np.log(rate))) if rate > 0 else 0
        if paying <= 0 and self._cut_streak.get(key, 0) >= self.probe_every:
            return 1
        return max(0, paying)

    def record_verdict(self, draft: Draft, accepted_rows: Sequence[int]) -> None:
        """Split the verdict: the inner drafter's nodes go to its planner, the chain's prefix to the lookup rates."""
        last = self._last
        if last is None:
            if hasattr(self.inner, "record_verdict"):
                self.inner.record_verdict(draft, accepted_rows)
            return
        inner, inner_n, chain_nodes, key = last
        on_path = set(int(r) for r in accepted_rows)
        if inner.tokens and hasattr(self.inner, "record_verdict"):
            self.inner.record_verdict(inner, [r for r in accepted_rows if r < inner_n])
        if chain_nodes:
            accepted = 0
            while accepted < len(chain_nodes) and chain_nodes[accepted] in on_path:
                accepted += 1
            self.rate[key] = geometric_acceptance_update(self.rate.get(key, self.prior), len(chain_nodes), accepted, self.alpha)


def _deterministic(draft: Draft) -> bool:
    """True when the draft's children are deterministic picks (one-hot q): safe to add more of them."""
    if draft.tree is not None:
        return draft.mode == "deterministic"
    return draft.probs is None


def _nodes_of(draft: Draft) -> tuple[list[int], list[int]]:
    """(parent pointers, node tokens) of a draft, root (the pending token, token -1 here) included."""
    parents = [int(p) for p in draft.tree.parents] if draft.tree is not None else list(range(-1, len(draft.tokens)))
    return parents, [-1, *map(int, draft.tokens)]
