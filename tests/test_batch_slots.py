"""Slot rounds (runtime/batch.py over the slotted graph, backends/ort_slots.py): drafts ride in the shared
pass, every row computes the bits it gets alone, and the decoder chooses between slot and batched rounds."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.runtime import Runner
from speccompile.runtime.acceptance import AcceptanceRates
from speccompile.runtime.costs import SlotPassCosts
from speccompile.runtime.sampling import SamplingParams

PROMPTS = ["abc abc abc abc", "hello there, hello there", "x", "the cat sat on the mat. the cat sat", "0123 0123 0123 0123 01"]


def _ids(runner: Runner, text: str) -> list[int]:
    return runner.artifact.tokenizer.prompt_ids(text, chat=False)


def _traced(runner: Runner, max_tokens: int):
    config = runner.config(max_tokens)
    config.trace_logits = True
    return config


def _decode_together(decoder, runner: Runner, prompts: list[list[int]], max_tokens: int, sampling=None) -> list:
    generations = decoder.join_many([(ids, runner.config(max_tokens, sampling), None) for ids in prompts])
    while decoder.active:
        decoder.step()
    return [g.result() for g in generations]


def test_slot_rounds_carry_drafts_and_decode_as_alone(tiny_artifact):
    """A fixed draft length (every request drafts when its lookup proposes): the drafts ride in slot passes,
    not in passes of their own, and every request's tokens equal its tokens alone."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1, adaptive=False)
    prompts = [_ids(runner, p) for p in PROMPTS[:4]]
    decoder = runner.batch_decoder(4, slot_passes="drafts")
    assert decoder.passes.slot_session is not None and decoder.passes.pricing.slots.row_seconds is not None  # calibrated at start
    results = _decode_together(decoder, runner, prompts, 24)
    assert decoder.slot_passes > 0
    assert sum(r.stats.draft_steps for r in results) > 0
    for ids, result in zip(prompts, results):
        assert result.tokens == runner.generate_ids(ids, 24).tokens


def test_batch_invariant_rows_are_bitwise_alone(tiny_artifact):
    """`slot_passes="all"`: every round is a slot pass, and the logits that chose every token are bitwise the
    ones the request computes alone; the batched pass (one-row kernel at batch > 1) is the negative control."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    prompts = [_ids(runner, p) for p in PROMPTS]
    alone = [runner.generator(SamplingParams(), False).generate(ids, _traced(runner, 16)) for ids in prompts]

    def together(**options):
        decoder = runner.batch_decoder(len(prompts), **options)
        generations = decoder.join_many([(ids, _traced(runner, 16), None) for ids in prompts], prefill_together=False)
        while decoder.active:
            decoder.step()
        return decoder, [g.result() for g in generations]

    decoder, invariant = together(slot_passes="all")
    assert decoder.slot_passes > 0  # (a request left alone runs a batch-1 pass: alone by definition)
    for mine, theirs in zip(invariant, alone):
        assert mine.tokens == theirs.tokens
        assert np.array_equal(mine.logits, theirs.logits)
    decoder, batched = together()
    assert decoder.passes.slot_session is None and decoder.slot_passes == 0
    assert any(not np.array_equal(mine.logits[1:], theirs.logits[1:]) for mine, theirs in zip(batched, alone))


def test_slot_passes_need_a_slotted_graph(tiny_artifact):
    from speccompile.errors import InputError, UnsupportedError

    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    for mode in ("drafts", "all"):
        with pytest.raises(UnsupportedError, match="--batch-slots 9"):
            runner.batch_decoder(9, slot_passes=mode)  # the tiny artifact's slotted graph has 8 slots
    with pytest.raises(InputError, match="slot_passes"):
        runner.batch_decoder(2, slot_passes="sometimes")


def test_seeded_sampling_in_slot_rounds_equals_alone(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    prompts = [_ids(runner, p) for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(len(prompts))]
    decoder = runner.batch_decoder(4, slot_passes="all")
    generations = decoder.join_many([(ids, runner.config(20, p), None) for ids, p in zip(prompts, params)])
    while decoder.active:
        decoder.step()
    for ids, p, generation in zip(prompts, params, generations):
        assert generation.result().tokens == runner.generate_ids(ids, 20, p).tokens


def test_plain_steps_keep_measuring_a_cheap_drafter(tiny_artifact):
    """`plan_step(shadow=True)`: a plain step of the n-gram drafter still asks it for a token and records
    whether the target chose it; without it a plain step measures nothing."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    ids = _ids(runner, PROMPTS[4])
    observed = {}
    for shadow in (False, True):
        generation = runner.generator(SamplingParams(), False).start(ids, runner.config(12), None)
        while not generation.done:
            planned = generation.plan_step(False, shadow=shadow)
            assert not planned.draft.tokens
            generation.complete_step(planned, generation.verify_pass(planned))
        observed[shadow] = dict(generation.controller.rates.observed)
    assert observed[False] == {} and observed[True]


def test_slot_pass_costs_follow_the_calibrated_line():
    costs = SlotPassCosts(alpha=0.5)
    assert costs.seconds(8) is None and not costs.measured
    costs.record(8, 0.040)  # before a calibration: proportional to the rows
    assert costs.seconds(16) == pytest.approx(0.080)
    costs.calibrate((8, 48), (0.040, 0.080))
    assert costs.row_seconds == pytest.approx(0.001)
    assert costs.seconds(18) == pytest.approx(0.050)
    costs.record(8, 0.050)  # slower passes move the level, not the slope
    assert costs.seconds(18) == pytest.approx(0.055) and costs.row_seconds == pytest.approx(0.001)


def test_drafts_that_do_not_pay_for_a_slot_pass_are_dropped(tiny_artifact):
    """Slot passes priced far above a batched pass: the round's drafts are dropped and it runs batched (its
    requests still decode as alone); with every round a slot pass the price does not matter."""
    runner = Runner(tiny_artifact, drafter="ngram", threads=1, adaptive=False)
    prompts = [_ids(runner, p) for p in PROMPTS[:4]]
    for invariant in (False, True):
        decoder = runner.batch_decoder(4, slot_passes="all" if invariant else "drafts")
        decoder.passes.pricing.slots.calibrate((8, 48), (10.0, 11.0))  # 10 s a slot pass
        decoder.passes.pricing.batched.record(4, 0.001)
        results = _decode_together(decoder, runner, prompts, 16)
        assert (decoder.slot_passes > 0) == invariant
        for ids, result in zip(prompts, results):
            assert result.tokens == runner.generate_ids(ids, 16).tokens


def test_a_probe_not_allowed_stays_due():
    rates = AcceptanceRates(probe_every=3)
    assert [rates.probe_due(allowed=False) for _ in range(5)] == [False] * 5
    assert rates.probe_due(allowed=True)  # due since the third step: taken at the first step it may be
    assert not rates.probe_due(allowed=True)
