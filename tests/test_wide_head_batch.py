"""head_dim > 128 (Gemma's 256) in the batched paths: ONNX Runtime rounds a row of GroupQueryAttention differently
when its attention total leaves a remainder of 1..64 modulo 128, and a pass alone moves its total off those lengths
with padding rows (`attention_lift`, tests/test_ort_fused.py). A slot of the slotted graph gets the same padding rows
(backends/ort_slots.py), a lone request's batch-1 pass too, and the batch decoder runs every round of two or more
requests as a slot pass (a batched pass of several sequences cannot take padding rows): every request's logits are
bitwise its logits alone by construction."""

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
    """Plain rows and drafts of three sequences whose totals straddle 64, 192 and 320, in slot passes: bitwise each
    sequence's pass alone. Negative control: without the per-slot lift some rows differ."""
    manifest = read_manifest(wide_artifact)
    spec = manifest.graphs[variant_name("target", "slots")]
    assert spec.extra["attention_lift"] == [128, 64]
    alone = open_artifact(wide_artifact, threads=1).target
    slotted = OrtSlotSession(wide_artifact, manifest, spec, threads=1)
    assert slotted.attention_lift == (128, 64)

    def differing_rows() -> int:
        rng = np.random.default_rng(0)
        pool = alone.new_batch_buffers(3, 448)
        prompts = [rng.integers(3, 60, n) for n in (188, 58, 318)]
        differing = 0
        for qs in ([1, 3, 5], [2, 1, 4], [5, 2, 1]):
            tokens = [rng.integers(3, 60, q) for q in qs]
            expected, caches, rows = alone_rows_in_slots(alone, pool, prompts, tokens)
            outs = slotted.run(pool, alone.past_names, rows, caches)
            differing += sum(not np.array_equal(out.logits, want) for out, want in zip(outs, expected))
        return differing

    assert differing_rows() == 0
    slotted.attention_lift = (0, 0)
    assert differing_rows() > 0  # what the per-slot lift prevents


def _traced(runner: Runner, max_tokens: int):
    config = runner.config(max_tokens)
    config.trace_logits = True
    return config


def test_head_dim_256_batch_decoder_is_bitwise_alone(wide_artifact, monkeypatch):
    """The batch decoder over a head_dim-256 artifact (asked for batched passes): every round of two or more requests
    is a slot pass, a request left alone a lifted batch-1 pass, short prompts prefill alone; every request's logits
    and tokens are bitwise its own alone, across totals 64 and 320. Negative control: batched one-row passes."""
    runner = Runner(wide_artifact, drafter="ngram", threads=1)
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
    monkeypatch.setattr(type(target), "lifts_passes", property(lambda self: False))  # the batched one-row passes
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
