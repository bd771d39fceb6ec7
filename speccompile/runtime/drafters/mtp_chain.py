"""Chained MTP drafting: the modules of a checkpoint with N MTP modules draft a chain, depth d by module d mod N.

DeepSeek-V3's sequential MTP: at position s, depth d joins depth d-1's output feature h^{d-1}_s (depth 0: the
target's hidden state h_s) with the embedding of token s+d+1, runs its block (attention over its own rows at
positions <= s, RoPE position s) and predicts token s+d+2. So every depth keeps its own KV cache of committed
rows, the rows whose token s+d+1 is known (s <= n-d-1 with tokens[n] pending), fed from the committed outputs of
the depth before it. To draft depth d (token n+d+1) it runs, in one call, its newly committed rows and the d rows
s = n-d .. n-1 whose tokens are the drafts d_1 .. d_d (causal, kept as dead slots: a rejected draft costs
nothing to drop); the last row's argmax is the next draft. Depth 0 is the head drafter's own cache (module 0,
`HeadDrafter`). Past N modules, depth d reuses module d mod N with a cache of its own, as vLLM's MTP models pick
`spec_step_idx % num_mtp_layers`. A depth that falls behind (drafted late or again after an adaptive k shrank)
skips to the oldest output the depth before it still holds (its last `KEEP_UNREAD` rows): fewer context rows,
the same exactness. Drafts are deterministic (argmax): verification is exact in greedy and
sampled decoding alike (a one-hot proposal). Trees (static or dynamic) are drafted by module 0 alone, as
`HeadDrafter` does for a single module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..kvcache import causal_mask
from .base import Draft, GenerationStart
from .eagle import HeadDrafter

if TYPE_CHECKING:
    from ..adaptive import Sizing


KEEP_UNREAD = 256  # outputs the deepest depth keeps for a deeper one drafted later (its cache starts there)


class _Depth:
    """One depth of the chain past depth 0: its module's session, its cache of committed rows (rows 0..fed-1) and
    the committed outputs of rows base..fed-1 (what the next depth reads)."""

    def __init__(self, session, hidden_size: int, start: int = 0):
        self.session = session
        self.cache = session.new_cache()
        self.cache.max_dead = 256
        self.fed = start  # a depth first drafted late starts at the oldest output the depth before it still holds
        self.base = start
        self.outs = np.zeros((0, hidden_size), np.float32)

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Committed outputs of rows lo..hi-1."""
        return self.outs[lo - self.base: hi - self.base]

    def keep_from(self, row: int) -> None:
        """Forget the outputs of rows before `row` (the next depth has read them)."""
        if row > self.base:
            self.outs = self.outs[row - self.base:]
            self.base = row


class MTPChainDrafter(HeadDrafter):
    """A chain drafted by N chained MTP modules (`modules`: the sessions of modules 1..N-1; module 0 is `session`)."""

    def __init__(self, session, modules: list, *args, **kwargs):
        self.modules = list(modules)
        super().__init__(session, "mtp", *args, **kwargs)

    def start(self, start: GenerationStart) -> None:
        super().start(start)
        self.depths: list[_Depth] = []
        self.outs0 = _Depth(self.session, self.hidden_size)  # depth 0's committed outputs (its cache: HeadDrafter's)

    def _sync(self, tokens: list[int]) -> bool:
        before = self.fed
        ok = super()._sync(tokens)
        if self.fed > before:  # module 0 fed rows before..fed-1: keep their outputs for depth 1
            self.outs0.outs = np.concatenate([self.outs0.outs, self.fed_outputs])
            self.outs0.fed = self.fed
        return ok

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        if self.dynamic:
            return super().propose(tokens, sizing)
        spec = self.static_trees.for_round(sizing)
        if not spec.is_chain:
            return super().propose(tokens, sizing)
        k = spec.n - 1
        if k <= 0 or not self._sync(tokens):
            return Draft([])
        n = len(tokens) - 1
        drafts = [int(np.argmax(self.root_logits))]
        prev, prev_draft = self.outs0, np.zeros((0, self.hidden_size), np.float32)
        for d in range(1, k):
            if len(self.depths) < d:
                module = d % (len(self.modules) + 1)  # module 0 is `session`
                self.depths.append(_Depth(self.modules[module - 1] if module else self.session, self.hidden_size,
                                          start=prev.base))
            depth = self.depths[d - 1]
            logits, prev_draft = self._run_depth(depth, prev, prev_draft, tokens, drafts, n, d)
            drafts.append(int(np.argmax(logits)))
            prev = depth
        for i, ran in enumerate([self.outs0, *self.depths[:k - 1]]):  # keep what the next depth has yet to read,
            reader = self.depths[i].fed if i < len(self.depths) else 0  # at most the last KEEP_UNREAD rows
            ran.keep_from(max(reader, ran.fed - KEEP_UNREAD))
        return Draft(drafts)

    def _run_depth(self, depth: _Depth, prev: _Depth, prev_draft: np.ndarray, tokens: list[int], drafts: list[int],
                   n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
        """Depth d's call: its committed rows fed..n-d-1 and its draft rows n-d..n-1 (from row 0 at most, from the
        depth before's oldest held row at least); (the last row's logits, the draft rows' outputs)."""
        if depth.fed < prev.base:  # rows the depth before no longer holds are skipped (its own outputs restart)
            depth.fed = depth.base = prev.base
            depth.outs = depth.outs[:0]
        first = max(n - d, depth.fed)
        ids = [tokens[s + d + 1] for s in range(depth.fed, first)] + [drafts[s + d - n] for s in range(first, n)]
        rows = np.concatenate([prev.outs, prev_draft])  # the depth before's outputs of rows prev.base .. n-1
        hidden = rows[depth.fed - prev.base: n - prev.base].astype(np.float32)
        q, c = len(ids), first - depth.fed
        cache = depth.cache
        cache.maybe_compact(q, self.max_context)
        mask = cache.attention_mask(causal_mask(q))
        out = depth.session.run(np.asarray(ids), np.arange(depth.fed, n), mask, cache, hidden_states=hidden)
        cache.append(out.presents, range(c), q)
        depth.outs = np.concatenate([depth.outs, out.hidden[:c]])
        depth.fed = first
        return out.logits[-1], out.hidden[c:]
