"""What a drafter gives the generation loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when `tree` is set.

    Chain: `tokens` continue the pending token; `probs` [k, V] is the distribution each token was drawn
    from (None = one-hot, a deterministic drafter).
    Tree: `tree` is a TreeSpec whose node 0 is the pending token and `tokens` are the tokens of nodes
    1..n-1; `mode` is "deterministic" (top-k children) or "iid"/"iid_without_replacement" with
    `child_probs[u]` the distribution the children of node u were drawn from.
    `levels`: the drafter calls behind it, when fewer than its depth (a lookup branch costs none).
    `carried`: the generation loop's own chain (runtime/backends/tree_layout.py), not the drafter's.
    """

    tokens: list[int]
    probs: np.ndarray | None = None
    tree: Any = None
    mode: str = "deterministic"
    child_probs: Sequence[np.ndarray | None] | None = None
    levels: int | None = None  # drafter calls (levels) it took, when not its depth (extra free branches)
    carried: bool = False  # not proposed by the drafter: the rest of an accepted tree path, verified again as a chain

    @property
    def drafted_levels(self) -> int:
        """Levels the drafter ran to make this draft (what its drafting time is spread over)."""
        return self.depth if self.levels is None else self.levels

    @property
    def depth(self) -> int:
        """Draft positions covered (chain length, or tree depth)."""
        return int(self.tree.max_depth) if self.tree is not None else len(self.tokens)


class Drafter:
    """What every drafter offers the decode loop. The loop calls each hook at a fixed point of a step:

    reset()                 before a new prompt
    plan_with(costs, fresh) once per generation: the controller's relative costs to size trees by (None: off)
    propose(tokens, k)      draft up to k positions (a chain's tokens, a tree's depth) after `tokens`
    record_verdict(...)     after verification: which draft rows were accepted
    observe(hidden, ...)    after every target pass that exposes hidden states: the committed rows' features

    and reads `draft_nodes(k)`, `cheap_proposals`, `plans_tree`, `proposal_key` and `relative_cost` to size
    the draft. The defaults describe a chain drafter that needs none of these hooks.
    """

    name: str = "drafter"
    cheap_proposals: bool = False  # proposing costs ~nothing: the loop asks for the most and keeps what pays
    relative_cost: float = 0.0  # prior cost of drafting one position, in one-token target passes (seeded mode)
    reads_hidden_states: bool = False  # observe() needs the target's hidden states of every row, the prompt's too

    def reset(self) -> None:
        """Forget per-sequence state before a new prompt."""

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Up to `k` draft positions that continue `tokens` (the committed sequence, last one pending)."""
        raise NotImplementedError

    def observe(self, hidden: np.ndarray, row_tokens: list[int], next_token: int | None) -> None:
        """The target's hidden states [m, H] of the rows just committed (prompt chunk, or pending token +
        accepted drafts), their tokens, and the token that follows the last row (None after a prefill chunk
        that is not the last)."""

    def plan_with(self, costs: Callable[[], tuple[float, float]] | None, fresh: bool = False) -> None:
        """Costs to size drafts by: `costs()` -> (extra verify cost of one token, cost of one draft level),
        relative to a one-token pass; None = not adaptive. `fresh`: forget what was learnt (seeded sampling)."""

    @property
    def plans_tree(self) -> bool:
        """True when the drafter sizes its own tree each step (the loop then offers the full depth)."""
        return False

    def draft_nodes(self, k: int) -> int:
        """Draft tokens a proposal of depth k holds (what a pass with k verifies): k for a chain."""
        return k

    @property
    def proposal_key(self) -> Hashable:
        """Reliability class of the last proposal, for per-class acceptance estimates (None: one class)."""
        return None

    def record_verdict(self, draft: Draft, accepted_rows: Sequence[int]) -> None:
        """Verification result of `draft`: the accepted rows (1-based draft nodes, in path order)."""
