"""Adaptive static trees: verify only the nodes of the exported tree that pay for their verify cost.

A static tree (Medusa/EAGLE choice paths) is tuned for an engine where verifying more tokens is nearly
free. Where it is not (a CPU: a pass over q tokens costs about t(1) (1 + s (q - 1))), a wide tree
costs more than it brings. The planner keeps, per choice path, how often the node was on the accepted
path when it was drafted (an EMA). With deterministic top-k children that rate does not depend on
which siblings were drafted, so it stays valid for any subtree.

Planning a step of depth <= k: nodes sorted by their acceptance rate (capped by the parent's, so every
prefix of the order is ancestor-closed); the prefix kept is the one with the highest expected speed
(runtime/costs.py, `best_prefix`): (1 + sum of rates) tokens from a pass over nodes + 1 tokens after drafting its levels,
t(nodes + 1) + d * levels, with t the round's pass costs and d the seconds of one drafter call. An empty
prefix means a plain step. Every `probe_every` planned steps the next `probe_extra` nodes of the order are
drafted too, so the rates of pruned nodes stay current. The output is never affected: the planner only picks which proposals to verify.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

from .acceptance import AcceptanceRates
from .costs import PassCostModel, best_prefix
from .tree import DepthLimitedTrees, TreeSpec


class TreePlanner:
    """Per-node acceptance statistics of a static tree and the subtree worth drafting."""

    def __init__(self, choices: Iterable[Sequence[int]], max_nodes: int, alpha: float = 0.1,
                 prior: float = 0.5, probe_every: int = 8, probe_extra: int = 3):
        self.full = DepthLimitedTrees(choices, max_nodes)
        self.prior = prior
        self.probe_extra = probe_extra
        # untried node: the prior per level, halved per rank below the top choice
        self.rates = AcceptanceRates(lambda path: prior ** len(path) * 0.5 ** sum(1 for c in path if c), alpha, probe_every)
        self._specs: dict[tuple, TreeSpec] = {}
        self._paths: dict[int, list[tuple[int, ...]]] = {}  # depth-k tree's choice paths, parents first

    def acceptance(self, path: tuple[int, ...]) -> float:
        """Estimated probability that the node at `path` is accepted."""
        return self.rates.rate(path)

    def plan(self, k: int, costs: PassCostModel, level_seconds: float) -> TreeSpec:
        """The subtree of the depth-k tree to draft now (n == 1: draft nothing), priced by the pass costs and
        the seconds of one drafter call (one tree level)."""
        if k not in self._paths:
            self._paths[k] = sorted((tuple(c) for c in self.full(k).choices()), key=len)
        capped: dict[tuple[int, ...], float] = {(): 1.0}
        for path in self._paths[k]:
            capped[path] = min(self.acceptance(path), capped[path[:-1]])
        order = sorted((p for p in capped if p), key=lambda p: (-capped[p], len(p), p))
        best_n = best_prefix([capped[p] for p in order], [len(p) for p in order], costs, level_seconds)
        if self.rates.probe_due():  # also try the next few nodes, so pruned ones can come back
            best_n = min(len(order), best_n + self.probe_extra)
        key = tuple(sorted(order[:best_n]))
        if key not in self._specs:
            self._specs[key] = TreeSpec.from_choices([list(p) for p in key])
        return self._specs[key]

    def forget(self) -> None:
        """Back to the prior rates."""
        self.rates.forget()

    def record(self, spec: TreeSpec, accepted_rows: Sequence[int]) -> None:
        """After verification: every drafted node was accepted (on the accepted path) or not."""
        on_path = set(int(r) for r in accepted_rows)
        for node, path in enumerate(spec.choices(), 1):
            self.rates.observe(tuple(path), 1.0 if node in on_path else 0.0)


def drafted_spec(draft) -> TreeSpec:
    """The tree a Draft verified: its TreeSpec, or the chain of its tokens."""
    return draft.tree if draft.tree is not None else _chain_spec(len(draft.tokens))


@lru_cache(maxsize=None)
def _chain_spec(length: int) -> TreeSpec:
    return TreeSpec.from_choices([[0] * d for d in range(1, length + 1)])
