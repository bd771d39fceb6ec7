"""A tree verify pass laid out main path first, and which of its rows are then computed as plain decoding.

A row's logits equal plain decoding's bit for bit only when its keys sit where plain decoding puts them:
its ancestors in the slots right before it. In a tree pass that holds for the nodes of one root-to-leaf
path laid out first (the main path); a node after a sibling sees its ancestors with a masked hole in
between, and attention kernels that reduce over the key axis in lanes or blocks then round differently.
Sessions that compute a chain's rows as plain decoding does (the fused CPU graph, `Session.row_invariant`;
the shape-invariant wrapper on GPUs) run a tree main path first, mark those rows `plain_exact`, and the
verification cuts a verdict at the first accepted node off the main path (`verification.exact_acceptance`): that
node's token is still exact (chosen from its parent's exact logits) and is emitted, its logits and KV row
are not used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .base import StepOutput


def main_path_first(ancestry: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row order that lays a tree's main path out first, and which rows are then computed exactly as
    plain decoding would (the main path's: each row's ancestors sit in the slots right before it).

    Main path: root to the deepest node (the first in row order among equally deep ones, i.e. the
    highest-ranked choices of a tree in (depth, choice) order; the n-gram lookup branch when it reaches
    deeper than the head's tree). A chain: the identity and every row exact."""
    q = ancestry.shape[0]
    if np.array_equal(ancestry, np.tril(np.ones((q, q), dtype=bool))):
        return np.arange(q), np.ones(q, dtype=bool)
    depth = ancestry.sum(axis=1)
    leaf = int(np.argmax(depth))  # first of the deepest
    main = sorted(np.flatnonzero(ancestry[leaf]).tolist(), key=lambda r: depth[r])
    exact = np.zeros(q, dtype=bool)
    exact[main] = True
    return np.array(main + [r for r in range(q) if not exact[r]], dtype=np.int64), exact


@dataclass(frozen=True)
class MainPathLayout:
    """The pass order of a verify pass's q new rows (`order[i]`: the original row computed as pass row i)."""

    order: np.ndarray
    exact: np.ndarray  # [q] per original row: computed as plain decoding

    @classmethod
    def of(cls, attention_mask: np.ndarray, q: int) -> "MainPathLayout":
        """From a pass's mask [1, q, T] whose last q columns are the new rows' own (causal or tree) mask."""
        width = int(attention_mask.shape[-1])
        return cls(*main_path_first(np.asarray(attention_mask)[0, :, width - q:]))

    @classmethod
    def of_tree(cls, attention_mask: np.ndarray, q: int) -> "MainPathLayout | None":
        """`of`, or None when the new rows are a chain (every row already computed as plain decoding)."""
        layout = cls.of(attention_mask, q) if q > 1 else None
        return None if layout is None or layout.is_chain else layout

    @property
    def is_chain(self) -> bool:
        return bool(self.exact.all())

    def rows(self, values: np.ndarray) -> np.ndarray:
        """Per-row inputs (ids, positions) in pass order."""
        return np.asarray(values).reshape(-1)[self.order]

    def mask(self, attention_mask: np.ndarray) -> np.ndarray:
        """The mask with its new rows and their columns in pass order (the committed columns unchanged)."""
        width, q = int(attention_mask.shape[-1]), len(self.order)
        columns = np.concatenate([np.arange(width - q), width - q + self.order])
        return attention_mask[:, self.order][:, :, columns]

    def restore(self, out: StepOutput, cache) -> StepOutput:
        """The pass's outputs back in the original row order, `plain_exact` set; the cache is told where each
        row's KV went (`row_slots`, read by its next commit)."""
        q = len(self.order)
        slots = np.argsort(self.order)  # original row r was computed as pass row slots[r]
        cache.row_slots = None if np.array_equal(self.order, np.arange(q)) else slots
        hidden = out.hidden[:q][slots] if out.hidden is not None else None
        greedy = out.greedy_tokens[:q][slots] if out.greedy_tokens is not None else None
        return dataclasses.replace(out, logits=out.logits[:q][slots], hidden=hidden, greedy_tokens=greedy,
                                   plain_exact=self.exact)
