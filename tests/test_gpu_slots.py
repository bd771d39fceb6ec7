"""The slotted GPU verify graph (`target.ort-cuda-slots.onnx`) in its fp32 form on ONNX Runtime's CPU EP: the batch
decoder's third mode (runtime/batch_gpu.py), what `speccompile serve --backend ort-cuda` runs. Batched greedy equals
each request alone, sampled output is exact batched (chi-square), one bucket makes a request's logits bitwise
independent of its batch-mates, and a tree drafter keeps the contract graph through one pass per request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny_hf_model
from speccompile.runtime import Runner
from speccompile.runtime.batch_gpu import SlotGraphPasses
from speccompile.runtime.batch_passes import OnePassPerRequest
from speccompile.runtime.kvcache import causal_mask
from speccompile.runtime.sampling import SamplingParams
from test_batch_passes import _decode
from test_sampling import chi_square_p_value

CONTEXT = 256
PASS_ROWS = 64
SLOTS = 8
PROMPTS = ["abc abc abc abc", "hello there, hello there", "x", "the cat sat on the mat. the cat sat", "0123 0123 0123",
           "ab ab ab ab ab", "hello world", "xyz xyz xy"]


@pytest.fixture(scope="module")
def slot_artifact(tmp_path_factory) -> Path:
    """A tiny fp32 artifact with the fp32 forms of the GPU graph, its 8-slot form and that form's tree form in its
    manifest (chain drafters run the causal slot form)."""
    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest, variant_name
    from speccompile.models.load import load_model

    root = tmp_path_factory.mktemp("gpu_slots")
    model_dir = make_tiny_hf_model(root / "hf")
    out = root / "art"
    export_artifact(str(model_dir), out, ExportOptions(max_context=CONTEXT))
    model = load_model(str(model_dir))
    manifest = read_manifest(out)
    specs, files = export_fused_variant(DecoderWeights(model.config, model.weights), manifest.graph("target"), out,
                                        CONTEXT + PASS_ROWS, target="cuda", slots=SLOTS)
    assert files[:2] == ["target.ort-cuda.onnx", "target.ort-cuda-slots.onnx"] and specs[1].extra["slots"] == SLOTS
    for key, spec in zip(("cuda", "cuda-slots", "cuda-tree-slots"), specs):
        manifest.graphs[variant_name("target", key)] = spec
    manifest.record_files(out, files)
    manifest.write(out)
    return out


def gpu_runner(artifact: Path, rows: int = 0, **options) -> Runner:
    """A Runner whose target is the GPU graph's session on the CPU EP (as `--backend ort-cuda` opens it for chains);
    `rows`: shape-invariant mode, every pass that many rows."""
    from speccompile.manifest import read_manifest, variant_name
    from speccompile.runtime.backends.ort_cuda import DEFAULT_BUCKETS, OrtCudaSession

    runner = Runner(artifact, contract_graph=True, threads=1, **options)
    spec = read_manifest(artifact).graph(variant_name("target", "cuda"))
    runner.artifact.target = OrtCudaSession(artifact, spec, device="cpu", max_context=CONTEXT, threads=1,
                                            buckets=(rows,) if rows else DEFAULT_BUCKETS)
    runner.artifact.shape_invariant = rows
    return runner


def _ids(runner: Runner, text: str) -> list[int]:
    return runner.artifact.tokenizer.prompt_ids(text, chat=False)


def test_eight_greedy_requests_together_equal_each_alone(slot_artifact):
    runner = gpu_runner(slot_artifact, drafter="ngram")
    decoder = runner.batch_decoder(SLOTS)
    assert isinstance(decoder.passes, SlotGraphPasses) and decoder.slots == SLOTS and runner.batch_problem() is None
    assert decoder.passes.session.spec.file == "target.ort-cuda-slots.onnx"  # chains: the causal form (no bias)
    prompts = [_ids(runner, p) for p in PROMPTS]
    together = _decode(decoder, runner, prompts, 24)
    contract = Runner(slot_artifact, drafter="ngram", contract_graph=True, threads=1)
    for ids, result in zip(prompts, together):
        assert result.tokens == runner.generate_ids(ids, 24).tokens  # the single-sequence GPU graph alone
        assert result.tokens == contract.generate_ids(ids, 24, drafter="none").tokens
    assert sum(r.stats.draft_steps for r in together) > 0
    assert decoder.slot_passes < sum(r.stats.target_passes for r in together) / 4  # rounds shared by the requests


def traced(runner: Runner, batch: list[list[int]], max_tokens: int = 16, drafter: str | None = None) -> list:
    """Every prompt of `batch` joined at once to a new batch decoder, logits traced; their results in order."""
    decoder = runner.batch_decoder(SLOTS)
    configs = [runner.config(max_tokens, drafter=drafter) for _ in batch]
    for config in configs:
        config.trace_logits = True
    generations = [decoder.join(ids, config) for ids, config in zip(batch, configs)]
    while decoder.active:
        decoder.step()
    return [g.result() for g in generations]


def test_one_bucket_makes_logits_independent_of_batch_mates(slot_artifact):
    """Shape-invariant mode (one bucket of 8 rows): every pass has the same shapes, so each request's logits batched
    are bitwise its logits decoding alone through the same graph."""
    runner = gpu_runner(slot_artifact, rows=8, drafter="ngram")
    prompts = [_ids(runner, p) for p in PROMPTS[:5]]
    together = traced(runner, prompts)
    for ids, mine in zip(prompts, together):
        (alone,) = traced(runner, [ids])
        assert mine.tokens == alone.tokens and np.array_equal(mine.logits, alone.logits)


def test_prompts_that_arrive_together_prefill_together(slot_artifact):
    """Eight prompts joining at once (as the server joins them: deferred prefill) share their prefill passes: each
    slot pass carries the next 8 rows of every prompt still prefilling, so the prefill takes the passes of the
    longest prompt, not the sum of all. With one bucket each request's logits are bitwise its logits alone (its
    prefill in passes of its own), greedy and seeded sampled."""
    runner = gpu_runner(slot_artifact, rows=8, drafter="ngram")
    prompts = [_ids(runner, p) for p in PROMPTS]
    pieces = [-(-len(ids) // 8) for ids in prompts]
    assert max(pieces) < sum(pieces) / 2
    for sampling in (None, SamplingParams(temperature=1.0, top_k=5, seed=3)):
        configs = [runner.config(16, sampling) for _ in prompts]
        for config in configs:
            config.trace_logits = True
        decoder = runner.batch_decoder(SLOTS)
        joined = decoder.join_many([(ids, config, None) for ids, config in zip(prompts, configs)], defer_prefill=True)
        assert all(g.prefilling for g in joined) and decoder.passes.prefill_passes == 0
        decoder.step()  # nothing to decode yet: every prompt's chunk, in shared passes
        assert not any(g.prefilling for g in joined)
        assert decoder.passes.prefill_passes == max(pieces)  # alone: sum(pieces) passes
        while decoder.active:
            decoder.step()
        for ids, generation in zip(prompts, joined):
            mine = generation.result()
            config = runner.config(16, sampling)
            config.trace_logits = True
            alone_decoder = runner.batch_decoder(SLOTS)
            alone = alone_decoder.join(ids, config)  # prefilled at join, in passes of its own
            while alone_decoder.active:
                alone_decoder.step()
            alone = alone.result()
            assert mine.tokens == alone.tokens and np.array_equal(mine.logits, alone.logits)
            assert mine.stats.prefill_passes == alone.stats.prefill_passes == 1  # one chunk
    decoder = runner.batch_decoder(SLOTS)  # the library's join_many (prefill_together) shares them the same way
    joined = decoder.join_many([(ids, runner.config(16), None) for ids in prompts])
    assert not any(g.prefilling for g in joined) and decoder.passes.prefill_passes == max(pieces)


def _last_logits(runner: Runner, ids: list[int]) -> np.ndarray:
    target = runner.artifact.target
    cache = target.new_cache()
    out = target.run(np.asarray(ids), np.arange(len(ids)), cache.attention_mask(causal_mask(len(ids))), cache)
    return np.asarray(out.logits[-1], dtype=np.float64)


def _top_k_probs(logits: np.ndarray, k: int) -> np.ndarray:
    probs = np.zeros_like(logits)
    top = np.argsort(-logits)[:k]
    weights = np.exp(logits[top] - logits[top].max())
    probs[top] = weights / weights.sum()
    return probs


def seeded_top3(runner: Runner, prompt: list[int], max_tokens: int, samples: int = 640) -> list:
    """`samples` generations of `prompt` with seeded top-3 sampling (seeds 0, 1, ...), SLOTS requests a round."""
    decoder, results = runner.batch_decoder(SLOTS), []
    for start in range(0, samples, SLOTS):
        samplings = [SamplingParams(temperature=1.0, top_k=3, seed=seed) for seed in range(start, start + SLOTS)]
        generations = [decoder.join(prompt, runner.config(max_tokens, sampling)) for sampling in samplings]
        while decoder.active:
            decoder.step()
        results += [generation.result() for generation in generations]
    return results


def test_sampled_two_token_answers_batched_are_exact(slot_artifact):
    """Seeded top-3 sampling of two tokens, eight requests a round with n-gram drafts: the counts of each (first,
    second) pair fit the target's exact joint distribution (chi-square)."""
    runner = gpu_runner(slot_artifact, drafter="ngram")
    contract = Runner(slot_artifact, contract_graph=True, threads=1)
    prompt = _ids(runner, "ab ab ab ab ab a")
    vocab = runner.artifact.tokenizer.vocab_size
    first = _top_k_probs(_last_logits(contract, prompt), 3)
    joint = np.zeros((vocab, vocab))
    for token in np.flatnonzero(first):
        joint[token] = first[token] * _top_k_probs(_last_logits(contract, prompt + [int(token)]), 3)
    counts = np.zeros((vocab, vocab))
    for result in seeded_top3(runner, prompt, 2):
        a, b = result.tokens
        counts[a, b] += 1
    p_value = chi_square_p_value(counts, joint)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.3g}: batched samples are not the target's distribution"


def test_a_tree_drafter_keeps_the_contract_graph_one_pass_per_request(head_artifacts):
    """Without the slotted graph's tree form (an fp32 export has no GPU graphs; onnxruntime-gpu < 1.28 on ort-cuda)
    an EAGLE-3 head verifies on the contract graph, whose batch decoder runs one pass per request (here the contract
    graph on the CPU); each request's tokens equal alone. Batched trees: tests/test_gpu_tree_slots.py."""
    from test_heads_helpers import word_prompt_ids

    runner = Runner(head_artifacts["eagle3"], drafter="eagle3", contract_graph=True, threads=1, adaptive=False)
    decoder = runner.batch_decoder(4)
    assert isinstance(decoder.passes, OnePassPerRequest) and decoder.slots == 4
    prompts = [[1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42]] + [word_prompt_ids(s) for s in range(1, 4)]
    together = _decode(decoder, runner, prompts, 20)
    assert any(r.stats.draft_steps for r in together)
    assert len(runner.artifact._shared_sessions) == 1  # the head's graph opened once for every request
    for ids, result in zip(prompts, together):
        assert result.tokens == runner.generate_ids(ids, 20).tokens


def test_fp16_export_with_batch_slots_writes_the_gpu_slot_form(tmp_path):
    import onnx

    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.manifest import read_manifest, variant_name

    out = tmp_path / "fp16"
    export_artifact(str(make_tiny_hf_model(tmp_path / "llama")), out, ExportOptions(max_context=64, dtype="fp16", batch_slots=3))
    manifest = read_manifest(out)
    spec = manifest.graph(variant_name("target", "cuda-slots"))
    assert spec.file == "target.ort-cuda-slots.onnx" and spec.file in manifest.files and spec.dtype == "fp16"
    assert spec.extra["slots"] == 3 and spec.extra["backends"] == ["ort-cuda"] and spec.extra["masks"] == "causal"
    onnx.checker.check_model(str(out / spec.file), full_check=True)
    model = onnx.load(str(out / spec.file), load_external_data=False)
    assert [n.op_type for n in model.graph.node].count("GroupQueryAttention") == 2 * 3  # one per layer and slot
    inputs = {v.name for v in model.graph.input}
    assert "attention_bias" not in inputs and {"past_key_values.1.2.value", "seqlens_k", "position_ids"} <= inputs
    assert "target.ort-cuda-slots.onnx.data" not in manifest.files  # the weights are the GPU graph's (and target.onnx's)
    tree = manifest.graph(variant_name("target", "cuda-tree-slots"))  # its tree form: a per-slot bias in every pass
    assert tree.file == "target.ort-cuda-tree-slots.onnx" and tree.file in manifest.files and tree.extra["masks"] == "tree"
    assert tree.extra["min_onnxruntime_cuda"] == "1.28" and "target.ort-cuda-tree-slots.onnx.data" not in manifest.files
    onnx.checker.check_model(str(out / tree.file), full_check=True)
    model = onnx.load(str(out / tree.file), load_external_data=False)
    bias = next(v for v in model.graph.input if v.name == "attention_bias")
    assert [d.dim_value or d.dim_param for d in bias.type.tensor_type.shape.dim] == [3, 1, "q_len", "kv_capacity"]
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 * 3 and all(len(n.input) > 10 and n.input[10] for n in gqa)  # every node takes a bias


@pytest.mark.parametrize("arch,overrides", [("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}), ("phi", {"family": True}),
                                            ("hunyuan_v1_dense", {"family": True}),  # rope before GroupQueryAttention
                                            ("ministral3", {"family": True}),  # queries scaled by each slot's positions
                                            ("gemma3n_text", {"family": True})])  # AltUp streams, KV sharing, per-layer embeddings
def test_each_slot_computes_what_the_single_sequence_graph_computes(tmp_path, arch, overrides):
    """Three model families: two slots run different sequences (prefill, then a chain step) in the same passes;
    each slot's logits match the single-sequence GPU graph's for that sequence alone."""
    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest
    from speccompile.models.load import load_model
    from speccompile.runtime.backends.ort_cuda import OrtCudaSession
    from speccompile.runtime.backends.ort_cuda_slots import OrtCudaSlotSession
    from test_gpu_graph import MAX_CONTEXT, _fp32_gpu_form

    out, single_spec, _ = _fp32_gpu_form(tmp_path, arch, **overrides)
    model_dir = tmp_path / arch
    model = load_model(str(model_dir))
    specs, _ = export_fused_variant(DecoderWeights(model.config, model.weights), read_manifest(out).graph("target"), out,
                                    MAX_CONTEXT, target="cuda", slots=2)
    slots = OrtCudaSlotSession(out, specs[1], device="cpu", max_context=MAX_CONTEXT, threads=1)
    single = OrtCudaSession(out, single_spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    rng = np.random.default_rng(7)
    sequences = [(rng.integers(3, 60, 11), rng.integers(3, 60, 3)), (rng.integers(3, 60, 6), rng.integers(3, 60, 1))]
    caches = [slots.slot_cache(b) for b in range(2)]
    prefill = slots.run_slots({b: (prompt, np.arange(len(prompt))) for b, (prompt, _) in enumerate(sequences)})
    prefill_logits = {b: out.logits for b, out in prefill.items()}  # read before the next pass reuses the buffers
    for b, (prompt, _) in enumerate(sequences):
        caches[b].append(prefill[b].presents, range(len(prompt)), len(prompt))
    step = slots.run_slots({b: (ids, np.arange(len(prompt), len(prompt) + len(ids))) for b, (prompt, ids) in enumerate(sequences)})
    for b, (prompt, ids) in enumerate(sequences):
        cache = single.new_cache()
        alone = single.run(prompt, np.arange(len(prompt)), cache.attention_mask(causal_mask(len(prompt))), cache)
        np.testing.assert_allclose(prefill_logits[b], alone.logits, atol=1e-4, rtol=1e-4)
        cache.append(alone.presents, range(len(prompt)), len(prompt))
        alone = single.run(ids, np.arange(len(prompt), len(prompt) + len(ids)), cache.attention_mask(causal_mask(len(ids))), cache)
        np.testing.assert_allclose(step[b].logits, alone.logits, atol=1e-4, rtol=1e-4)
        assert step[b].greedy_tokens.tolist() == np.argmax(step[b].logits, axis=-1).tolist()
