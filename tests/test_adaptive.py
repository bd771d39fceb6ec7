"""The adaptive controller's choice of draft length (chain) and depth (tree) from measured costs."""

from __future__ import annotations

from speccompile.runtime.adaptive import AdaptiveController
from speccompile.runtime.costs import PassCosts


def _measured(acceptance: float, t1: float = 0.035, slope: float = 0.0022, draft: float = 0.001) -> AdaptiveController:
    """A controller that has seen one-token passes, wider passes and drafts with the given acceptance."""
    c = AdaptiveController(num_draft_tokens=6)
    for _ in range(40):
        c.record_pass(1, t1)
        c.record_pass(5, t1 + 4 * slope)
        accepted = round(acceptance * 4)
        c.record_draft(4, accepted, 4 * draft)
    return c


def test_first_step_is_plain_to_measure_t1():
    assert AdaptiveController(num_draft_tokens=6).choose_k() == 0


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
    c = AdaptiveController(num_draft_tokens=12, costs=PassCosts())
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
    assert AdaptiveController(num_draft_tokens=6, costs=costs).choose_k() > 0


def test_seeded_sampling_ignores_measured_costs():
    costs = PassCosts()
    costs.record(1, 0.03)
    c = AdaptiveController(num_draft_tokens=6, deterministic=True, costs=costs)
    c.record_pass(3, 9.0)
    assert c.pass_cost(3) == 1.12 and costs.by_q == {1: 0.03}


def test_seeded_sampling_drafts_shorter_on_the_packed_cpu_graph():
    """Seeded sampling's fixed costs follow the target graph: a verified token costs 0.19 of a one-token pass on
    the packed INT4/INT8 CPU graph (measured), 0.06 elsewhere; the same acceptance then pays for shorter drafts."""
    from speccompile.runtime.costs import seeded_costs

    chosen = {}
    for packed in (False, True):
        c = AdaptiveController(num_draft_tokens=8, deterministic=True, seeded=seeded_costs(packed))
        for _ in range(40):
            c.record_draft(4, 3, 0.0)  # acceptance 0.75
        chosen[packed] = c.choose_k()
    assert 0 < chosen[True] < chosen[False]


def test_pass_costs_follow_their_definition_after_every_record():
    """`PassCosts.seconds` (neighbours from a table rebuilt after each change) is, after every record, what its
    definition says: a measured q at least every narrower measured pass; another q on the line, at least every
    narrower measured pass and at most every wider one."""
    import random

    def by_definition(costs: PassCosts, q: int) -> float:
        below = max((s for k, s in costs.by_q.items() if k < q), default=0.0)
        if q in costs.by_q:
            return max(costs.by_q[q], below)
        t1, slope = costs.line()
        return min([max(t1 + slope * (q - 1), below), *(s for k, s in costs.by_q.items() if k > q)])

    rng = random.Random(0)
    for _ in range(300):
        costs = PassCosts()
        for _ in range(rng.randint(1, 12)):
            costs.record(rng.randint(1, 20), rng.uniform(0.001, 0.01))
            assert [costs.seconds(q) for q in range(1, 24)] == [by_definition(costs, q) for q in range(1, 24)]
    costs.set(1, 0.5)  # a seed replaces what was measured, and the table follows
    assert costs.seconds(1) == 0.5 and costs.seconds(2) >= 0.5


def test_learned_rates_carry_from_one_controller_to_the_next():
    learned = AdaptiveController.learned_rates()
    first = AdaptiveController(num_draft_tokens=6, learned=learned)
    first.record_draft(4, 4, 0.0, key=3)
    second = AdaptiveController(num_draft_tokens=6, learned=learned)
    assert second.acceptance(3) == first.acceptance(3) > learned.prior(3)
    assert second.acceptance(2) == learned.prior(2)  # keys never seen keep the prior


def test_seeded_sampling_starts_from_the_prior_whatever_was_learned():
    learned = AdaptiveController.learned_rates()
    AdaptiveController(num_draft_tokens=6, learned=learned).record_draft(4, 0, 0.0, key=3)
    seeded = AdaptiveController(num_draft_tokens=6, learned=learned, deterministic=True)
    assert seeded.acceptance(3) == seeded.prior_acceptance
    seeded.record_draft(4, 4, 0.0, key=3)
    assert learned.rate(3) < seeded.prior_acceptance  # and teaches the shared estimates nothing
