"""The slotted GPU graph's tree form (`target.ort-cuda-tree-slots.onnx`: each slot's attention_bias in every pass) in
its fp32 form on ONNX Runtime's CPU EP: tree drafts (an EAGLE-3 head) verified batched, as `speccompile serve --backend
ort-cuda` runs them with onnxruntime-gpu >= 1.28. Batched greedy equals each request alone and plain decoding, one
bucket makes a tree request's logits bitwise its plain decoding's and independent of its batch-mates, seeded sampled
output is exact (chi-square), and a slot's tree rows are the contract graph's (the bias, not causality, masks them).
A single stream drafting trees (no server) runs slot 0 of the tree form as its target (`OneSlotSession`), plain passes
too: equal to its plain decoding there (bitwise with one bucket) and to the batch decoder's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speccompile.runtime import Runner
from speccompile.runtime.batch_gpu import SlotGraphPasses
from speccompile.runtime.kvcache import causal_mask
from test_batch_passes import _decode
from test_gpu_slots import _last_logits, _top_k_probs, seeded_top3, traced
from test_sampling import chi_square_p_value

CONTEXT = 256
SLOTS = 8


@pytest.fixture(scope="module")
def tree_artifact(tmp_path_factory) -> Path:
    """The tiny head target with a random EAGLE-3 head, plus the fp32 forms of its GPU graph, slotted graph and tree
    form (what `export --dtype fp16 --batch-slots 8` writes at fp16)."""
    from test_heads_helpers import shared_target, write_checkpoint

    from speccompile.export.drafters import parse_drafter, target_taps_for
    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest, variant_name
    from speccompile.models.load import load_model

    root = tmp_path_factory.mktemp("gpu_tree_slots")
    target = shared_target(tmp_path_factory)
    drafter = f"eagle3:{write_checkpoint(root / 'ckpt', 'eagle3')}"
    out = root / "art"
    export_artifact(str(target), out, ExportOptions(drafter=drafter, max_context=CONTEXT))
    model = load_model(str(target))
    weights = DecoderWeights(model.config, model.weights, "eagle3", target_taps_for(parse_drafter(drafter), model.config), CONTEXT)
    manifest = read_manifest(out)
    specs, files = export_fused_variant(weights, manifest.graph("target"), out, CONTEXT + 64, target="cuda", slots=SLOTS)
    assert files[:3] == ["target.ort-cuda.onnx", "target.ort-cuda-slots.onnx", "target.ort-cuda-tree-slots.onnx"]
    assert specs[2].extra["masks"] == "tree" and specs[2].extra["min_onnxruntime_cuda"] == "1.28"
    for key, spec in zip(("cuda", "cuda-slots", "cuda-tree-slots"), specs):
        manifest.graphs[variant_name("target", key)] = spec
    manifest.record_files(out, files)
    manifest.write(out)
    return out


def tree_runner(artifact: Path, rows: int = 0) -> Runner:
    """An EAGLE-3 runner whose target is the GPU graph on the CPU EP (its batch decoder: the tree form); `rows`:
    shape-invariant mode, every pass that many rows."""
    from test_gpu_slots import gpu_runner

    return gpu_runner(artifact, rows, drafter="eagle3", adaptive=False)


def _prompts() -> list[list[int]]:
    from test_heads_helpers import word_prompt_ids

    return [[1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42]] + [word_prompt_ids(s) for s in range(1, SLOTS)]


def test_eight_tree_requests_together_equal_each_alone_and_plain_decoding(tree_artifact):
    runner = tree_runner(tree_artifact)
    decoder = runner.batch_decoder(SLOTS)
    assert isinstance(decoder.passes, SlotGraphPasses) and decoder.passes.session.trees
    assert decoder.passes.session.spec.file == "target.ort-cuda-tree-slots.onnx" and runner.batch_problem() is None
    prompts = _prompts()
    together = _decode(decoder, runner, prompts, 20)
    contract = Runner(tree_artifact, drafter="eagle3", contract_graph=True, threads=1)
    for ids, result in zip(prompts, together):
        assert result.tokens == traced(runner, [ids], 20)[0].tokens
        assert result.tokens == contract.generate_ids(ids, 20, drafter="none").tokens
    assert sum(r.stats.draft_steps for r in together) > SLOTS
    assert sum(r.stats.exact_cuts for r in together) > 0  # trees accepted off their main path: cut, carried
    assert decoder.slot_passes < sum(r.stats.target_passes for r in together) / 4  # rounds shared by the requests


def test_one_bucket_makes_tree_logits_plain_decodings_bitwise(tree_artifact):
    """Shape-invariant mode (one bucket of 8 rows): every pass of the tree form has the same shapes and the same
    attention path (a bias in every pass), so a request's logits with EAGLE-3 trees, batched, are bitwise its
    logits alone and its plain decoding's through the same graph."""
    runner = tree_runner(tree_artifact, rows=8)
    prompts = _prompts()[:5]
    together = traced(runner, prompts)
    assert sum(r.stats.draft_steps for r in together) > 0 and sum(r.stats.exact_cuts for r in together) > 0
    for ids, mine in zip(prompts, together):
        for (other,) in (traced(runner, [ids]), traced(runner, [ids], drafter="none")):
            assert mine.tokens == other.tokens and np.array_equal(mine.logits, other.logits)


def test_sampled_tree_answers_batched_are_exact(tree_artifact):
    """Seeded top-3 sampling of three tokens, eight requests a round, the second and third from a round with an
    EAGLE-3 tree of depth 1 (siblings: accepting one off the main path cuts the verdict there): the counts of each
    (first, second, third) triple fit the target's exact joint distribution (chi-square)."""
    runner = tree_runner(tree_artifact)
    contract = Runner(tree_artifact, contract_graph=True, threads=1)
    prompt = [1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41]
    vocab = runner.artifact.tokenizer.vocab_size
    first = _top_k_probs(_last_logits(contract, prompt), 3)
    joint = np.zeros((vocab, vocab, vocab))
    for a in np.flatnonzero(first):
        second = _top_k_probs(_last_logits(contract, prompt + [int(a)]), 3)
        for b in np.flatnonzero(second):
            joint[a, b] = first[a] * second[b] * _top_k_probs(_last_logits(contract, prompt + [int(a), int(b)]), 3)
    counts, drafted = np.zeros_like(joint), 0
    for result in seeded_top3(runner, prompt, 3):
        counts[tuple(result.tokens)] += 1
        drafted += result.stats.draft_steps
    assert drafted > 0
    p_value = chi_square_p_value(counts.reshape(-1), joint.reshape(-1))
    assert p_value > 1e-3, f"chi-square p-value {p_value:.3g}: batched tree samples are not the target's distribution"


@pytest.mark.parametrize("arch", ["llama", "phi3", "hunyuan_v1_dense", "gemma3n_text"])  # phi3: a sliding window of 8, masked by
# position in the bias; Hunyuan: rope (and the q/k norms after it) before GroupQueryAttention; Gemma 3n: AltUp, KV sharing
def test_a_slots_tree_rows_are_the_contract_graphs(tmp_path, arch):
    """A tree in slot 1 (slot 0 runs a chain in the same pass): every tree row's logits match the contract graph's
    tree pass, the rows off the main path included. Negative control: the same rows run causally (no tree bias)
    do not, and the causal slotted graph refuses the tree."""
    from speccompile.errors import UnsupportedError
    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest
    from speccompile.models.load import load_model
    from speccompile.runtime.artifact import open_artifact
    from speccompile.runtime.backends.ort_cuda_slots import OrtCudaSlotSession
    from test_gpu_graph import MAX_CONTEXT, _fp32_gpu_form

    out, _, _ = _fp32_gpu_form(tmp_path, arch, family=arch != "llama")
    model = load_model(str(tmp_path / arch))
    specs, _ = export_fused_variant(DecoderWeights(model.config, model.weights), read_manifest(out).graph("target"), out,
                                    MAX_CONTEXT, target="cuda", slots=2)
    causal, tree = (OrtCudaSlotSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1) for spec in specs[1:])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 60, 5), rng.integers(3, 60, 14)]
    ids, depths = rng.integers(3, 60, 6), np.array([0, 1, 1, 2, 2, 3])
    parents = [-1, 0, 0, 1, 2, 3]  # rows 2 and 4 off the main path 0-1-3-5
    ancestry = np.eye(6, dtype=bool)
    for row, parent in enumerate(parents):
        if parent >= 0:
            ancestry[row] |= ancestry[parent]
    contract = open_artifact(out, threads=1, fused=False).target
    cache = contract.new_cache()
    alone = contract.run(prompts[1], np.arange(14), cache.attention_mask(causal_mask(14)), cache)
    cache.append(alone.presents, range(14), 14)
    expected = contract.run(ids, 14 + depths, cache.attention_mask(ancestry), cache).logits
    caches = [tree.slot_cache(b) for b in range(2)]
    prefill = tree.run_slots({b: (p, np.arange(len(p))) for b, p in enumerate(prompts)})
    for b, p in enumerate(prompts):
        caches[b].append(prefill[b].presents, range(len(p)), len(p))
    chain = (rng.integers(3, 60, 3), np.arange(5, 8))
    step = {0: chain, 1: (ids, 14 + depths)}
    got = tree.run_slots(step, trees={1: ancestry})[1]
    np.testing.assert_allclose(got.logits, expected, atol=1e-4, rtol=1e-4)
    assert got.plain_exact.tolist() == [True, True, False, True, False, True] and caches[1].row_slots is not None
    unmasked = tree.run_slots(step)[1].logits  # the tree's rows as a chain: rows 2 to 5 see their siblings
    assert not np.allclose(unmasked[2:], expected[2:], atol=1e-3)
    with pytest.raises(UnsupportedError, match="tree form"):
        causal.run_slots(step, trees={1: ancestry})


def single_stream_runner(artifact: Path, rows: int = 0, form: str = "cuda-tree-slots") -> Runner:
    """An EAGLE-3 runner whose target is what `open_artifact` opens for a single stream drafting trees on ort-cuda
    (`runnable_spec`, then `single_stream`: slot 0 of the tree form), on the CPU EP; `form`: another slotted form."""
    from speccompile.manifest import variant_name
    from speccompile.runtime.artifact import runnable_spec, single_stream
    from speccompile.runtime.backends.factory import open_session

    runner = Runner(artifact, drafter="eagle3", adaptive=False, contract_graph=True, threads=1)
    manifest = runner.artifact.manifest
    spec = runnable_spec(manifest, "target", "ort-cuda", True, chains=False, single=True)
    assert spec.file == "target.ort-cuda-tree-slots.onnx"
    assert runnable_spec(manifest, "target", "ort-cuda", True, chains=False).file == "target.onnx"  # a server: its own
    spec = manifest.graph(variant_name("target", form))
    session = open_session(artifact, spec, "ort-cpu", 1, manifest=manifest, max_context=CONTEXT, shape_invariant=rows or None)
    runner.artifact.target = single_stream(session)  # ort-cpu: the factory opens a GPU form on the CPU EP
    runner.artifact.shape_invariant = rows
    return runner


def _single(runner: Runner, ids: list[int], max_tokens: int, drafter: str | None = None):
    """One generation through `Runner.generator` (no batch decoder), logits traced."""
    plain = drafter == "none"
    config = runner.config(max_tokens, drafter=drafter)
    config.trace_logits = True
    return runner.generator(plain=plain).generate(ids, config)


@pytest.mark.parametrize("rows", [0, 8])  # buckets; one bucket of 8 rows (shape-invariant mode)
def test_a_single_tree_request_runs_slot_zero_of_the_tree_form(tree_artifact, rows):
    """A single stream with EAGLE-3 trees on ort-cuda (no server) runs every pass, plain and drafted, in slot 0 of
    target.ort-cuda-tree-slots.onnx: greedy equals plain decoding through that graph (bitwise logits with one
    bucket), the contract graph's plain decoding, and the same request through the batch decoder."""
    from speccompile.runtime.backends.ort_cuda_slots import OneSlotSession

    runner = single_stream_runner(tree_artifact, rows)
    assert isinstance(runner.artifact.target, OneSlotSession)
    assert runner.artifact.target.spec.file == "target.ort-cuda-tree-slots.onnx" and runner.artifact.target.slots.trees
    contract = Runner(tree_artifact, contract_graph=True, threads=1)
    drafted = cuts = 0
    for ids in _prompts()[:4]:
        mine, plain = _single(runner, ids, 20), _single(runner, ids, 20, drafter="none")
        assert mine.tokens == plain.tokens == contract.generate_ids(ids, 20, drafter="none").tokens
        assert mine.tokens == runner.generate_ids(ids, 20).tokens
        assert mine.tokens == traced(tree_runner(tree_artifact, rows), [ids], 20)[0].tokens
        if rows:
            assert np.array_equal(mine.logits, plain.logits)  # the same graph, the same shapes: the same bits
        drafted, cuts = drafted + mine.stats.draft_steps, cuts + mine.stats.exact_cuts
    assert drafted > 0 and cuts > 0  # trees verified (accepted off their main path: cut)


def test_a_single_tree_request_needs_the_tree_form(tree_artifact):
    """Negative control: slot 0 of the causal slotted form refuses the first tree pass (its rows would see their
    siblings), and a plain request through it still runs."""
    from speccompile.errors import UnsupportedError

    runner = single_stream_runner(tree_artifact, form="cuda-slots")
    ids = _prompts()[0]
    assert runner.artifact.target.spec.file == "target.ort-cuda-slots.onnx"
    contract = Runner(tree_artifact, contract_graph=True, threads=1)
    assert _single(runner, ids, 8, drafter="none").tokens == contract.generate_ids(ids, 8, drafter="none").tokens
    with pytest.raises(UnsupportedError, match="is causal: tree drafts need its tree form"):
        _single(runner, ids, 8)
