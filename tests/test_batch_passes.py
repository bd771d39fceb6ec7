"""The batch decoder's modes (runtime/batch_passes.py): one pass per request on any target, as many slots as the
target holds KV caches; each request's tokens are its tokens alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_tiny_hf_model
from speccompile.errors import UnsupportedError
from speccompile.runtime import Runner
from speccompile.runtime.batch_fused import FusedGraphPasses
from speccompile.runtime.batch_passes import OnePassPerRequest
from speccompile.runtime.sampling import SamplingParams

CONTEXT = 256
PROMPTS = ["abc abc abc abc", "hello there, hello there", "x", "the cat sat on the mat. the cat sat"]


@pytest.fixture(scope="module")
def gpu_form_artifact(tmp_path_factory) -> tuple[Path, object]:
    """A tiny fp32 artifact plus the fp32 form of its GPU verify graph (what ONNX Runtime's CPU EP runs)."""
    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest
    from speccompile.models.load import load_model

    root = tmp_path_factory.mktemp("gpu_form")
    model_dir = make_tiny_hf_model(root / "hf")
    out = root / "art"
    export_artifact(str(model_dir), out, ExportOptions(max_context=CONTEXT))
    model = load_model(str(model_dir))
    (spec,), _ = export_fused_variant(DecoderWeights(model.config, model.weights), read_manifest(out).graph("target"), out,
                                      CONTEXT, target="cuda")
    return out, spec


def gpu_session_runner(gpu_form: tuple[Path, object], **options) -> Runner:
    """A Runner whose target is the GPU verify graph's session on the CPU EP (as `--backend ort-cuda` opens it)."""
    from speccompile.runtime.backends.ort_cuda import OrtCudaSession

    artifact, spec = gpu_form
    runner = Runner(artifact, contract_graph=True, threads=1, **options)
    runner.artifact.target = OrtCudaSession(artifact, spec, device="cpu", max_context=CONTEXT, threads=1)
    return runner


def _ids(runner: Runner, text: str) -> list[int]:
    return runner.artifact.tokenizer.prompt_ids(text, chat=False)


def _decode(decoder, runner: Runner, prompts: list[list[int]], max_tokens: int, sampling=None) -> list:
    """Every prompt through the decoder, as many at once as it has free slots; their results in order."""
    results, waiting, live = [None] * len(prompts), list(enumerate(prompts)), {}
    while waiting or decoder.active:
        while waiting and decoder.free:
            i, ids = waiting.pop(0)
            generation = decoder.join(ids, runner.config(max_tokens, sampling))
            live[id(generation)] = i
            if generation.done:
                results[i] = generation.result()
        for generation in decoder.step():
            results[live[id(generation)]] = generation.result()
    return results


def test_the_contract_graph_decodes_one_pass_per_request_as_alone(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1, contract_graph=True)
    decoder = runner.batch_decoder(4)
    assert isinstance(decoder.passes, OnePassPerRequest) and decoder.slots == 4 and decoder.kv_bytes == 0
    prompts = [_ids(runner, p) for p in PROMPTS]
    for sampling in (None, SamplingParams(temperature=0.9, seed=3)):
        together = _decode(decoder, runner, prompts, 24, sampling)
        assert not decoder.active and decoder.batched_passes == 0
        for ids, result in zip(prompts, together):
            assert result.tokens == runner.generate_ids(ids, 24, sampling=sampling).tokens
    assert sum(r.stats.draft_steps for r in together) > 0


def test_no_shared_passes_is_one_pass_per_request_on_the_fused_graph(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    assert isinstance(runner.batch_decoder(2).passes, FusedGraphPasses)
    decoder = runner.batch_decoder(1, shared_passes=False)
    assert isinstance(decoder.passes, OnePassPerRequest) and not decoder.keeps_prefixes
    prompts = [_ids(runner, p) for p in PROMPTS[:2]]
    for ids, result in zip(prompts, _decode(decoder, runner, prompts, 16)):
        assert result.tokens == runner.generate_ids(ids, 16).tokens
    with pytest.raises(UnsupportedError, match="slot_passes"):
        runner.batch_decoder(2, slot_passes="all", shared_passes=False)


def test_the_gpu_graph_holds_one_request_at_a_time(gpu_form_artifact):
    """The GPU graph's session owns one device KV buffer: its decoder has one slot, and requests decoded one after
    another through it give the contract graph's greedy tokens."""
    runner = gpu_session_runner(gpu_form_artifact, drafter="ngram")
    decoder = runner.batch_decoder(8)
    assert isinstance(decoder.passes, OnePassPerRequest) and decoder.slots == 1
    reference = Runner(gpu_form_artifact[0], drafter="ngram", contract_graph=True, threads=1)
    prompts = [_ids(runner, p) for p in PROMPTS]
    for ids, result in zip(prompts, _decode(decoder, runner, prompts, 20)):
        assert result.tokens == reference.generate_ids(ids, 20, drafter="none").tokens
