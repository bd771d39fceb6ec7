"""A head drafter's tree plus the prompt-lookup continuation as one more branch.

A head (EAGLE, EAGLE-3, MTP, Medusa) predicts well one or two tokens ahead; n-gram prompt lookup is
right for many tokens in a row wherever the text repeats something in the context (a name, a list
item, code). Each step the lookup's chain is walked down the head's tree: tokens the tree already has
cost nothing, the rest hang below the deepest shared node as a new branch. All children are
deterministic proposals with distinct tokens per parent, so tree verification stays exact.

How much of the chain is verified: per matched-suffix length, the acceptance rate of lookup tokens
(geometric model, as the adaptive controller keeps it); the new tokens kept are as many as a chain of that
acceptance would draft at the round's pass costs (`costs.best_draft_length`, the controller's formula;
without adaptive speculation the whole chain is verified). A suffix length whose tokens are all cut is still
tried with one token every `probe_every` steps, so its rate stays current.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Hashable

from ..acceptance import AcceptanceRates
from ..costs import best_draft_length
from ..tree import TreeSpec
from .base import Draft, Drafter, GenerationStart, Observation
from .ngram import NgramDrafter

if TYPE_CHECKING:
    from ..adaptive import Sizing


class LookupBranchDrafter(Drafter):
    """A deterministic tree/chain drafter (`inner`) whose every proposal gets the n-gram lookup chain too.

    Every call of the loop is answered here: the inner drafter's start and observations (with the verdict on
    its own nodes) are passed on, the lookup's acceptance is kept per matched-suffix length."""

    def __init__(self, inner: Drafter, lookup: NgramDrafter | None = None, max_nodes: int = 64,
                 prior: float = 0.5, alpha: float = 0.08, probe_every: int = 8):
        self.inner = inner
        self.lookup = lookup or NgramDrafter()
        self.max_nodes = int(max_nodes)
        self.name = f"{inner.name}+lookup"
        self.relative_cost = inner.relative_cost
        self.rates = AcceptanceRates(prior, alpha, probe_every)  # per matched-suffix length
        self._last: tuple[Draft, int, list[int], Hashable] | None = None  # inner draft, its node count, chain nodes, key
        self.start(GenerationStart())

    # -- the inner drafter's calls ---------------------------------------------------------------

    def start(self, start: GenerationStart) -> None:
        self.inner.start(start)
        self.lookup.start(start)
        if start.fresh:
            self.rates.forget()
        self._last = None

    def observe(self, observation: Observation) -> None:
        """Split the verdict: the inner drafter's nodes go to it, the chain's prefix to the lookup rates."""
        last, self._last = self._last, None
        if observation.draft is None or last is None:
            self.inner.observe(observation)
            return
        inner, inner_n, chain_nodes, key = last
        rows = observation.accepted_rows
        own = replace(observation, draft=inner, accepted_rows=[r for r in rows if r < inner_n])
        self.inner.observe(own if inner.tokens else replace(observation, draft=None, accepted_rows=()))
        if chain_nodes:
            on_path = set(int(r) for r in rows)
            accepted = 0
            while accepted < len(chain_nodes) and chain_nodes[accepted] in on_path:
                accepted += 1
            self.rates.observe_chain(key, len(chain_nodes), accepted)

    @property
    def reads_hidden_states(self) -> bool:
        return self.inner.reads_hidden_states

    # -- drafting ------------------------------------------------------------------------------

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        inner = self.inner.propose(tokens, sizing)
        self._last = None
        lookup = self.lookup.lookup(tokens, sizing.room)
        chain, key = lookup.tokens, lookup.key
        if not chain or not _deterministic(inner):
            return inner
        parents, node_tokens = _nodes_of(inner)
        inner_n = len(parents)
        child_of = {(parents[c], node_tokens[c]): c for c in range(1, inner_n)}  # (parent, token) -> node
        chain_nodes: list[int] = []
        node = 0
        added = 0
        keep_new = self._new_tokens_paying(key, sizing, len(chain))
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

    def _new_tokens_paying(self, key: Hashable, sizing: "Sizing", most: int) -> int:
        """How many of `most` lookup tokens not already in the inner tree to verify for a match of this class."""
        if not sizing.adaptive:  # verify the whole chain
            return self.max_nodes
        paying = best_draft_length(self.rates.rate(key), sizing.costs, most)
        if self.rates.probe_due(key, idle=paying <= 0):
            return 1
        return paying


def _deterministic(draft: Draft) -> bool:
    """True when the draft's children are deterministic picks (one-hot q): safe to add more of them."""
    if draft.tree is not None:
        return draft.mode == "deterministic"
    return draft.probs is None


def _nodes_of(draft: Draft) -> tuple[list[int], list[int]]:
    """(parent pointers, node tokens) of a draft, root (the pending token, token -1 here) included."""
    parents = [int(p) for p in draft.tree.parents] if draft.tree is not None else list(range(-1, len(draft.tokens)))
    return parents, [-1, *map(int, draft.tokens)]
