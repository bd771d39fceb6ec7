"""The lookup branch: the n-gram continuation merged into a head drafter's tree (hand-checked trees)."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.runtime.adaptive import AdaptiveController, Sizing
from speccompile.runtime.drafters.base import Draft, Drafter, GenerationStart, Observation
from speccompile.runtime.drafters.lookup_branch import LookupBranchDrafter
from speccompile.runtime.tree import TreeSpec

# tree-2x2 of a fake head: node 1 = 7 (rank 0), node 2 = 8 (rank 1), node 3 = 9 (under 7), node 4 = 10 (under 8)
HEAD_TREE = TreeSpec.from_choices([[0], [1], [0, 0], [1, 0]])
HEAD_TOKENS = [7, 8, 9, 10]
# "5 6" occurred before, followed by 7 9 11 12: the lookup proposes [7, 9, 11, 12] (k = 4)
HISTORY = [5, 6, 7, 9, 11, 12, 13, 5, 6]


class FixedTreeHead(Drafter):
    """A deterministic drafter that always proposes the same tree (or nothing); records its verdicts."""

    name = "fake"

    def __init__(self, empty: bool = False):
        self.empty = empty
        self.verdicts: list[list[int]] = []

    def propose(self, tokens: list[int], sizing: Sizing) -> Draft:
        return Draft([]) if self.empty else Draft(list(HEAD_TOKENS), tree=HEAD_TREE, mode="deterministic")

    def observe(self, observation: Observation) -> None:
        if observation.draft is not None:
            self.verdicts.append(list(observation.accepted_rows))


def test_lookup_chain_walks_the_head_tree_then_branches():
    head = FixedTreeHead()
    drafter = LookupBranchDrafter(head, max_nodes=16)
    draft = drafter.propose(HISTORY, Sizing(4))
    # 7 and 9 are the head's nodes 1 and 3; 11 and 12 hang below node 3 as new nodes 5 and 6
    assert draft.tokens == [7, 8, 9, 10, 11, 12]
    assert draft.tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 5]
    assert draft.mode == "deterministic" and draft.depth == 4 and draft.drafted_levels == 2
    # verdict: 7, 9, 11 accepted -> the head hears about its rows only; the lookup rate (match length 2)
    # moves from the 0.5 prior toward 3 accepted of 4 tried: weight min(1, 2 * 0.08 * 4) = 0.64
    drafter.observe(Observation(draft=draft, accepted_rows=[1, 3, 5]))
    assert head.verdicts == [[1, 3]]
    assert drafter.rates.observed[2] == pytest.approx(0.36 * 0.5 + 0.64 * 0.75)


def test_lookup_branch_sized_by_acceptance_and_verify_cost():
    head = FixedTreeHead()
    drafter = LookupBranchDrafter(head, probe_every=3)
    # seeded-mode costs: a pass over q tokens costs 1 + 0.06 (q - 1) one-token passes
    adaptive = AdaptiveController(num_draft_tokens=4, deterministic=True).sizing(4)
    drafter.rates.observed[2] = 0.1  # 0.1^1 >= 0.06 > 0.1^2: one new token pays
    draft = drafter.propose(HISTORY, adaptive)
    assert draft.tokens == [7, 8, 9, 10, 11]
    drafter.rates.observed[2] = 0.01  # nothing pays: the head's own draft, untouched ...
    for _ in range(2):
        assert drafter.propose(HISTORY, adaptive).tokens == HEAD_TOKENS
    assert drafter.propose(HISTORY, adaptive).tokens == [7, 8, 9, 10, 11]  # ... until a one-token probe
    drafter.start(GenerationStart(fresh=True))  # seeded sampling: rates start afresh
    assert drafter.rates.observed == {}


def test_lookup_alone_when_the_head_skips():
    head = FixedTreeHead(empty=True)
    drafter = LookupBranchDrafter(head)
    draft = drafter.propose(HISTORY, Sizing(4))
    assert draft.tree is None and draft.tokens == [7, 9, 11, 12] and draft.drafted_levels == 0
    drafter.observe(Observation(draft=draft, accepted_rows=[1, 2]))
    assert head.verdicts == [] and 2 in drafter.rates.observed  # the head drafted nothing: nothing to tell its planner
    # a head tree of max_nodes nodes leaves no room: the lookup adds nothing
    full = LookupBranchDrafter(FixedTreeHead(), max_nodes=HEAD_TREE.n)
    assert full.propose(HISTORY, Sizing(4)).tokens == HEAD_TOKENS


def test_soft_drafts_are_left_alone():
    class SampledChain(FixedTreeHead):
        def propose(self, tokens, sizing):
            return Draft([7, 9], probs=np.full((2, 16), 1 / 16))

    drafter = LookupBranchDrafter(SampledChain())
    assert drafter.propose(HISTORY, Sizing(4)).tokens == [7, 9]
