"""The adaptive controller's choice of draft length (chain) and depth (tree) from measured costs."""

from __future__ import annotations

from speccompile.runtime.adaptive import AdaptiveController


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
