"""head_dim > 128 (Gemma's 256) in the batched paths: ONNX Runtime rounds a row's scores against its own 128-slot
block differently when its pass ends in that block's first half, so passes never straddle a cut at slot 63 mod 128
(`WideHeadRule`, backends/wide_head.py; tests/test_ort_fused.py). A slot of the slotted graph holds rows of one
segment only (drafts are sized by `Session.pass_rows`; a slot that straddles is refused), a lone request's batch-1
pass is split as alone, and the batch decoder runs every round of two or more requests as a slot pass (a batched pass
of several sequences has no padding row): every request's logits are bitwise its logits alone by construction."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.manifest import read_manifest, variant_name
from speccompile.runtime import Runner
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.backends.ort_slots import OrtSlotSession
from speccompile.runtime.sampling import SamplingParams

from conftest import make_tiny_hf_model
from test_ort_slots import alone_rows_in_slots


@pytest.fixture(scope="module")
def wide_artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hd256")
    make_tiny_hf_model(tmp / "m", head_dim=256)
    export_artifact(str(tmp / "m"), tmp / "art", ExportOptions(max_context=384, batch_slots=4))
    return tmp / "art"


def test_head_dim_256_slot_rows_equal_each_sequence_alone_bitwise(wide_artifact):
    """Plain rows and drafts of three sequences on both sides of slots 63, 191 and 319 (cuts on every host measured),
    in slot passes: bitwise
    each sequence's pass alone. A slot whose rows straddle a cut is refused; negative control: let through without
    the rule, such rows differ from the same rows alone (which run split)."""
    from speccompile.runtime.backends.wide_head import WideHeadRule
    from speccompile.runtime.backends.wide_head_probe import measured_cuts

    manifest = read_manifest(wide_artifact)
    spec = manifest.graphs[variant_name("target", "slots")]
    assert spec.extra["attention_lift"] == [128, 64]
    alone = open_artifact(wide_artifact, threads=1).target
    slotted = OrtSlotSession(wide_artifact, manifest, spec, threads=1)
    assert slotted.wide == WideHeadRule(cuts=measured_cuts(256, 1)) and slotted.wide.cuts

    def differing_rows(lengths, cases) -> int:
        rng = np.random.default_rng(0)
        pool = alone.new_batch_buffers(3, 448)
        prompts = [rng.integers(3, 60, n) for n in lengths]
        differing = 0
        for qs in cases:
            tokens = [rng.integers(3, 60, q) for q in qs]
            expected, caches, rows = alone_rows_in_slots(alone, pool, prompts, tokens)
            outs = slotted.run(pool, alone.past_names, rows, caches)
            differing += sum(not np.array_equal(out.logits, want) for out, want in zip(outs, expected))
        return differing

    # rows ending at 62 / 190 / 318 (short), starting at 63 / 191 / 319 (long), and a one-row pass at each cut
    assert differing_rows((186, 58, 314), ([1, 3, 5], [5, 5, 5], [2, 1, 4])) == 0
    assert differing_rows((191, 63, 319), ([1, 3, 5], [8, 2, 1])) == 0
    assert differing_rows((190, 62, 318), ([1, 1, 1],)) == 0
    with pytest.raises(ValueError, match="cross a cut"):
        differing_rows((188, 58, 318), ([5, 8, 5],))
    slotted.wide = WideHeadRule()
    assert differing_rows((188, 58, 318), ([5, 8, 5], [4, 7, 3])) > 0  # what the cuts prevent


def _traced(runner: Runner, max_tokens: int):
    config = runner.config(max_tokens)
    config.trace_logits = True
    return config


def test_head_dim_256_batch_decoder_is_bitwise_alone(wide_artifact, monkeypatch):
    """The batch decoder over a head_dim-256 artifact (asked for batched passes): every round of two or more requests
    is a slot pass, a request left alone a batch-1 pass (split at cuts), short prompts prefill alone; every request's logits
    and tokens are bitwise its own alone, across the cuts at 63 and 319. Negative control: batched one-row passes."""
    runner = Runner(wide_artifact, drafter="ngram", threads=1, adaptive=False)  # rounds that do not depend on timing
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(3, 60, n)) for n in (20, 45, 50, 300)]
    lengths = [30, 26, 22, 28]  # requests leave one by one: the last ones run alone in the decoder
    alone = [runner.generator(SamplingParams(), False).generate(ids, _traced(runner, n)) for ids, n in zip(prompts, lengths)]

    def together():
        decoder = runner.batch_decoder(len(prompts))
        generations = decoder.join_many([(ids, _traced(runner, n), None) for ids, n in zip(prompts, lengths)])
        while decoder.active:
            decoder.step()
        return decoder, [g.result() for g in generations]

    decoder, results = together()
    assert decoder.passes.batch_invariant and decoder.slot_passes > 0 and decoder.batched_passes > 0
    assert decoder.passes.mode == {"passes": "fused", "slot_passes": "all"}  # asked for "off": what a server reports
    for mine, theirs in zip(results, alone):
        assert mine.tokens == theirs.tokens
        assert np.array_equal(mine.logits, theirs.logits)
    target = runner.artifact.target
    monkeypatch.setattr(type(target), "wide_head_passes", property(lambda self: False))  # the batched one-row passes
    decoder, batched = together()
    assert decoder.passes.slot_session is None and decoder.slot_passes == 0 and decoder.passes.mode["slot_passes"] == "off"
    assert any(not np.array_equal(mine.logits, theirs.logits) for mine, theirs in zip(batched, alone))


def test_head_dim_256_without_a_slotted_graph_does_not_batch(tmp_path):
    """Without slot passes the batched one-row pass would be the only way to batch: refused, with the way out."""
    make_tiny_hf_model(tmp_path / "m", head_dim=256, layers=1)
    export_artifact(str(tmp_path / "m"), tmp_path / "art", ExportOptions(max_context=64, batch_slots=0))
    runner = Runner(tmp_path / "art", threads=1)
    assert "--batch-slots" in runner.batch_problem() and "head_dim 256" in runner.batch_problem()


def test_head_dim_256_needs_slots_for_every_request(wide_artifact):
    """More requests than the slotted graph has slots: refused, naming why slot passes were chosen."""
    from speccompile.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"head_dim 256 > 128 .*--batch-slots 5"):
        Runner(wide_artifact, threads=1).batch_decoder(5)  # the artifact's slotted graph has 4 slots


def test_head_dim_256_tied_head_prefills_across_cuts(tmp_path):
    """A prompt that straddles cuts is prefilled one pass per segment, each projecting its last row (a tied head's
    graph cannot project zero rows); its last logits equal those of the same prompt fed one row at a time, and
    greedy n-gram decoding equals plain."""
    make_tiny_hf_model(tmp_path / "m", head_dim=256, layers=1, tie_word_embeddings=True)
    export_artifact(str(tmp_path / "m"), tmp_path / "art", ExportOptions(max_context=256, batch_slots=0))
    target = open_artifact(tmp_path / "art", threads=1).target
    prompt = np.random.default_rng(1).integers(3, 60, 150)
    whole = target.new_cache()
    out = target.run(prompt, np.arange(150), whole.attention_mask(np.tril(np.ones((150, 150), bool))), whole, last_logits_only=True)
    single = target.new_cache()
    for p, token in enumerate(prompt):
        last = target.run(prompt[p:p + 1], np.array([p]), single.attention_mask(np.ones((1, 1), bool)), single)
        single.append(last.presents, [0], 1)
    np.testing.assert_array_equal(out.logits[-1], last.logits[-1])
    runner = Runner(tmp_path / "art", drafter="ngram", threads=1)
    text = list(prompt[:70]) * 2
    assert runner.generate_ids(text, max_tokens=30).tokens == runner.generate_ids(text, max_tokens=30, drafter="none").tokens
