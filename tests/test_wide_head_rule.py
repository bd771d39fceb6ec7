"""The premise of the cut rule (runtime/backends/wide_head.py), checked on ONNX Runtime's CPU GroupQueryAttention
itself: at head_dim 256 and 512 the cuts measured on this machine (backends/wide_head_probe.py) predict, for
random rows, pass sizes and padding rows other than the ones the fit was checked on, exactly when a query row's
output is the same bits as in its plain one-row pass; at 160, 192 and 320 a pass the cuts keep in a row's plain
class gives it its plain bits; and a pass between two cuts ends, for each of its rows, in the class of the row's
plain pass, for every rule seen on the hosts measured so far."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.runtime.backends.wide_head import WideHeadRule
from speccompile.runtime.backends.wide_head_probe import CAPACITY, _AttentionProbe, end_class, measured_cuts

# the rules measured so far: AMD EPYC (head_dim 256, 512), Intel Xeon with AMX (256, 512), and Gemma 4's unions
RULES_SEEN = [((128, 64),), ((64, 32),), ((128, 64), (64, 32)), ((256, 64),), ((128, 32), (128, 64)),
              ((128, 32), (128, 64), (256, 64))]


def _random_passes(seed: int, count: int = 120):
    """(row p, first row of its pass, last slot of the pass) of random passes with padding rows."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        p = int(rng.integers(1, CAPACITY - 200))
        q, pad = int(rng.integers(1, min(p, 24) + 1)), int(rng.choice([0, 1, 3, 20, 66]))
        yield p, p - q + 1, p + max(pad, int(q == 1))


@pytest.mark.parametrize("dim", [160, 192, 320])
def test_other_widths_get_their_plain_bits_within_the_measured_classes(dim):
    """Widths other than Gemma's: blocks of about 65536 / head_dim slots (341 at 192 on the Xeon); a row or two at a
    block's start may not depend on the pass end where the rule says it may (a cut too many, never one too few)."""
    cuts = measured_cuts(dim, 2)
    assert cuts, f"head_dim {dim}: no cut rule fits this machine's GroupQueryAttention ({cuts})"
    probe = _AttentionProbe(dim, 2)
    kept = [(p, first, last) for p, first, last in _random_passes(6) if end_class(p, last, cuts) == end_class(p, p + 1, cuts)]
    assert len(kept) > 20 and all(probe.same(p, last, first) for p, first, last in kept), cuts


@pytest.mark.parametrize("dim", [256, 512])
def test_a_rows_bits_follow_the_class_of_its_pass_end(dim):
    cuts = measured_cuts(dim, 2)
    assert cuts, f"head_dim {dim}: no cut rule fits this machine's GroupQueryAttention ({cuts})"
    probe = _AttentionProbe(dim, 2)
    agree = differ = 0
    for p, first, last in _random_passes(5):
        same = probe.same(p, last, first)
        assert same == (end_class(p, last, cuts) == end_class(p, p + 1, cuts)), (cuts, p, first, last)
        agree += same
        differ += not same
    assert agree > 20 and differ > 5  # both kinds were met


def test_widths_up_to_128_need_no_cut():
    assert measured_cuts(128, 2) == () and measured_cuts(64, 1) == ()
    assert WideHeadRule.of((128, 64), [128, 64], 2) == WideHeadRule() and not WideHeadRule.of((0, 0), [256], 2).active


@pytest.mark.parametrize("cuts", RULES_SEEN)
def test_passes_within_a_segment_end_as_alone(cuts):
    """The cut rule's consequence: a pass whose rows lie between two cuts (plus a one-row pass's padding row) ends
    in the class of each of its rows' plain passes."""
    rule = WideHeadRule(cuts=cuts)
    for start in range(0, 700):
        rows = rule.rows_from(start)
        assert 1 <= rows <= min(block for block, _ in cuts)
        for q in range(1, rows + 1):
            last = start + q - 1 + int(q == 1)
            assert all(end_class(p, last, cuts) == end_class(p, p + 1, cuts) for p in range(start, start + q)), (cuts, start, q)


def test_segments_split_a_pass_at_the_cuts():
    assert WideHeadRule(cuts=((128, 64),)).segments(60, 140) == [(0, 3), (3, 131), (131, 140)]
    assert WideHeadRule(cuts=((128, 64), (64, 32))).segments(60, 140) == [(0, 3), (3, 35), (35, 99), (99, 131), (131, 140)]
    assert WideHeadRule(cuts=((256, 64),)).segments(60, 300) == [(0, 3), (3, 259), (259, 300)]
    assert WideHeadRule(one_row=True).segments(7, 3) == [(0, 1), (1, 2), (2, 3)]
