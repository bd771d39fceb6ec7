"""The static-tree planner: which nodes of an exported tree are worth verifying, from measured acceptance."""

import pytest

from speccompile.runtime.costs import FixedCosts, best_prefix
from speccompile.runtime.drafters.base import Draft
from speccompile.runtime.tree import TreeSpec
from speccompile.runtime.tree_planner import TreePlanner, drafted_spec

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def line(slope: float) -> FixedCosts:
    """Pass costs in one-token passes: a pass over q tokens costs 1 + slope (q - 1)."""
    return FixedCosts(1.0, slope)


def planner_with(rates, **kw):
    p = TreePlanner(TREE, max_nodes=64, probe_every=1000, **kw)
    p.rates.observed.update({tuple(k): v for k, v in rates.items()})
    return p


RATES = {(0,): 0.8, (1,): 0.1, (2,): 0.01, (0, 0): 0.6, (0, 1): 0.05, (1, 0): 0.05, (0, 0, 0): 0.45}


def test_plan_keeps_the_nodes_that_pay():
    p = planner_with(RATES)
    # s = 0.06: a node pays when its rate beats ~s * tokens-per-pass (~0.17 here): the 0-0-0 chain
    assert sorted(p.plan(3, line(0.06), 0.0).choices()) == [[0], [0, 0], [0, 0, 0]]
    # verifying is free (a GPU): the whole depth-3 tree
    assert p.plan(3, line(0.0), 0.0).n == len(TREE) + 1
    # depth limit: nothing deeper than k
    assert sorted(p.plan(2, line(0.06), 0.0).choices()) == [[0], [0, 0]]
    # verifying costs as much as a pass per token: draft nothing
    assert p.plan(3, line(1.0), 0.0).n == 1
    # a costly draft level trims depth first
    assert sorted(p.plan(3, line(0.06), 0.5).choices()) == [[0]]


def test_plan_is_ancestor_closed_even_when_a_child_rates_higher():
    p = planner_with({**RATES, (1,): 0.02, (1, 0): 0.9})  # inconsistent stats: capped by the parent
    assert [1, 0] not in p.plan(3, line(0.06), 0.0).choices()


def test_record_moves_rates_toward_what_was_accepted():
    p = planner_with(RATES, alpha=0.5)
    spec = TreeSpec.from_choices([[0], [1], [0, 0]])  # nodes 1: [0], 2: [1], 3: [0, 0]
    p.record(spec, [1, 3])  # accepted path: [0] then [0, 0]
    assert p.rates.observed[(0,)] == pytest.approx(0.9) and p.rates.observed[(0, 0)] == pytest.approx(0.8)
    assert p.rates.observed[(1,)] == pytest.approx(0.05)
    assert p.rates.observed[(0, 0, 0)] == 0.45  # not drafted: unchanged
    assert drafted_spec(Draft([5, 6])).choices() == [[0], [0, 0]]  # a chain draft's tree


def test_probe_steps_try_a_few_pruned_nodes():
    p = TreePlanner(TREE, max_nodes=64, probe_every=4, probe_extra=2)
    p.rates.observed.update({tuple(k): v for k, v in RATES.items()})
    sizes = [p.plan(3, line(0.06), 0.0).n - 1 for _ in range(8)]
    assert sizes == [3, 3, 3, 5, 3, 3, 3, 5]


def test_best_prefix_keeps_the_nodes_that_pay_for_their_rows():
    costs = FixedCosts(1.0, 0.06)  # a row costs 6 % of a one-token pass
    assert best_prefix([0.9, 0.1], [1, 1], costs, 0.0) == 1  # 1.9 / 1.06 beats 2.0 / 1.12
    assert best_prefix([0.9, 0.8], [1, 2], costs, 0.0) == 2
    assert best_prefix([0.9, 0.8], [1, 2], costs, 0.75) == 1  # a second level's drafter call costs more than it brings
    assert best_prefix([0.01], [1], costs, 0.0) == 0  # a plain step
