"""The GPU verify graph (target.ort-cuda.onnx) and its session: structure, parity with the contract graph on
ONNX Runtime CPU (fp32 and fp16 forms), bucketing/padding/binding plan, and the real CUDA path (skipped
without a CUDA execution provider)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from speccompile.errors import InputError, UnsupportedError
from speccompile.export.ort_fused_graph import export_fused_variant
from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.manifest import read_manifest, variant_name
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.backends.ort_cuda import (
    FixedKVCache,
    OrtCudaSession,
    binding_plan,
    bucket_for,
    is_causal_step,
    pad_step,
    q_buckets,
)

from conftest import load_benchmark, make_tiny_hf_model

MAX_CONTEXT = 64


def _chain_steps(session, seed: int = 0) -> list[np.ndarray]:
    """Prefill 20, verify a 4-token chain keeping 3, a 2-token step, a 1-token step: the logits of each."""
    rng = np.random.default_rng(seed)
    cache = session.new_cache()
    outs = []
    past = 0
    for q, kept in ((20, 20), (4, 3), (2, 2), (1, 1)):
        ids = rng.integers(3, 60, q)
        out = session.run(ids, np.arange(past, past + q), cache.attention_mask(np.tril(np.ones((q, q), bool))), cache)
        cache.append(out.presents, range(kept), q)
        outs.append(out)
        past += kept
    return outs


def _fp32_gpu_form(tmp_path, arch: str = "llama", family: bool = False, **overrides):
    """An fp32 artifact plus the fp32 form of its GPU graph (what ORT CPU can run); `family`: the checkpoint of
    tests/test_families.py's `make_family_model`."""
    from speccompile.export.recipes import DecoderWeights
    from speccompile.models.load import load_model
    from test_families import make_family_model

    if family:
        make_family_model(tmp_path / arch, arch)
    model_dir = tmp_path / arch if family else make_tiny_hf_model(tmp_path / arch, arch=arch, **overrides)
    out = tmp_path / "art"
    export_artifact(str(model_dir), out, ExportOptions(max_context=MAX_CONTEXT))
    model = load_model(str(model_dir))
    contract = read_manifest(out).graph("target")
    (spec,), files = export_fused_variant(DecoderWeights(model.config, model.weights), contract, out, MAX_CONTEXT, target="cuda")
    return out, spec, files


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}),
                                            ("phi", {"family": True}),  # Phi-2: biased LayerNorms, plain MLP, lm_head bias
                                            ("phi3", {"family": True})])  # longrope, partial rotary, a sliding window
def test_fp32_gpu_form_matches_contract_graph(tmp_path, arch, overrides):
    out, spec, files = _fp32_gpu_form(tmp_path, arch, **overrides)
    assert files[0] == "target.ort-cuda.onnx" and spec.extra["masks"] == "causal"
    gpu = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    contract = open_artifact(out, threads=1, fused=False).target
    for g, c in zip(_chain_steps(gpu), _chain_steps(contract)):
        np.testing.assert_allclose(g.logits, c.logits, atol=1e-4, rtol=1e-4)
        assert g.greedy_tokens.tolist() == np.argmax(g.logits, axis=-1).tolist()


def test_padding_rows_never_change_real_rows(tmp_path):
    """Within one bucket, a row's logits are bitwise the same whether the rows after it are padding or real
    tokens (different buckets may round differently: that is what a fixed bucket per generation avoids)."""
    out, spec, _ = _fp32_gpu_form(tmp_path)
    session = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1, buckets=(4, 32))
    rng = np.random.default_rng(5)
    prompt, step = rng.integers(3, 60, 20), rng.integers(3, 60, 4)
    rows = []
    for q in (1, 4, 2):  # 1 real + 3 padding rows, 4 real rows, 2 real + 2 padding rows
        cache = session.new_cache()
        out_prefill = session.run(prompt, np.arange(20), cache.attention_mask(np.tril(np.ones((20, 20), bool))), cache)
        cache.append(out_prefill.presents, range(20), 20)
        step_out = session.run(step[:q], np.arange(20, 20 + q), cache.attention_mask(np.tril(np.ones((q, q), bool))), cache)
        rows.append(step_out.logits)
    np.testing.assert_array_equal(rows[0][0], rows[1][0])
    np.testing.assert_array_equal(rows[2], rows[1][:2])


def test_fp16_export_writes_the_gpu_graph(tmp_path):
    model_dir = make_tiny_hf_model(tmp_path / "llama")
    out = tmp_path / "fp16"
    notes: list[str] = []
    export_artifact(str(model_dir), out, ExportOptions(max_context=MAX_CONTEXT, dtype="fp16"), notes.append)
    manifest = read_manifest(out)
    spec = manifest.graph(variant_name("target", "cuda"))
    assert spec.file == "target.ort-cuda.onnx" and spec.dtype == "fp16"
    assert spec.extra["backends"] == ["ort-cuda"] and spec.extra["kv_layout"] == "buffer"
    assert "target.ort-cuda.onnx" in manifest.files and "target-ort" not in manifest.graphs
    model = onnx.load(str(out / spec.file), load_external_data=False)
    onnx.checker.check_model(str(out / spec.file), full_check=True)
    assert model.ir_version == 10  # what opset 21 needs (onnxruntime 1.31 loads IR <= 13; onnx 1.23 would write 14)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "SkipSimplifiedLayerNormalization" in ops and "ArgMax" in ops
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert len(gqa.input) == 10 and {a.name: a.i for a in gqa.attribute if a.name == "do_rotary"} == {"do_rotary": 1}
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert "attention_bias" not in types  # the CUDA kernel rejects an attention bias
    assert types["past_key_values.0.key"] == onnx.TensorProto.FLOAT16 and types["present.1.value"] == onnx.TensorProto.FLOAT16
    assert types["logits"] == onnx.TensorProto.FLOAT and types["next_tokens"] == onnx.TensorProto.INT64
    assert types["seqlens_k"] == onnx.TensorProto.INT32 and types["total_sequence_length"] == onnx.TensorProto.INT32
    weights = {i.name: i.data_type for i in model.graph.initializer}
    assert weights["rotary.cos_cache"] == onnx.TensorProto.FLOAT16 and weights["layers.0.self_attn.qkv.weight_t"] == onnx.TensorProto.FLOAT16


def test_fp16_gpu_graph_runs_on_cpu_close_to_contract(tmp_path):
    """ORT CPU runs the fp16 form too (casting where it lacks fp16 kernels): close to the fp16 contract graph."""
    model_dir = make_tiny_hf_model(tmp_path / "llama")
    out = tmp_path / "fp16"
    export_artifact(str(model_dir), out, ExportOptions(max_context=MAX_CONTEXT, dtype="fp16"))
    spec = read_manifest(out).graph(variant_name("target", "cuda"))
    gpu = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    contract = open_artifact(out, threads=1, fused=False).target
    for g, c in zip(_chain_steps(gpu), _chain_steps(contract)):
        np.testing.assert_allclose(g.logits, c.logits, atol=0.1, rtol=0.02)


def test_fp32_and_cpu_exports_have_no_gpu_graph(tiny_artifact):
    assert variant_name("target", "cuda") not in read_manifest(tiny_artifact).graphs


def test_artifact_picks_the_gpu_graph_for_chains_and_the_tree_form_for_trees(tmp_path, capsys):
    model_dir = make_tiny_hf_model(tmp_path / "llama")
    out = tmp_path / "fp16"
    export_artifact(str(model_dir), out, ExportOptions(max_context=MAX_CONTEXT, dtype="fp16"))
    manifest = read_manifest(out)
    from speccompile.runtime.artifact import runnable_spec, tree_form_note

    assert runnable_spec(manifest, "target", "ort-cuda", True, chains=True).file == "target.ort-cuda.onnx"
    assert runnable_spec(manifest, "target", "ort-cuda", True, chains=False).file == "target.onnx"  # trees
    # a single stream's trees: the slotted GPU graph's tree form (written by default, --batch-slots 8), in one slot
    assert runnable_spec(manifest, "target", "ort-cuda", True, chains=False, single=True).file == "target.ort-cuda-tree-slots.onnx"
    assert tree_form_note(manifest, "ort-cuda", "suffix") is None
    del manifest.graphs[variant_name("target", "cuda-tree-slots")]  # an export without it (--batch-slots 0, older)
    assert runnable_spec(manifest, "target", "ort-cuda", True, chains=False, single=True).file == "target.onnx"
    assert "no target.ort-cuda-tree-slots.onnx" in tree_form_note(manifest, "ort-cuda", "suffix")
    manifest.write(out)
    from speccompile.commands.generate import check_artifact_backend

    check_artifact_backend(out, "ort-cuda", "suffix")  # what run / bench / verify print before loading
    assert capsys.readouterr().err.count("note: ") == 1
    check_artifact_backend(out, "ort-cuda", "suffix", fused=False)  # --contract-graph: asked for, no note
    assert "note: " not in capsys.readouterr().err
    assert tree_form_note(manifest, "ort-cuda", "ngram") is None and tree_form_note(manifest, "ort-cpu", "suffix") is None
    assert runnable_spec(manifest, "target", "ort-cuda", False, chains=True).file == "target.onnx"  # --contract-graph
    assert runnable_spec(manifest, "target", "ort-cpu", True, chains=True).file == "target.onnx"


# -- pure parts ---------------------------------------------------------------------------------------
def test_buckets():
    assert q_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert q_buckets(13) == (1, 2, 4, 8, 16)
    assert q_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert q_buckets(5, (4, 12)) == (4, 12)
    assert [bucket_for(q, (1, 2, 4, 8)) for q in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(InputError):
        q_buckets(0)


def test_padding_and_causal_check():
    ids, pos = pad_step(np.array([5, 6, 7]), np.array([10, 11, 12]), 8, max_position=14)
    assert ids.tolist() == [[5, 6, 7, 7, 7, 7, 7, 7]] and pos.tolist() == [[10, 11, 12, 13, 13, 13, 13, 13]]
    causal = np.concatenate([np.ones((3, 5), bool), np.tril(np.ones((3, 3), bool))], axis=1)[None]
    assert is_causal_step(causal, 5)
    tree = causal.copy()
    tree[0, 2, 6] = False  # row 2 does not see row 1: a tree
    assert not is_causal_step(tree, 5)
    hidden_past = causal.copy()
    hidden_past[0, :, 1] = False
    assert not is_causal_step(hidden_past, 5)
    # the shape-invariant wrapper's form: 2 real rows + 2 padding rows that see only their own slot,
    # over a fixed KV extent of 16 slots
    wide = np.zeros((1, 4, 16), bool)
    wide[0, :2, :5] = True
    wide[0, :2, 5:7] = np.tril(np.ones((2, 2), bool))
    wide[0, 2, 7] = wide[0, 3, 8] = True
    assert is_causal_step(wide, 5)
    late = wide.copy()
    late[0, 3] = False
    late[0, 3, :9] = True  # a real row after a padding row would see the padding row's KV
    assert not is_causal_step(late, 5)
    assert not is_causal_step(causal[:, :, :7], 5)  # narrower than past + rows


def test_binding_plan_shares_kv_and_fixes_per_bucket_buffers(tmp_path):
    model_dir = make_tiny_hf_model(tmp_path / "llama")
    out = tmp_path / "fp16"
    export_artifact(str(model_dir), out, ExportOptions(max_context=MAX_CONTEXT, dtype="fp16"))
    spec = read_manifest(out).graph(variant_name("target", "cuda"))
    p4, p8 = binding_plan(spec, 4, 128), binding_plan(spec, 8, 128)
    assert set(p4.inputs) == set(spec.input_names()) and set(p4.outputs) == set(spec.output_names())
    assert p4.inputs["past_key_values.1.value"] is p4.outputs["present.1.value"]  # one buffer: in place
    assert p4.inputs["past_key_values.0.key"].shape == (1, 2, 128, 16) and p4.inputs["past_key_values.0.key"].dtype == "float16"
    assert p4.inputs["past_key_values.0.key"] == p8.inputs["past_key_values.0.key"]  # shared by all buckets
    assert p4.inputs["total_sequence_length"].device == "cpu" and p4.inputs["seqlens_k"].device == "device"
    assert p4.outputs["logits"].shape == (1, 4, 96) and p8.outputs["logits"].key != p4.outputs["logits"].key
    assert p4.outputs["next_tokens"].shape == (1, 4) and p4.inputs["input_ids"].shape == (1, 4)
    assert len(p4.buffers()) == len(spec.input_names()) + len(spec.output_names()) - len(spec.input_names()) + 4
    # past inputs and present outputs are one buffer each; 4 = ids, positions, seqlens_k, total_sequence_length


def test_fixed_cache_bookkeeping():
    cache = FixedKVCache(["k", "v"], capacity=8)
    cache.reserve(8)
    with pytest.raises(InputError, match="exceeds the KV buffer of 8"):
        cache.reserve(9)
    cache.append([], keep=[0, 1, 2], num_new=4)
    assert cache.length == 3 and cache.tensors == ["k", "v"] and cache.dead == 0
    with pytest.raises(UnsupportedError):
        cache.append([], keep=[0, 2], num_new=3)  # a tree path: the GPU graph verifies chains
    assert cache.attention_mask(np.ones((1, 1), bool)).shape == (1, 1, 4)
    cache.truncate(1)
    assert cache.length == 1


def test_cpu_session_refuses_tree_masks(tmp_path):
    out, spec, _ = _fp32_gpu_form(tmp_path)
    session = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    cache = session.new_cache()
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    with pytest.raises(UnsupportedError, match="tree drafts"):
        session.run(np.array([3, 4, 5]), np.array([0, 1, 1]), cache.attention_mask(tree), cache)
    with pytest.raises(InputError, match="CUDA graphs need device 'cuda'"):
        OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, cuda_graph=True)


# -- the real CUDA path -------------------------------------------------------------------------------
def _has_cuda_ep() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda_ep(), reason="onnxruntime here has no CUDAExecutionProvider (needs onnxruntime-gpu and a GPU)")
def test_cuda_graph_session_matches_uncaptured_and_contract(tmp_path):
    model_dir = make_tiny_hf_model(tmp_path / "llama")
    out = tmp_path / "fp16"
    export_artifact(str(model_dir), out, ExportOptions(max_context=MAX_CONTEXT, dtype="fp16"))
    spec = read_manifest(out).graph(variant_name("target", "cuda"))
    graphs = OrtCudaSession(out, spec, device="cuda", max_context=MAX_CONTEXT, cuda_graph=True)
    plain = OrtCudaSession(out, spec, device="cuda", max_context=MAX_CONTEXT, cuda_graph=False)
    contract = open_artifact(out, threads=1, fused=False).target
    for _ in range(3):  # ONNX Runtime captures after warm-up runs: replays must give the same rows
        for g, p, c in zip(_chain_steps(graphs), _chain_steps(plain), _chain_steps(contract)):
            np.testing.assert_array_equal(g.logits, p.logits)
            np.testing.assert_allclose(g.logits, c.logits, atol=0.1, rtol=0.02)


def test_generation_through_the_gpu_session_on_cpu(tmp_path):
    """The whole decode loop (prefill, n-gram chain verification, commits) over the GPU session on ORT CPU
    gives the contract graph's greedy tokens, plain and speculative."""
    from speccompile.runtime.session import Runner

    out, spec, _ = _fp32_gpu_form(tmp_path)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    reference = Runner(out, drafter="ngram", contract_graph=True, threads=1)
    runner = Runner(out, drafter="ngram", contract_graph=True, threads=1)
    runner.artifact.target = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    expected = reference.generate_ids(prompt, max_tokens=24, drafter="none").tokens
    for drafter in ("none", "ngram"):
        result = runner.generate_ids(prompt, max_tokens=24, drafter=drafter)
        assert result.tokens == expected, drafter
    assert result.stats.draft_steps > 0


def test_session_accepts_the_shape_invariant_form(tmp_path):
    """Rows padded by the caller (padding rows see only their own slot) over a fixed KV extent, as the
    shape-invariant wrapper passes them: the real rows are bitwise those of the unpadded step."""
    out, spec, _ = _fp32_gpu_form(tmp_path)
    session = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1, buckets=(4, 32))
    rng = np.random.default_rng(7)
    prompt, step = rng.integers(3, 60, 20), rng.integers(3, 60, 2)
    results = []
    for padded in (False, True):
        cache = session.new_cache(capacity=MAX_CONTEXT)
        first = session.run(prompt, np.arange(20), cache.attention_mask(np.tril(np.ones((20, 20), bool))), cache)
        cache.append(first.presents, range(20), 20)
        mask = cache.attention_mask(np.tril(np.ones((2, 2), bool)))
        ids, pos = step, np.arange(20, 22)
        if padded:
            wide = np.zeros((1, 4, MAX_CONTEXT), bool)
            wide[0, :2, :22] = mask[0]
            wide[0, 2, 22] = wide[0, 3, 23] = True
            mask, ids, pos = wide, np.r_[step, step[-1], step[-1]], np.r_[pos, 21, 21]
        results.append(session.run(ids, pos, mask, cache).logits[:2])
    np.testing.assert_array_equal(results[0], results[1])
    with pytest.raises(InputError, match="exceeds the GPU session's buffer"):
        session.new_cache(capacity=MAX_CONTEXT + 1)


def test_factory_gives_the_gpu_graph_one_bucket_in_shape_invariant_mode(tmp_path):
    """Shape-invariant mode on the GPU graph: every pass in one bucket of the fixed rows (one captured graph),
    so plain and speculative passes share their shapes; otherwise the q buckets."""
    from speccompile.runtime.backends.factory import open_session

    out, spec, _ = _fp32_gpu_form(tmp_path)
    manifest = read_manifest(out)
    fixed = open_session(out, spec, "ort-cpu", 1, manifest=manifest, max_context=MAX_CONTEXT, shape_invariant=8)
    assert isinstance(fixed, OrtCudaSession) and fixed.buckets == (8,)
    free = open_session(out, spec, "ort-cpu", 1, manifest=manifest, max_context=MAX_CONTEXT)
    assert len(free.buckets) > 1
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    for session in (fixed, free):  # the same tokens either way on the CPU
        cache = session.new_cache()
        out_step = session.run(np.asarray(prompt), np.arange(len(prompt)), cache.attention_mask(np.tril(np.ones((13, 13), bool))), cache)
        assert out_step.logits.shape[0] == 13


def test_greedy_decoding_leaves_the_logits_on_the_device(tmp_path, monkeypatch):
    """Only what the sampler needs comes back: greedy decoding takes the first token and verifies every step from
    the graph's ArgMax rows and never copies the logits (not even the prompt's: [prompt rows, vocab] floats); sampling
    reads them. The tokens are the contract graph's."""
    from speccompile.runtime.backends import ort_cuda
    from speccompile.runtime.sampling import SamplingParams
    from speccompile.runtime.session import Runner

    out, spec, _ = _fp32_gpu_form(tmp_path)
    runner = Runner(out, drafter="ngram", contract_graph=True, threads=1)
    runner.artifact.target = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    fetched: list[int] = []
    read = ort_cuda.DeviceLogitsOutput.logits
    monkeypatch.setattr(ort_cuda.DeviceLogitsOutput, "logits",
                        property(lambda self: fetched.append(1) or read.fget(self), read.fset))
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    greedy = runner.generate_ids(prompt, max_tokens=16)
    contract = Runner(out, drafter="ngram", contract_graph=True, threads=1).generate_ids(prompt, max_tokens=16)
    assert greedy.tokens == contract.tokens
    assert greedy.stats.target_passes > 2 and not fetched  # the first token too comes from the ArgMax of the prompt's last row
    fetched.clear()
    sampled = runner.generate_ids(prompt, max_tokens=16, sampling=SamplingParams(temperature=0.8, seed=1))
    assert len(fetched) >= sampled.stats.target_passes  # every step's rows


def test_pass_time_benchmark_runs_its_sessions_on_the_cpu(tmp_path, capsys):
    """benchmarks/gpu_pass_times.py opens and times every session it reports (here on ONNX Runtime CPU, no CUDA
    graphs): a change of a session's constructor breaks this test, not the device run."""
    model_dir = make_tiny_hf_model(tmp_path / "llama")
    out = tmp_path / "fp16"
    export_artifact(str(model_dir), out, ExportOptions(max_context=2 * MAX_CONTEXT, dtype="fp16"))
    script = load_benchmark("gpu_pass_times")
    assert script.main(["--artifact", str(out), "--device", "cpu", "--context", "4", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["ms_by_q"]) == {"gpu graph, no CUDA graphs", "contract graph"}
    assert all(len(times) == len(script.QS) and min(times.values()) > 0 for times in report["ms_by_q"].values())


def test_warm_up_runs_every_bucket_and_changes_no_output(tmp_path, monkeypatch):
    """The warm-up at open (every bucket run before the first generation, so its CUDA graph is captured there and
    not inside a priced decode pass) leaves nothing behind: the same rows after it as without it."""
    out, spec, _ = _fp32_gpu_form(tmp_path)
    cold = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    warm = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    rows: list[int] = []
    run = OrtCudaSession.run
    monkeypatch.setattr(OrtCudaSession, "run", lambda self, ids, *args: rows.append(len(ids)) or run(self, ids, *args))
    warm.warm_up(runs=2)
    monkeypatch.undo()
    assert sorted(rows) == sorted(2 * list(warm.buckets)) and warm.new_cache().length == 0
    for w, c in zip(_chain_steps(warm), _chain_steps(cold)):
        np.testing.assert_array_equal(w.logits, c.logits)


def _families():
    from test_families import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("name", _families())
def test_every_family_gpu_form_matches_transformers(tmp_path, name):
    """The GPU graph of every family of the architecture table (its fp32 form on ONNX Runtime CPU: sliding windows
    past the window, soft-capping, sinks, MoE, NoPE, multipliers, partial rotary, ...): a prefill and chain passes
    of 4, 2 and 1 rows, every row within 1e-4 (of its largest |logit|) of transformers' fp32 eager forward, and
    `next_tokens` its argmax."""
    from test_families import _close, _hf_logits, make_family_model

    if name == "llama4_text":  # chunks of 8 in 64 KV slots: no GPU graph, said in one line (the export notes it, goes on)
        with pytest.raises(UnsupportedError, match="chunked attention on 64 KV slots, past its chunk of 8"):
            _fp32_gpu_form(tmp_path, name, family=True)
        return
    hf = make_family_model(tmp_path / name, name)
    out, spec, _ = _fp32_gpu_form(tmp_path, name, family=True)
    gpu = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    seq = [int(t) for t in np.random.default_rng(1).integers(3, 60, 27)]
    full = _hf_logits(hf, seq)
    cache, past = gpu.new_cache(), 0
    for q in (20, 4, 2, 1):
        out = gpu.run(np.array(seq[past:past + q]), np.arange(past, past + q), cache.attention_mask(np.tril(np.ones((q, q), bool))), cache)
        _close(out.logits, full[past:past + q], f"{name} GPU form rows {past}..{past + q - 1}")
        assert out.greedy_tokens.tolist() == np.argmax(out.logits, axis=-1).tolist()
        cache.append(out.presents, range(q), q)
        past += q
