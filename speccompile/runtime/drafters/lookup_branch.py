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

from ..acceptance import AcceptanceRates
from ..tree import TreeSpec
from .base import Draft, Drafter
from .ngram import NgramDrafter


class LookupBranchDrafter(Drafter):
    """A deterministic tree/chain drafter (`inner`) whose every proposal gets the n-gram lookup chain too.

    Every hook of the loop is answered here: the inner drafter's own (observe, planning, tree size) are
    passed on, the lookup's acceptance is kept per matched-suffix length."""

    def __init__(self, inner: Drafter, lookup: NgramDrafter | None = None, max_nodes: int = 64,
                 prior: float = 0.5, alpha: float = 0.08, probe_every: int = 8):
        self.inner = inner
        self.lookup = lookup or NgramDrafter()
        self.max_nodes = int(max_nodes)
        self.name = f"{inner.name}+lookup"
        self.relative_cost = inner.relative_cost
        self.rates = AcceptanceRates(prior, alpha, probe_every)  # per matched-suffix length
        self._costs: Callable[[], tuple[float, float]] | None = None
        self._last: tuple[Draft, int, list[int], int] | None = None  # inner draft, its node count, chain nodes, key
        self.reset()

    # -- the inner drafter's hooks ---------------------------------------------------------------

    def reset(self) -> None:
        self.inner.reset()
        self.lookup.reset()
        self._last = None

    def observe(self, hidden: np.ndarray, row_tokens: list[int], next_token: int | None) -> None:
        self.inner.observe(hidden, row_tokens, next_token)

    @property
    def reads_hidden_states(self) -> bool:
        return self.inner.reads_hidden_states

    @property
    def plans_tree(self) -> bool:
        return self.inner.plans_tree

    def draft_nodes(self, k: int) -> int:
        return self.inner.draft_nodes(k)

    def plan_with(self, costs, fresh: bool = False) -> None:
        """Costs for the inner planner and for sizing the lookup branch; `fresh` forgets learned rates."""
        self._costs = costs
        self.inner.plan_with(costs, fresh)
        if fresh:
            self.rates.forget()

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, tokens: list[int], k: int) -> Draft:
        inner = self.inner.propose(tokens, k)
        self._last = None
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
        rate = min(self.rates.rate(key), 0.999)
        if slope <= 0:
            return self.max_nodes
        paying = int(np.floor(np.log(slope) / np.log(rate))) if rate > 0 else 0
        if self.rates.probe_due(key, idle=paying <= 0):
            return 1
        return max(0, paying)

    def record_verdict(self, draft: Draft, accepted_rows: Sequence[int]) -> None:
        """Split the verdict: the inner drafter's nodes go to its planner, the chain's prefix to the lookup rates."""
        last = self._last
        if last is None:
            self.inner.record_verdict(draft, accepted_rows)
            return
        inner, inner_n, chain_nodes, key = last
        on_path = set(int(r) for r in accepted_rows)
        if inner.tokens:
            self.inner.record_verdict(inner, [r for r in accepted_rows if r < inner_n])
        if chain_nodes:
            accepted = 0
            while accepted < len(chain_nodes) and chain_nodes[accepted] in on_path:
                accepted += 1
            self.rates.observe_chain(key, len(chain_nodes), accepted)


def _deterministic(draft: Draft) -> bool:
    """True when the draft's children are deterministic picks (one-hot q): safe to add more of them."""
    if draft.tree is not None:
        return draft.mode == "deterministic"
    return draft.probs is None


def _nodes_of(draft: Draft) -> tuple[list[int], list[int]]:
    """(parent pointers, node tokens) of a draft, root (the pending token, token -1 here) included."""
    parents = [int(p) for p in draft.tree.parents] if draft.tree is not None else list(range(-1, len(draft.tokens)))
    return parents, [-1, *map(int, draft.tokens)]
