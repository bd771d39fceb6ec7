"""The adaptive controller's choice of draft length (chain) and depth (tree) from measured costs."""

from __future__ import annotations

from speccompile.runtime.adaptive import AdaptiveController
from speccompile.runtime.costs import PassCosts


def _measured(acceptance: float, t1: float = 0.035, slope: float = 0.0022, draft: float = 0.001) -> AdaptiveController:
    """A controller that has seen one-token passes, wider passes and drafts with the given acceptance."""
    c = AdaptiveController(max_k=6)
    for _ in range(40):
        c.record_pass(1, t1)
        c.record_pass(5, t1 + 4 * slope)
        accepted = round(acceptance * 4)
        c.record_draft(4, accepted, 4 * draft)
    return c


def test_first_step_is_plain_to_measure_t1():
    assert AdaptiveController(max_k=6).choose_k() == 0


def test_high_acceptance_drafts_long_chains():
    c = _measured(1.0)
    assert c.acceptance() > 0.9
    assert c.choose_k() == 6
    assert c.choose_k(available=3) == 3


def test_wide_trees_are_cut_shallower_than_chains():
    c = _measured(0.5)
    chain = c.choose_k()
    tree = c.choose_k(nodes=lambda k: 4 ** k)  # 4 children per node: verify cost explodes with depth
    assert 1 <= tree < chain


def test_low_acceptance_pauses_then_probes():
    c = _measured(0.0)
    picks = [c.choose_k() for _ in range(c.probe_every)]
    assert picks[:-1] == [0] * (c.probe_every - 1) and picks[-1] == 1


def _staircase(q: int) -> float:
    """Pass cost shaped like the CPU GEMM blocks: rows 2-6 cheap, a step at 7, rows 8-12 cheap, a step at 13."""
    return 1.0 if q == 1 else 1.2 if q <= 6 else 1.4 if q <= 12 else 1.9


def _on_staircase(accepted: int) -> AdaptiveController:
    """Measured staircase costs; each draft of 10 accepts `accepted` (rate accepted / (accepted + 1))."""
    c = AdaptiveController(max_k=12, costs=PassCosts())
    for _ in range(40):
        for q in range(1, 14):
            c.record_pass(q, _staircase(q))
        c.record_draft(10, accepted, 0.0)
    return c


def test_measured_pass_costs_put_drafts_at_the_end_of_a_block():
    assert _on_staircase(9).choose_k() == 11  # acceptance 0.9: fill the second block, never open the third
    assert _on_staircase(1).choose_k() == 5  # acceptance 0.5: fill the first block


def test_unmeasured_pass_cost_follows_the_line_between_measured_neighbours():
    costs = PassCosts()
    costs.record(1, 1.0)
    costs.record(5, 1.4)  # slope 0.1 per extra row
    assert costs.seconds(5) == 1.4
    assert abs(costs.seconds(3) - 1.2) < 1e-9
    costs.record(9, 1.3)  # faster than the line and than q = 5 (noise): unmeasured q between them are capped
    assert costs.seconds(7) <= 1.3
    assert costs.seconds(12) >= costs.seconds(9)


def test_known_pass_costs_skip_the_first_plain_step():
    costs = PassCosts()
    costs.record(1, 0.03)
    costs.record(5, 0.034)
    assert AdaptiveController(max_k=6, costs=costs).choose_k() > 0


def test_seeded_sampling_ignores_measured_costs():
    costs = PassCosts()
    costs.record(1, 0.03)
    c = AdaptiveController(max_k=6, deterministic=True, costs=costs)
    c.record_pass(3, 9.0)
    assert c.pass_cost(3) == 1.12 and costs.by_q == {1: 0.03}
