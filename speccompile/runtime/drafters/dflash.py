"""DFlash block drafting: one drafter pass proposes a whole block (docs/DESIGN.md, "DFlash: a block drafter").

The drafter keeps a KV cache of *context* rows only: the target's tap features of every committed position,
projected by each draft layer. `observe` collects the features of the rows each target pass commits;
`propose` runs one pass over the block [pending token, mask, ..., mask] at positions n..n+B-1 with the
context rows not yet cached (positions fed..n-1) and appends those rows to the cache; the block's own rows are
never cached, so a rejected draft costs nothing to drop.

The pass yields one distribution q_j per drafted position j, all computed from the same context (the block's
mask tokens do not depend on the drafted tokens). Greedy: draft tokens are the argmax of each q_j (a
deterministic proposal, verified as one-hot). Sampling: x_j is drawn from q_j (the target's sampling
processing applied to the drafter's logits), independently per position, and q_j goes to the verifier: the
proposal is the product of the q_j, so q_j is the conditional of x_j given x_<j and the standard chain rule
(accept x_j with min(1, p_j / q_j), else sample the residual) is exact position by position.

DSpark's vanilla Markov head (`markov`: W1, W2) adds W2 W1[x_{j-1}] to position j's logits (x_{-1}: the pending
token), so a chain is drawn token by token and q_j is x_j's distribution given the drafts before it: the same
chain rule stays exact. A tree ranks the block's logits without that bias (deterministic picks: exact).

With a static tree (`--tree`), the children at depth d are the top-ranked tokens of position d (a child of
choice c: the c-th most likely), the same for every parent: deterministic picks, verified as the heads' trees
are (exact under greedy and sampling alike); the tree's planner trims it each round as for the heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..sampling import process_logits, sample
from ..timing import TimedSession
from ...draft_config import DraftConfig
from .base import Draft, DrafterRequest, GenerationStart, Observation
from .eagle import _top
from .static_tree import StaticTrees, StaticTreeDrafter

if TYPE_CHECKING:
    from ..adaptive import Sizing


class DFlashBlockDrafter(StaticTreeDrafter):
    """Chain (or static tree) drafting of up to `drafts_per_block` positions per step, one graph call per step."""

    name = "dflash"
    relative_cost = 0.02  # prior cost of one drafted position in target passes (one pass drafts the block)
    reads_hidden_states = True

    def __init__(self, session, head: dict, num_draft_tokens: int, draft_to_target: np.ndarray | None = None,
                 max_context: int = 1 << 20, tree: DraftConfig | None = None, max_nodes: int = 64,
                 markov: tuple[np.ndarray, np.ndarray] | None = None):
        self.session = session
        self.markov = markov  # DSpark's Markov head (W1 [target vocab, r], W2 [draft vocab, r]): `_markov_chain`
        self.block_size = int(head["block_size"])
        self.mask_token_id = int(head["mask_token_id"])
        self.drafts_per_block = self.block_size if head.get("sample_from_anchor") else self.block_size - 1
        self.num_draft_tokens = max(0, min(int(num_draft_tokens), self.drafts_per_block))
        self.target_vocab = int(head["target_vocab_size"])
        self.d2t = draft_to_target
        self.max_context = max_context
        self.passes = 0  # drafter graph calls (one per proposed block)
        self.draft_config = tree
        self.static_trees = StaticTrees(tree.choices, max_nodes) if tree is not None and tree.choices else None
        self.start(GenerationStart())

    def start(self, start: GenerationStart) -> None:
        super().start(start)
        self.params = start.sampling  # the generation's settings and its own generator
        self.rng = start.rng if start.rng is not None else np.random.default_rng(0)
        self.cache = self.session.new_cache()
        self.fed = 0  # context rows cached (positions 0 .. fed-1)
        self.pending: list[np.ndarray] = []  # target features of positions fed .. observed-1
        self.observed = 0

    def observe(self, observation: Observation) -> None:
        super().observe(observation)  # the verdict, to the tree planner
        if observation.hidden is not None:
            self.pending.append(np.asarray(observation.hidden))
            self.observed += len(observation.hidden)

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        n = len(tokens) - 1  # the pending token's position
        if self.static_trees is not None:
            return self._propose_tree(tokens, sizing)
        k = min(sizing.choose_k(), self.num_draft_tokens)
        if k <= 0 or n < 1 or self.observed != n:
            return Draft([])
        logits = self._block(tokens[-1], n)[:k]
        if self.markov is not None:
            return self._markov_chain(logits, tokens[-1])
        if self.params.greedy:
            return Draft([int(t) for t in self._to_target(np.argmax(logits, axis=-1))], levels=1)
        q = process_logits(self._in_target_vocab(logits), self.params)
        drafted = [sample(row, self.rng) for row in q]
        return Draft(drafted, q, levels=1)

    def _markov_chain(self, logits: np.ndarray, previous: int) -> Draft:
        """DSpark's Markov head: position j's logits get the bias W2 W1[x_{j-1}] (x_{-1}: the pending token), so
        the chain is drawn token by token, q_j the distribution given the drafts before it (exact as a chain)."""
        w1, w2 = self.markov
        drafted, rows = [], []
        for base in logits:
            row = base + w2 @ w1[previous]
            if self.params.greedy:
                previous = int(self._to_target(np.array([int(np.argmax(row))]))[0])
            else:
                rows.append(process_logits(self._in_target_vocab(row[None]), self.params)[0])
                previous = sample(rows[-1], self.rng)
            drafted.append(int(previous))
        return Draft(drafted, np.stack(rows) if rows else None, levels=1)

    def _propose_tree(self, tokens: list[int], sizing: "Sizing") -> Draft:
        """The round's static tree, node tokens ranked per depth from one block pass."""
        n = len(tokens) - 1
        spec = self.static_trees.for_round(sizing, min(self.num_draft_tokens, self.drafts_per_block))
        if spec.n <= 1 or n < 1 or self.observed != n:
            return Draft([])
        logits = self._block(tokens[-1], n)
        ranked = {}
        nodes = []
        for u in range(1, spec.n):
            d = int(spec.depths[u]) - 1
            if d not in ranked:
                width = int(max(spec.choice[v] for v in range(1, spec.n) if spec.depths[v] == d + 1)) + 1
                ranked[d] = self._to_target(_top(logits[d], width))
            nodes.append(int(ranked[d][spec.choice[u]]))
        if spec.is_chain:
            return Draft(nodes, levels=1)
        return Draft(nodes, tree=spec, mode="deterministic", levels=1)

    def _block(self, pending: int, n: int) -> np.ndarray:
        """One pass: cache the new context rows, return the logits of the drafted positions [drafts, V_draft]."""
        new = n - self.fed
        feats = np.concatenate(self.pending, axis=0)[-new:] if new else np.zeros((0, self._aux_width()), np.float32)
        cache = self.cache
        cache.maybe_compact(new, self.max_context)
        ids = np.full(self.block_size, self.mask_token_id, dtype=np.int64)
        ids[0] = pending
        live = np.broadcast_to(cache.live, (self.block_size, cache.physical_len))
        mask = np.concatenate([live, np.ones((self.block_size, new + self.block_size), dtype=bool)], axis=1)[None]
        out = self.session.run(ids, np.arange(n, n + self.block_size), mask, cache, aux_hidden_states=feats)
        cache.append(out.presents, range(new), new)
        self.fed, self.pending = n, []
        self.passes += 1
        return out.logits

    def _aux_width(self) -> int:
        spec = next(t for t in self.session.spec.inputs if t.name == "aux_hidden_states")
        return int(spec.shape[-1])

    def _to_target(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.d2t is None else self.d2t[ids]

    def _in_target_vocab(self, logits: np.ndarray) -> np.ndarray:
        """Draft-vocabulary logits placed in the target vocabulary (tokens outside it: -inf)."""
        if self.d2t is None:
            return logits
        full = np.full((logits.shape[0], self.target_vocab), -np.inf, dtype=np.float32)
        full[:, self.d2t] = logits
        return full


def make_dflash(request: DrafterRequest) -> DFlashBlockDrafter:
    """The artifact's DFlash drafter (its int8/int4 CPU variant on ort-cpu); each generation hands it its sampling
    settings and generator (`Drafter.start`)."""
    artifact = request.artifact
    section = request.exported_section()
    session = TimedSession(artifact.session(section.get("graph", "dflash"), request.shared_session), request.clock)
    name = section.get("draft_to_target")
    d2t = np.load(Path(artifact.directory) / name, allow_pickle=False).astype(np.int64) if name else None
    tree = request.draft if request.draft.choices else None
    markov = section.get("markov")
    if markov:
        markov = tuple(np.load(Path(artifact.directory) / markov[w], allow_pickle=False) for w in ("w1", "w2"))
    return DFlashBlockDrafter(session, section["head"], request.draft.num_draft_tokens, d2t,
                              max_context=artifact.max_context + 64, tree=tree, max_nodes=artifact.verify_rows,
                              markov=markov or None)
