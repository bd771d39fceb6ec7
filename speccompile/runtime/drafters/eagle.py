"""EAGLE-1/2, EAGLE-3 and MTP drafting: an autoregressive head over the target's hidden states.

Row t of the head pairs the target feature of position t (final hidden state, or EAGLE-3's fused
taps) with the token at position t+1, at RoPE position t. The head keeps its own KV cache of
*committed* rows: after every target pass `observe` hands over the features of the rows the target
committed; `propose` feeds the rows whose next token is now known (the last one pairs with the
pending token) in one call, which also yields the first draft distribution. Draft rows (chain steps
or tree nodes) are appended to the head cache as dead slots that only their descendants see through
an explicit mask, so they are dropped for free; the head cache is compacted like the target's.

Trees: a static tree (choice paths, child of rank r = the parent's r-th most likely token) is drafted
level by level, one head call per level; a dynamic tree (EAGLE-2) is grown with
`runtime.tree.build_dynamic_tree` (top-k frontier expansion by cumulative log-probability, then the
best `total_tokens` nodes). Children are deterministic picks, so verification is exact in
"deterministic" mode under greedy and sampling alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...draft_config import DraftConfig
from ..kvcache import causal_mask
from ..tree import TreeSpec, build_dynamic_tree
from .base import Draft, GenerationStart, Observation
from .static_tree import StaticTreeDrafter, StaticTrees

if TYPE_CHECKING:
    from ..adaptive import Sizing


def _top(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries, largest first (ties: lower index first)."""
    k = min(k, logits.shape[-1])
    if k == 1:
        return np.array([int(np.argmax(logits))])
    part = np.argpartition(-logits, k - 1)[:k]
    return part[np.lexsort((part, -logits[part]))]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class HeadDrafter(StaticTreeDrafter):
    """Chain / static tree / dynamic tree drafting with an EAGLE, EAGLE-3 or MTP head graph.

    `draft` is the tree to draft (a static or dynamic DraftConfig); `max_nodes` bounds the verified tree (the target's max_verify_tokens). `draft_to_target` maps
    a draft-vocabulary id to a target id (EAGLE-3); None = same vocabulary.
    """

    reads_hidden_states = True

    def __init__(self, session, kind: str, draft: DraftConfig, max_nodes: int = 64,
                 draft_to_target: np.ndarray | None = None, hidden_size: int | None = None,
                 max_context: int = 1 << 20):
        self.session = session
        self.name = kind
        self.kind = kind
        self.max_nodes = max(2, int(max_nodes))
        self.d2t = draft_to_target
        inputs = {t.name: t for t in session.spec.inputs}
        self.hidden_size = int(inputs["hidden_states"].shape[-1]) if hidden_size is None else hidden_size
        self._aux_size = int(inputs["aux_hidden_states"].shape[-1]) if "aux_hidden_states" in inputs else 0
        self.max_context = max_context
        self.set_tree(draft)
        self.start(GenerationStart())

    # -- configuration ------------------------------------------------------------------------

    def set_tree(self, draft: DraftConfig) -> None:
        """Draft this tree from now on (a static tree, a head's chain, or a dynamic tree)."""
        self.draft_config = draft
        self.dynamic = draft.dynamic is not None
        self.static_trees = None if self.dynamic else StaticTrees(draft.choices, self.max_nodes)

    def _dynamic_nodes(self, k: int) -> int:
        """Draft tokens a dynamic tree of depth k holds at most (what a pass with k verifies, for the controller)."""
        depth, top_k, total, _ = self._dynamic_params(k)
        return max(1, min(total, top_k + (depth - 1) * top_k * top_k))

    def _dynamic_params(self, k: int) -> tuple[int, int, int, float]:
        """(depth, top_k, total_tokens, min_prob) of the dynamic tree drafted at most k levels deep."""
        dyn = self.draft_config.dynamic
        depth = max(1, min(dyn.depth, k))
        total = max(1, min(dyn.total_tokens, self.max_nodes - 1))
        return depth, dyn.top_k, total, dyn.min_prob

    # -- state --------------------------------------------------------------------------------

    def start(self, start: GenerationStart) -> None:
        super().start(start)
        self.cache = self.session.new_cache()
        self.cache.max_dead = 256
        self.fed = 0  # committed head rows (pairs t = 0 .. fed-1)
        self.pending: list[np.ndarray] = []  # target features of positions fed .. observed-1
        self.observed = 0
        self.root_logits: np.ndarray | None = None
        self.root_hidden: np.ndarray | None = None

    def observe(self, observation: Observation) -> None:
        super().observe(observation)  # the verdict, to the tree planner
        if observation.hidden is not None:
            self.pending.append(np.asarray(observation.hidden))
            self.observed += len(observation.hidden)

    def _run(self, ids, positions, hidden=None, aux=None, visible_slots=None, committed=False):
        """One head call; committed rows become live cache rows, draft rows dead slots."""
        q = len(ids)
        cache = self.cache
        if committed:
            mask = cache.attention_mask(causal_mask(q))
        else:
            past = np.broadcast_to(cache.live, (q, cache.physical_len)).copy()
            for row, slots in enumerate(visible_slots):
                past[row, slots] = True
            mask = np.concatenate([past, np.eye(q, dtype=bool)], axis=1)[None]
        extra = {}
        width = self.hidden_size
        if self.kind == "eagle3":
            extra["aux_hidden_states"] = aux if aux is not None else np.zeros((q, self.aux_size), np.float32)
            extra["hidden_states"] = hidden if hidden is not None else np.zeros((q, width), np.float32)
        else:
            extra["hidden_states"] = hidden
        out = self.session.run(np.asarray(ids), np.asarray(positions), mask, cache, **extra)
        start = cache.physical_len
        cache.append(out.presents, range(q) if committed else [], q)
        return out.logits, out.hidden, np.arange(start, start + q)

    @property
    def aux_size(self) -> int:
        return self._aux_size

    def _sync(self, tokens: list[int]) -> bool:
        """Feed committed rows up to the pending token; False when the observed features do not line up."""
        n = len(tokens) - 1
        if self.observed != n or n < 1:
            return False
        if self.fed < n:
            feats = np.concatenate(self.pending, axis=0)[-(n - self.fed):]
            self.cache.maybe_compact(n - self.fed, self.max_context)
            ids = tokens[self.fed + 1: n + 1]
            pos = np.arange(self.fed, n)
            if self.kind == "eagle3":
                logits, hidden, _ = self._run(ids, pos, aux=feats, committed=True)
            else:
                logits, hidden, _ = self._run(ids, pos, hidden=feats, committed=True)
            self.fed = n
            self.fed_outputs = hidden  # the fed rows' draft_hidden_states (a chained MTP's depth 1 reads them)
            self.pending = []
            self.root_logits, self.root_hidden = logits[-1], hidden[-1]
        else:
            self.cache.maybe_compact(0, self.max_context)
        return self.root_logits is not None

    def _to_target(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.d2t is None else self.d2t[ids]

    # -- drafting -----------------------------------------------------------------------------

    def propose(self, tokens: list[int], sizing: "Sizing") -> Draft:
        # a static tree is planned before the head runs: a step the planner skips costs no head call (the
        # committed rows are fed on the next drafting step, in one call)
        if self.dynamic:
            spec, k = None, sizing.choose_k(nodes=self._dynamic_nodes)
        else:
            spec, k = self.static_trees.for_round(sizing), sizing.room
        if k <= 0 or (spec is not None and spec.n <= 1) or not self._sync(tokens):
            return Draft([])
        n = len(tokens) - 1
        if spec is None:
            return self._propose_dynamic(tokens[-1], n, k)
        node_tokens = self._draft_static(spec, tokens[-1], n)
        if spec.is_chain:
            return Draft([int(t) for t in node_tokens[1:]])
        return Draft([int(t) for t in node_tokens[1:]], tree=spec, mode="deterministic")

    def _draft_static(self, spec: TreeSpec, pending: int, n: int) -> list[int]:
        node_tok = [pending] + [0] * (spec.n - 1)
        logits = {0: self.root_logits}
        hidden = {0: self.root_hidden}
        slot = {0: None}
        for d in range(spec.max_depth):
            parents = [u for u in range(spec.n) if spec.depths[u] == d and spec.children[u]]
            to_run = [u for u in parents if u != 0]
            if to_run:
                vis = [[slot[a] for a in spec.ancestors(u, include_self=False) if a != 0] for u in to_run]
                lg, hd, slots = self._run(
                    [node_tok[u] for u in to_run],
                    [n - 1 + d] * len(to_run),
                    hidden=np.stack([hidden[int(spec.parents[u])] for u in to_run]),
                    visible_slots=vis,
                )
                for i, u in enumerate(to_run):
                    logits[u], hidden[u], slot[u] = lg[i], hd[i], int(slots[i])
            for u in parents:
                kids = spec.children[u]
                order = self._to_target(_top(logits[u], int(max(spec.choice[c] for c in kids)) + 1))
                for c in kids:
                    node_tok[c] = int(order[spec.choice[c]])
        return node_tok

    def _propose_dynamic(self, pending: int, n: int, k: int) -> Draft:
        depth, top_k, total, min_prob = self._dynamic_params(k)
        state: dict[int, tuple[np.ndarray, np.ndarray, int | None]] = {0: (self.root_logits, self.root_hidden, None)}

        def expand(frontier: np.ndarray, tree) -> tuple[np.ndarray, np.ndarray]:
            todo = [int(i) for i in frontier if int(i) not in state]
            if todo:
                vis = [[state[a][2] for a in tree.ancestors(i) if a != 0] for i in todo]
                lg, hd, slots = self._run(
                    [tree.tokens[i] for i in todo],
                    [n - 1 + tree.depths[i] for i in todo],
                    hidden=np.stack([state[tree.parents[i]][1] for i in todo]),
                    visible_slots=vis,
                )
                for j, i in enumerate(todo):
                    state[i] = (lg[j], hd[j], int(slots[j]))
            toks = np.zeros((len(frontier), top_k), dtype=np.int64)
            lps = np.zeros((len(frontier), top_k), dtype=np.float64)
            for r, i in enumerate(frontier):
                lg = state[int(i)][0]
                idx = _top(lg, top_k)
                toks[r] = self._to_target(idx)
                lps[r] = _log_softmax(lg)[idx]
            return toks, lps

        spec, node_tokens = build_dynamic_tree(expand, depth, top_k, total, pending, min_prob)
        if spec.n <= 1:
            return Draft([])
        if spec.is_chain:
            return Draft([int(t) for t in node_tokens[1:]])
        return Draft([int(t) for t in node_tokens[1:]], tree=spec, mode="deterministic")


def load_draft_to_target(directory: Path, name: str | None) -> np.ndarray | None:
    if not name:
        return None
    return np.load(Path(directory) / name, allow_pickle=False).astype(np.int64)
