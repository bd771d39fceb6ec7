"""Drafters with a static tree (Medusa/EAGLE choice paths): which subtree to draft each round."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from ..tree import TreeSpec
from ..tree_planner import TreePlanner, drafted_spec
from .base import Drafter, GenerationStart, Observation

if TYPE_CHECKING:
    from ..adaptive import Sizing


class StaticTrees:
    """A drafter's static tree for one round: the exported tree cut to the round's depth, or (adaptive) the
    planner's subtree of it (runtime/tree_planner.py)."""

    def __init__(self, choices: Iterable[Sequence[int]], max_nodes: int):
        self.planner = TreePlanner(choices, max_nodes)
        self.cut = self.planner.full

    def for_round(self, sizing: "Sizing", depth: int | None = None) -> TreeSpec:
        """The tree to draft at most `depth` (default `sizing.room`) levels deep this round."""
        k = sizing.room if depth is None else min(depth, sizing.room)
        if not sizing.adaptive:
            return self.cut(k)
        return self.planner.plan(k, sizing.costs, sizing.level_seconds)


class StaticTreeDrafter(Drafter):
    """Base of drafters with a static tree (`static_trees`; None while drafting a dynamic tree). The planner's
    per-node rates carry over from prompt to prompt, except for a `fresh` start (seeded sampling: the tree,
    hence the output, then depends only on the generation)."""

    static_trees: StaticTrees | None = None

    @property
    def planner(self) -> TreePlanner | None:
        """The per-node acceptance statistics of the static tree (None for a dynamic tree)."""
        return None if self.static_trees is None else self.static_trees.planner

    def start(self, start: GenerationStart) -> None:
        if start.fresh and self.static_trees is not None:
            self.static_trees.planner.forget()

    def observe(self, observation: Observation) -> None:
        """Feed the verdict on its draft back to the planner."""
        if observation.draft is not None and self.static_trees is not None:
            self.static_trees.planner.record(drafted_spec(observation.draft), observation.accepted_rows)
