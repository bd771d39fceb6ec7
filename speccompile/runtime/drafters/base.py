"""What a drafter gives the generation loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

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
    """

    tokens: list[int]
    probs: np.ndarray | None = None
    tree: Any = None
    mode: str = "deterministic"
    child_probs: Sequence[np.ndarray | None] | None = None
    levels: int | None = None  # drafter calls (levels) it took, when not its depth (extra free branches)

    @property
    def drafted_levels(self) -> int:
        """Levels the drafter ran to make this draft (what its drafting time is spread over)."""
        return self.depth if self.levels is None else self.levels

    @property
    def depth(self) -> int:
        """Draft positions covered (chain length, or tree depth)."""
        return int(self.tree.max_depth) if self.tree is not None else len(self.tokens)


class ChainDrafter(Protocol):
    """Proposes up to `k` tokens that continue `tokens` (the committed sequence, last one pending)."""

    name: str

    def propose(self, tokens: list[int], k: int) -> Draft:
        ...

    def reset(self) -> None:
        """Forget per-sequence state before a new prompt."""

    # Optional: drafters that read the target's hidden states define
    #   observe(hidden: np.ndarray [m, H], row_tokens: list[int], next_token: int | None) -> None
    # It is called after every target pass with the rows that were committed (prompt chunk, or
    # pending token + accepted drafts), their tokens, and the token that follows the last row
    # (None after a prefill chunk that is not the last).
