"""What a request's output rules (a grammar, logprobs) add to a round of the decode loop, in one place.

    draft, plan = rules.plan(draft)          before the pass: the draft cut where it leaves the grammar; the masks
                                             of its rows start computing on a worker thread (the pass runs meanwhile)
    out = rules.masked(plan, out)            after the pass: each row's logits with the grammar's refused tokens at -inf
    ... verification on `out` as for any request (runtime/sampling.py) ...
    rules.emit(plan, out, rows, tokens)      the grammar advanced over the emitted tokens; their logprobs recorded

Exactness (docs/DESIGN.md, "Constrained decoding"): the target distribution is the masked logits, processed as
plain constrained decoding processes them, and verification runs against it, so greedy output is plain
constrained greedy's and sampled output has the masked target's distribution. A draft token the grammar refuses
has probability 0 there: it would be rejected for certain, and so would everything under it. Those rows are cut
before the pass, except where the rejection itself draws from the drafter's distribution (a sampling draft model's
chain, i.i.d. tree children: the residual max(p - q, 0) needs q): there the refused token keeps its row (never
accepted, its mask is its parent's) and only what hangs below it is cut. Each tree node is checked in the grammar
state of its own path.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .backends.base import StepOutput
from .constraints import CompiledConstraint, Constraint, mask_logits
from .drafters.base import Draft
from .logprobs import LogprobRecorder
from .sampling import SamplingParams
from .tree import TreeSpec

_MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speccompile-grammar-masks")


@dataclass
class GuidedPlan:
    """One round's draft as the grammar left it: `proposed` (the drafter's own), `nodes` (for each row of the cut
    draft, the row of `proposed` it came from), the rows' masks (computing, or None without a grammar)."""

    proposed: Draft
    nodes: list[int]
    masks: Future | None = None

    def drafted_depth(self, cut: Draft) -> int:
        """Positions of the cut draft that the drafter proposed (the grammar's forced tokens excluded)."""
        return cut.depth - self.nodes.count(-1)

    def proposed_rows(self, rows: list[int]) -> list[int]:
        """Rows of the cut draft (1..) as rows of the proposed one, for the drafter's feedback (up to the first
        token the grammar forced: those were not the drafter's)."""
        mapped = [self.nodes[r] for r in rows]
        return mapped[: mapped.index(-1)] if -1 in mapped else mapped


class OutputRules:
    """A generation's grammar state and logprob recorder (either may be absent)."""

    def __init__(self, params: SamplingParams, constraint: CompiledConstraint | None, logprobs: LogprobRecorder | None):
        self.params = params
        self.state: Constraint | None = constraint.new_state() if constraint is not None else None
        self.logprobs = logprobs
        self._pending: Future | None = None  # the mask job touching `state` (nothing else may until it is done)

    # -- the first token ---------------------------------------------------------------------------

    def first_logits(self, logits: np.ndarray) -> np.ndarray:
        """The prompt's last logits as the first token is chosen from them."""
        return logits if self.state is None else mask_logits(logits, self.state.allowed_tokens())

    # -- a round -----------------------------------------------------------------------------------

    def plan(self, draft: Draft, forced_room: int = 0) -> tuple[Draft, GuidedPlan]:
        """The draft cut by the grammar, and the plan whose masks compute on the worker thread. `forced_room`: a
        chain is extended by what the grammar forces after it (`_extend_forced`), up to that many draft tokens in all."""
        self._settle()
        if self.state is None:
            return draft, GuidedPlan(draft, list(range(1 + len(draft.tokens))))
        tokens = [int(t) for t in draft.tokens]
        if draft.tree is None:
            cut, kept, soft_refused = self._cut_chain(draft, tokens)
            nodes = list(range(1 + len(cut.tokens)))
            if not soft_refused and kept < forced_room:
                cut, forced = self._extend_forced(cut, forced_room)
                nodes += [-1] * forced
            plan = GuidedPlan(draft, nodes)
            plan.masks = self._pending = _MASKS.submit(self._chain_masks, cut.tokens[: len(nodes) - 1 - int(soft_refused)],
                                                       soft_refused)
            return cut, plan
        cut, nodes, valid = self._cut_tree(draft, tokens)
        plan = GuidedPlan(draft, nodes)
        plan.masks = self._pending = _MASKS.submit(self._tree_masks, cut, valid)
        return cut, plan

    def masked(self, plan: GuidedPlan, out: StepOutput) -> StepOutput:
        """The pass's output with each row's logits masked by its grammar state (the graph's own argmax dropped)."""
        if plan.masks is None:
            return out
        masks = plan.masks.result()
        self._pending = None
        return dataclasses.replace(out, logits=mask_logits(out.logits, masks), greedy_tokens=None)

    def emit(self, logits_rows: np.ndarray, tokens: list[int], output_tokens: int) -> None:
        """The emitted tokens (a stopping one included), each chosen from its row of `logits_rows` (masked): the
        grammar advances over them; the first `output_tokens` of them (not an ending eos) get logprob entries."""
        self._settle()
        if self.state is not None and self.state.advance(tokens) != len(tokens):
            raise RuntimeError(f"the grammar refused an emitted token of {tokens}: its mask was not applied")
        if self.logprobs is not None:
            for row, token in zip(logits_rows[:output_tokens], tokens[:output_tokens]):
                self.logprobs.record(row, self.params, token)

    def _settle(self) -> None:
        """Wait for a mask job still touching the grammar state (a plan whose pass never ran: it was planned again)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    # -- chains ------------------------------------------------------------------------------------

    def _cut_chain(self, draft: Draft, tokens: list[int]) -> tuple[Draft, int, bool]:
        """(the draft cut after its first refused token's row, tokens the grammar accepts, whether a refused
        token keeps its row: a soft draft distribution's rejection draws its residual)."""
        kept = self.state.advance(tokens)
        self.state.rollback(kept)
        soft = draft.probs is not None and kept < len(tokens) and not self.params.greedy
        end = kept + int(soft)
        if end == len(tokens):
            return draft, kept, soft
        return dataclasses.replace(draft, tokens=tokens[:end], probs=None if draft.probs is None else draft.probs[:end]), kept, soft

    def _extend_forced(self, draft: Draft, room: int) -> tuple[Draft, int]:
        """The chain extended, up to `room` tokens in all, by what the grammar forces after it: the only token its
        state allows (certain), else the forced text as the tokenizer writes it (a guess; where the grammar refuses
        a token of it, the guess ends). Deterministic proposals, so verification is unchanged. (extended, added)"""
        tokens = [int(t) for t in draft.tokens]
        state = self.state
        state.advance(tokens)
        forced: list[int] = []
        while len(tokens) + len(forced) < room and not state.terminated:
            allowed = np.flatnonzero(state.allowed_tokens())
            guess = [int(allowed[0])] if len(allowed) == 1 else state.forced_tokens()
            added = state.advance(guess[: room - len(tokens) - len(forced)])
            if not added:
                break
            forced += guess[:added]
        state.rollback(len(tokens) + len(forced))
        if not forced:
            return draft, 0
        probs = None
        if draft.probs is not None:  # the grammar's tokens are deterministic proposals: one-hot q
            one_hot = np.zeros((len(forced), draft.probs.shape[-1]), dtype=draft.probs.dtype)
            one_hot[np.arange(len(forced)), forced] = 1.0
            probs = np.concatenate([draft.probs, one_hot])
        return dataclasses.replace(draft, tokens=tokens + forced, probs=probs), len(forced)

    def _chain_masks(self, tokens: list[int], soft_refused: bool) -> np.ndarray:
        """The allowed tokens after the pending token and after each accepted draft token (worker thread)."""
        state = self.state
        masks = [state.allowed_tokens().copy()]
        for token in tokens:
            state.advance([token])
            masks.append(self._mask_or(masks[-1]))
        state.rollback(len(tokens))
        if soft_refused:  # the refused token's row: never accepted, any valid mask will do
            masks.append(masks[-1])
        return np.stack(masks)

    def _mask_or(self, fallback: np.ndarray | None) -> np.ndarray:
        """The state's allowed tokens; after a stop token (nothing follows it: the row is never used) `fallback`."""
        if fallback is not None and self.state.terminated:
            return fallback
        return self.state.allowed_tokens().copy()

    # -- trees -------------------------------------------------------------------------------------

    def _cut_tree(self, draft: Draft, tokens: list[int]) -> tuple[Draft, list[int], list[bool]]:
        """The tree without the subtrees the grammar refuses, each node checked in its own path's state; (cut
        draft, proposed node of each kept node, whether each kept node is allowed). Deterministic children that
        are refused go with their subtree; an i.i.d. child keeps its row (its rejection updates the residual)."""
        tree: TreeSpec = draft.tree
        keep_refused = draft.mode != "deterministic" and not self.params.greedy
        kept, valid = [0], [True]

        def visit(node: int) -> None:
            for child in tree.children[node]:
                if self.state.advance([tokens[child - 1]]):
                    kept.append(child)
                    valid.append(True)
                    visit(child)
                    self.state.rollback(1)
                elif keep_refused:
                    kept.append(child)
                    valid.append(False)

        visit(0)
        order = sorted(range(len(kept)), key=lambda i: kept[i])
        kept, valid = [kept[i] for i in order], [valid[i] for i in order]
        if len(kept) == tree.n:
            return draft, kept, valid
        index = {node: i for i, node in enumerate(kept)}
        spec = TreeSpec([-1] + [index[int(tree.parents[n])] for n in kept[1:]], [tree.choice[n] for n in kept])
        child_probs = None if draft.child_probs is None else [draft.child_probs[n] for n in kept]
        cut = dataclasses.replace(draft, tokens=[tokens[n - 1] for n in kept[1:]], tree=spec, child_probs=child_probs)
        return cut, kept, valid

    def _tree_masks(self, draft: Draft, valid: list[bool]) -> np.ndarray:
        """The allowed tokens after each node of the (cut) tree, in its own path's state (worker thread)."""
        tree: TreeSpec = draft.tree
        masks: list[np.ndarray | None] = [None] * tree.n

        def visit(node: int) -> None:
            masks[node] = self._mask_or(masks[int(tree.parents[node])] if node else None)
            for child in tree.children[node]:
                if not valid[child]:
                    masks[child] = masks[node]
                    continue
                self.state.advance([draft.tokens[child - 1]])
                visit(child)
                self.state.rollback(1)

        visit(0)
        return np.stack(masks)
