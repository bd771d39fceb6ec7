"""The fused ONNX Runtime CPU graph (target.ort.onnx): parity with the contract graph, shared weights, in-place KV."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.manifest import read_manifest
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.kvcache import BufferKVCache

from conftest import make_tiny_hf_model, run_cli

TREE = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)  # root, a, b, a's child


def _steps(session, rng_seed: int = 0) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Prefill 20, a 4-node tree verify (keep root, a, a's child), then a 2-token causal step."""
    rng = np.random.default_rng(rng_seed)
    ids, tree_ids, last_ids = rng.integers(3, 60, 20), rng.integers(3, 60, 4), rng.integers(3, 60, 2)
    cache = session.new_cache()
    outs = []
    out = session.run(ids, np.arange(20), cache.attention_mask(np.tril(np.ones((20, 20), bool))), cache)
    cache.append(out.presents, range(20), 20)
    outs.append(out)
    out = session.run(tree_ids, 20 + TREE.sum(1) - 1, cache.attention_mask(TREE), cache)
    cache.append(out.presents, [0, 1, 3], 4)
    outs.append(out)
    outs.append(session.run(last_ids, np.arange(23, 25), cache.attention_mask(np.tril(np.ones((2, 2), bool))), cache))
    return [(o.logits, o.hidden) for o in outs]


@pytest.mark.parametrize(
    "arch,overrides,hidden",
    [("llama", {}, "eagle3"), ("qwen2", {"tie_word_embeddings": True}, "final"), ("qwen3", {}, None)],
)
def test_fused_graph_matches_contract_graph(tmp_path, arch, overrides, hidden):
    model = make_tiny_hf_model(tmp_path / arch, arch=arch, **overrides)
    out = tmp_path / "art"
    export_artifact(str(model), out, ExportOptions(max_context=64, hidden_states=hidden))
    fused, contract = open_artifact(out, threads=1), open_artifact(out, threads=1, fused=False)
    assert fused.target.spec.file == "target.ort.onnx" and contract.target.spec.file == "target.onnx"
    ops = {n.op_type for n in onnx.load(str(out / "target.ort.onnx"), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    for (f_logits, f_hidden), (c_logits, c_hidden) in zip(_steps(fused.target), _steps(contract.target)):
        np.testing.assert_allclose(f_logits, c_logits, atol=1e-4, rtol=1e-4)
        if hidden:
            np.testing.assert_allclose(f_hidden, c_hidden, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_last_logits_only_is_the_last_row_bitwise(tmp_path, tied):
    """A prefill chunk projects only its last row to the vocabulary: the same bits as the last row of the whole
    pass, the same KV rows and hidden states; without the flag every row comes back."""
    model = make_tiny_hf_model(tmp_path / "m", tie_word_embeddings=tied)
    export_artifact(str(model), tmp_path / "art", ExportOptions(max_context=64, hidden_states="final"))
    session = open_artifact(tmp_path / "art", threads=1).target
    assert session.selects_logits
    rng = np.random.default_rng(0)
    for q in (1, 7, 20):
        ids = rng.integers(3, 60, q)
        mask = np.tril(np.ones((q, q), bool))
        results = []
        for last_only in (False, True):
            cache = session.new_cache()
            out = session.run(ids, np.arange(q), cache.attention_mask(mask), cache, last_logits_only=last_only)
            cache.append(out.presents, range(q), q)
            results.append((out, [np.array(a[:, :, :q]) for a in cache.arrays]))
        (full, full_kv), (last, last_kv) = results
        assert full.logits.shape[0] == q and last.logits.shape[0] == 1
        np.testing.assert_array_equal(last.logits[-1], full.logits[-1])
        np.testing.assert_array_equal(last.hidden, full.hidden)
        for a, b in zip(full_kv, last_kv):
            np.testing.assert_array_equal(a, b)


def _chunked_logits(session, prompt: np.ndarray, tokens: np.ndarray, q: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefill `prompt`, then decode `tokens` in chain passes of q rows; every row's logits and hidden state."""
    cache = session.new_cache()
    out = session.run(prompt, np.arange(len(prompt)), cache.attention_mask(np.tril(np.ones((len(prompt),) * 2, bool))), cache)
    cache.append(out.presents, range(len(prompt)), len(prompt))
    logits, hidden = [], []
    for start in range(0, len(tokens), q):
        chunk = tokens[start: start + q]
        n = len(chunk)
        out = session.run(chunk, np.arange(cache.length, cache.length + n), cache.attention_mask(np.tril(np.ones((n, n), bool))), cache)
        cache.append(out.presents, range(n), n)
        logits.append(out.logits)
        hidden.append(out.hidden)
    return np.concatenate(logits), (np.concatenate(hidden) if hidden[0] is not None else None)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_position_gets_the_same_bits_in_any_pass(tmp_path, arch, monkeypatch):
    """Exact by construction on the CPU: a position's logits and hidden state are the same bits whether it is
    decoded alone (q = 1, plain decoding) or inside a verify pass of 2, 3, 5 or 12 rows, because a one-row pass
    gets attention's padding row (export/ort_fused_graph.py, _OneRowPadding). Negative control: without the
    padding row, q = 1 rounds differently (ONNX Runtime's one-row attention kernel)."""
    model = make_tiny_hf_model(tmp_path / arch, arch=arch)
    export_artifact(str(model), tmp_path / "art", ExportOptions(max_context=128, hidden_states="final"))
    session = open_artifact(tmp_path / "art", threads=1).target
    assert session.row_invariant
    rng = np.random.default_rng(1)
    prompt, tokens = rng.integers(3, 60, 20), rng.integers(3, 60, 12)
    one_row, one_row_hidden = _chunked_logits(session, prompt, tokens, 1)
    for q in (2, 3, 5, 12):
        logits, hidden = _chunked_logits(session, prompt, tokens, q)
        np.testing.assert_array_equal(logits, one_row, err_msg=f"q={q}")
        np.testing.assert_array_equal(hidden, one_row_hidden, err_msg=f"q={q}")
    monkeypatch.setattr(session, "_padding_rows", lambda q, batch=1: 0)
    unpadded, _ = _chunked_logits(session, prompt, tokens, 1)
    assert not np.array_equal(unpadded, one_row)  # what the padding row prevents
    np.testing.assert_allclose(unpadded, one_row, atol=1e-4, rtol=1e-4)  # the same function otherwise


def test_a_fused_graph_from_before_the_padding_row_still_runs(tiny_artifact, tmp_path):
    """An artifact exported before `attention_pad` existed (emulated: the input turned into a constant 0) runs
    as before: the runtime does not bind the input, claims no row invariance, and decodes the same tokens."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_artifact, old)
    model = onnx.load(str(old / "target.ort.onnx"), load_external_data=False)
    model.graph.input.remove(next(i for i in model.graph.input if i.name == "attention_pad"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), "attention_pad"))
    onnx.save(model, str(old / "target.ort.onnx"))
    manifest = read_manifest(old, verify_files=False)
    spec = manifest.graph("target-ort")
    spec.inputs = [t for t in spec.inputs if t.name != "attention_pad"]
    manifest.record_files(old, ["target.ort.onnx"])
    manifest.write(old)
    session = open_artifact(old, threads=1).target
    assert not session.takes_attention_pad and not session.row_invariant
    rng = np.random.default_rng(4)
    prompt, tokens = rng.integers(3, 60, 12), rng.integers(3, 60, 6)
    new_logits, _ = _chunked_logits(open_artifact(tiny_artifact, threads=1).target, prompt, tokens, 2)
    old_logits, _ = _chunked_logits(session, prompt, tokens, 2)
    np.testing.assert_array_equal(old_logits, new_logits)  # passes of >= 2 rows never had the padding row


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "contract"])
def test_one_query_head_per_kv_head_is_row_invariant_too(tmp_path, fused):
    """Multi-head attention (as many KV heads as query heads) has no query groups to fill the attention matmuls'
    rows, so the exported decoder pads them (models/decoder.py, _with_last_row): the contract graph, which
    quantized builds run on the CPU, is then row-invariant like the fused one."""
    model = make_tiny_hf_model(tmp_path / "mha", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=4)
    export_artifact(str(model), tmp_path / "art", ExportOptions(max_context=96, hidden_states="final"))
    session = open_artifact(tmp_path / "art", threads=1, fused=fused).target
    rng = np.random.default_rng(2)
    prompt, tokens = rng.integers(3, 60, 20), rng.integers(3, 60, 9)
    one_row, one_row_hidden = _chunked_logits(session, prompt, tokens, 1)
    for q in (2, 3, 9):
        logits, hidden = _chunked_logits(session, prompt, tokens, q)
        np.testing.assert_array_equal(logits, one_row, err_msg=f"q={q}")
        np.testing.assert_array_equal(hidden, one_row_hidden, err_msg=f"q={q}")


def test_fused_graph_shares_the_contract_weights(tiny_artifact):
    manifest = read_manifest(tiny_artifact)
    spec = manifest.graph("target-ort")
    assert spec.extra["kv_layout"] == "buffer" and spec.extra["variant_of"] == "target.onnx"
    model = onnx.load(str(tiny_artifact / "target.ort.onnx"), load_external_data=False)
    own = 0
    for init in model.graph.initializer:
        info = {e.key: e.value for e in init.external_data}
        if not info:
            continue  # small constants stored inline
        if info["location"] == "target.onnx.data":
            continue
        # new bytes: only the rotary tables and tensors the contract graph keeps inline (< 1 KB)
        assert info["location"] == "target.ort.onnx.data"
        assert init.name.startswith("rotary.") or int(info["length"]) < 1024, init.name
        own += int(info["length"])
    shared = [i for i in model.graph.initializer if any(e.value == "target.onnx.data" for e in i.external_data)]
    assert len(shared) >= 2 * manifest.model["config"]["num_hidden_layers"] + 1  # big matmul weights + embeddings
    head_dim = manifest.model["config"]["head_dim"]
    assert own >= 2 * 256 * head_dim // 2 * 4  # cos + sin: (kv capacity + 1) x head_dim/2 floats each
    # the file holds what the fused graph and its slotted form (export --batch-slots) add, equal tensors once
    pieces = set()
    for graph in ("target.ort.onnx", "target.ort-slots.onnx"):
        for init in onnx.load(str(tiny_artifact / graph), load_external_data=False).graph.initializer:
            info = {e.key: e.value for e in init.external_data}
            if info.get("location") == "target.ort.onnx.data":
                pieces.add((int(info["offset"]), int(info["length"])))
    ends = sorted((offset + length, offset) for offset, length in pieces)  # each piece once, aligned, no gaps beyond
    assert (tiny_artifact / "target.ort.onnx.data").stat().st_size == ends[-1][0]
    assert sum(length for _, length in pieces) > ends[-1][0] - 64 * len(pieces)
    assert "target.ort.onnx" in manifest.files and "target.ort.onnx.data" in manifest.files


def test_buffer_cache_moves_only_accepted_tree_rows():
    cache = BufferKVCache([(1, 2)], np.float32, wrap=lambda a: a, capacity=4)
    cache.reserve(5)  # grows (doubling) and keeps nothing yet
    assert cache.capacity == 8 and cache.length == 0
    cache.arrays[0][0, 0, :5] = np.arange(5, dtype=np.float32)[:, None]  # what the graph writes in place
    cache.append([], keep=[0, 2, 4], num_new=5)
    assert cache.length == 3 and cache.arrays[0][0, 0, :3, 0].tolist() == [0, 2, 4]
    assert cache.attention_mask(np.ones((1, 1), bool)).tolist() == [[[True, True, True, True]]]
    cache.reserve(20)
    assert cache.capacity == 20 and cache.arrays[0][0, 0, :3, 0].tolist() == [0, 2, 4]
    assert cache.tensors[0] is cache.arrays[0]
    cache.truncate(1)
    assert cache.length == 1 and cache.dead == 0


def test_fused_cache_growth_keeps_results(tiny_artifact):
    fused, contract = open_artifact(tiny_artifact, threads=1), open_artifact(tiny_artifact, threads=1, fused=False)
    fused.target.initial_capacity = 3  # force several reallocations during the steps
    for (f_logits, _), (c_logits, _) in zip(_steps(fused.target, 1), _steps(contract.target, 1)):
        np.testing.assert_allclose(f_logits, c_logits, atol=1e-4, rtol=1e-4)


def test_no_fused_graph_when_disabled_or_unsupported(tmp_path, tiny_model_dir):
    out = tmp_path / "plain"
    export_artifact(str(tiny_model_dir), out, ExportOptions(max_context=64, fused_cpu_graph=False))
    assert "target-ort" not in read_manifest(out).graphs and not (out / "target.ort.onnx").exists()
    odd = make_tiny_hf_model(tmp_path / "hd8", hidden_size=32)  # head_dim 8: GQA's rotary needs a multiple of 16
    notes: list[str] = []
    export_artifact(str(odd), tmp_path / "hd8_art", ExportOptions(max_context=64), notes.append)
    assert "target-ort" not in read_manifest(tmp_path / "hd8_art").graphs
    assert any("head_dim % 16" in n for n in notes)
    # the runtime then uses the contract graph
    assert open_artifact(tmp_path / "hd8_art", threads=1).target.spec.file == "target.onnx"


def test_build_drops_the_fused_variant(tiny_artifact, tmp_path):
    """An FP8 build drops the stale fp32 fused graph (an INT4 / INT8 build writes its packed one instead:
    tests/test_cpu_graph.py)."""
    out = tmp_path / "fp8"
    result = run_cli("build", str(tiny_artifact), "--fp8", "--onnx-only", "--calib-samples", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert "target-ort" not in manifest.graphs and not (out / "target.ort.onnx").exists()
    assert all(not name.startswith("target.ort") for name in manifest.files)
    assert open_artifact(out, threads=1).target.spec.file == "target.onnx"


def test_contract_graph_flag(tiny_artifact):
    result = run_cli("run", str(tiny_artifact), "--prompt", "abc abc", "--raw", "--max-tokens", "8", "--json", "--contract-graph", "--threads", "1")
    assert result.returncode == 0, result.stderr


def _table_readers(graph_path) -> tuple[onnx.TensorProto, onnx.TensorProto]:
    """The initializers the embedding Gather and the tied lm_head Gemm of a fused CPU graph read."""
    model = onnx.load(str(graph_path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits)
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm" and n.input[1] in inits)
    return inits[gather.input[0]], inits[gemm.input[1]]


def _mapped_rss_kb(path) -> int:
    """Resident kB of this process's mappings of file `path` (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else None
            elif parts and parts[0] == "Rss:" and current == str(path):
                total += int(parts[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_tied_table_is_not_resident_twice(tmp_path):
    """A tied table is read by the embedding Gather and by the lm_head Gemm, which ONNX Runtime prepacks (a copy).
    Each reads an initializer entry of its own over the same bytes, so the Gemm's mapping is released after
    prepacking and the Gather's keeps only the rows it looked up: the table file is not wholly resident beside
    the prepacked copy (docs/cpu.md, Memory). The same holds for an INT4 build's packed graph."""
    from speccompile.weights_file import external_location

    model = make_tiny_hf_model(tmp_path / "m", tie_word_embeddings=True, vocab_size=32768, hidden_size=128, intermediate_size=128)
    export_artifact(str(model), tmp_path / "art", ExportOptions(max_context=64))
    built = tmp_path / "int4"
    assert run_cli("build", str(tmp_path / "art"), "--out", str(built), "--int4", "--onnx-only", "--no-awq",
                   "--no-clip-search", "--no-gptq").returncode == 0
    for artifact in (tmp_path / "art", built):
        embed, head = _table_readers(artifact / "target.ort.onnx")
        assert embed.name != head.name
        assert external_location(embed) == external_location(head) is not None  # the bytes are stored once
        session = open_artifact(artifact, threads=1).target
        cache = session.new_cache()
        ids = np.arange(3, 11)
        session.run(ids, np.arange(8), cache.attention_mask(np.tril(np.ones((8, 8), bool))), cache)
        table_kb = 32768 * 128 * 4 // 1024
        resident = _mapped_rss_kb(artifact / external_location(embed).location)
        assert resident < table_kb // 4, (artifact.name, resident, table_kb)
        del session


def test_attention_forms_benchmark_agrees_with_group_query_attention(tiny_artifact, capsys):
    """benchmarks/attention_forms.py: its decomposed attention (TensorScatter into the bound KV buffers, MatMuls,
    Softmax) computes what GroupQueryAttention computes and writes the same KV rows, and its pass timer runs."""
    from conftest import load_benchmark

    script = load_benchmark("attention_forms")
    for result in script.compare_layer(heads=4, kv_heads=2, head_dim=16, cached=20, rows=(2, 5), repeats=1):
        if "rows" in result:
            assert result["kv_equal"] and result["max_abs_diff"] < 1e-5
    times = script.pass_times(str(tiny_artifact), [4, 12], [1, 3], repeats=1)
    assert set(times) == {(4, 1), (4, 3), (12, 1), (12, 3)} and min(times.values()) > 0


def test_head_dim_256_position_gets_the_same_bits_in_any_pass(tmp_path, monkeypatch):
    """head_dim 256 (Gemma): ONNX Runtime rounds a row's scores against its own block differently by where the pass
    ends in it (backends/wide_head.py), so the runtime cuts passes at the slots measured on this machine (63 mod 128
    on an AMD EPYC, 63 mod 256 on an Intel Xeon with AMX; `WideHeadRule`: a pass that straddles a cut runs split,
    drafts are sized not to): a position's logits are the same bits in chain passes of 1, 2, 3, 5 and 8 rows and on
    a tree's main path, across slots 63, 191 and 319; greedy speculative decoding equals plain. Negative control:
    without the rule, passes that straddle a cut differ. Manifests record `attention_lift`; one from before the
    steps at 192 + 256 k were found ([256, 64]) reads alike."""
    from speccompile.runtime.backends.ort import recorded_lift
    from speccompile.runtime.backends.wide_head import WideHeadRule
    from speccompile.runtime.backends.wide_head_probe import measured_cuts
    from speccompile.runtime.session import Runner

    model = make_tiny_hf_model(tmp_path / "hd256", head_dim=256)
    export_artifact(str(model), tmp_path / "art", ExportOptions(max_context=384, hidden_states="final"))
    session = open_artifact(tmp_path / "art", threads=1).target
    cuts = {width: measured_cuts(width, 1) for width in (256, 512)}
    assert cuts[256] and cuts[512] and session.wide == WideHeadRule(cuts=cuts[256])
    assert recorded_lift([256, 64]) == (128, 64) and recorded_lift(None) == (0, 0)
    assert WideHeadRule.of((128, 64), [512], 1) == WideHeadRule(cuts=cuts[512]) and not WideHeadRule.of((0, 0), [256], 1).active
    assert WideHeadRule.of((128, 64), [256, 512], 1).cuts == tuple(sorted({*cuts[256], *cuts[512]}))
    assert WideHeadRule.of((128, 64), [192], 1) == WideHeadRule(cuts=measured_cuts(192, 1))  # every width measured
    rng = np.random.default_rng(3)
    uncut_differs = False
    for length in (58, 180, 314):  # passes from 58..72 cross the cut at 63, 180..194 at 191, 314..328 at 319
        prompt, tokens = rng.integers(3, 60, length), rng.integers(3, 60, 15)
        one_row, one_row_hidden = _chunked_logits(session, prompt, tokens, 1)
        for q in (2, 3, 5, 8):
            logits, hidden = _chunked_logits(session, prompt, tokens, q)
            np.testing.assert_array_equal(logits, one_row, err_msg=f"q={q}")
            np.testing.assert_array_equal(hidden, one_row_hidden, err_msg=f"q={q}")
        cache = session.new_cache()
        out = session.run(prompt, np.arange(length), cache.attention_mask(np.tril(np.ones((length, length), bool))), cache)
        cache.append(out.presents, range(length), length)
        tree = session.run(tokens[[0, 1, 5, 2]], length + TREE.sum(1) - 1, cache.attention_mask(TREE), cache)
        np.testing.assert_array_equal(tree.logits[[0, 1, 3]], one_row[:3])  # root, a, a's child: the main path
        with monkeypatch.context() as patch:
            patch.setattr(session, "wide", WideHeadRule())
            uncut = [_chunked_logits(session, prompt, tokens, q)[0] for q in (1, 2, 3, 5, 8)]
        uncut_differs |= any(not np.array_equal(u, one_row) for u in uncut)
    assert uncut_differs  # what the cuts prevent
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    text = "abc abd abc abd abc abd abc " * 3
    plain = runner.generate(text, chat=False, max_tokens=40, drafter="none")
    assert runner.generate(text, chat=False, max_tokens=40).tokens == plain.tokens


def test_gemma4_head_widths_256_and_512_get_the_same_bits_in_any_pass(tmp_path, monkeypatch):
    """Gemma 4's real head widths (sliding 256, full 512): the runtime cuts at both widths' slots as measured on this
    machine (an AMD EPYC: 31, 63 and 95 mod 128; an Intel Xeon with AMX: 31 and 63 mod 128, 63 mod 256;
    backends/wide_head.py), so a position's logits are the same bits in chain passes of 1, 3, 5 and 8 rows across
    the cuts. Negative control: without the cuts, passes that straddle one differ."""
    from test_families import make_family_model

    from speccompile.runtime.backends.wide_head import WideHeadRule
    from speccompile.runtime.backends.wide_head_probe import measured_cuts

    shape = dict(model_type="gemma4_text", sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                 hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                 num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0)
    make_family_model(tmp_path / "g4", "g4", families={"g4": shape})
    export_artifact(str(tmp_path / "g4"), tmp_path / "art", ExportOptions(max_context=256))
    session = open_artifact(tmp_path / "art", threads=1).target
    assert session.wide == WideHeadRule(cuts=tuple(sorted({*measured_cuts(256, 1), *measured_cuts(512, 1)})))
    prompt, tokens = np.random.default_rng(5).integers(3, 60, (2, 80))
    one_row = _chunked_logits(session, prompt, tokens, 1)[0]
    for q in (3, 5, 8):
        np.testing.assert_array_equal(_chunked_logits(session, prompt, tokens, q)[0], one_row, err_msg=f"q={q}")
    with monkeypatch.context() as patch:
        patch.setattr(session, "wide", WideHeadRule())
        uncut = [_chunked_logits(session, prompt, tokens, q)[0] for q in (1, 3, 5, 8)]
    assert any(not np.array_equal(x, uncut[0]) for x in uncut[1:])
