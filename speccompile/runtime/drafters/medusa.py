"""Medusa drafting: every head reads the last committed hidden state; a static tree of their top-k.

Head i predicts the token i+2 positions after the last committed row, i.e. draft depth i+1 (the
target's own lm_head already gave the pending token). A tree node at depth d with choice rank r holds
the r-th most likely token of head d-1, independent of its parent (Medusa heads do not condition on
earlier draft tokens). Children are deterministic picks, so verification is exact ("deterministic"
tree mode); Medusa's lossy "typical acceptance" is not offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import InputError
from ...draft_config import DraftConfig
from .base import Draft, GenerationStart, Observation
from .eagle import _top
from .static_tree import StaticTreeDrafter, StaticTrees

if TYPE_CHECKING:
    from ..adaptive import Sizing


class MedusaDrafter(StaticTreeDrafter):
    """Static-tree (or chain) drafting from the Medusa heads' top-k."""

    name = "medusa"
    reads_hidden_states = True

    def __init__(self, session, draft: DraftConfig, num_heads: int, max_nodes: int = 64):
        self.session = session
        self.num_heads = int(num_heads)
        self.max_nodes = max(2, int(max_nodes))
        self.set_tree(draft)
        self.start(GenerationStart())

    def set_tree(self, draft: DraftConfig) -> None:
        """Draft this static tree (paths deeper than the number of heads are dropped)."""
        if draft.choices is None:
            raise InputError("tree: Medusa heads draft static trees (a preset, a JSON file or chain)", "tree")
        self.draft_config = draft
        self.static_trees = StaticTrees([c for c in draft.choices if len(c) <= self.num_heads], self.max_nodes)

    def start(self, start: GenerationStart) -> None:
        super().start(start)
        self.last_hidden: np.ndarray | None = None
        self.observed = 0

    def observe(self, observation: Observation) -> None:
        super().observe(observation)  # the verdict, to the tree planner
        if observation.hidden is not None:
            self.last_hidden = np.asarray(observation.hidden[-1])
            self.observed += len(observation.hidden)

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        if sizing.room <= 0 or self.last_hidden is None or self.observed != len(tokens) - 1:
            return Draft([])
        spec = self.static_trees.for_round(sizing, self.num_heads)
        if spec.n <= 1:
            return Draft([])
        logits = self.session.run(self.last_hidden[None])[0]  # [heads, V]
        width = {}
        for c in range(1, spec.n):
            d = int(spec.depths[c])
            width[d] = max(width.get(d, 0), int(spec.choice[c]) + 1)
        tops = {d: _top(logits[d - 1], w) for d, w in width.items()}
        node_tokens = [int(tops[int(spec.depths[c])][int(spec.choice[c])]) for c in range(1, spec.n)]
        if spec.is_chain:
            return Draft(node_tokens)
        return Draft(node_tokens, tree=spec, mode="deterministic")
