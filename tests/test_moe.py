"""Mixture-of-experts families (models/moe.py, export/moe_ops.py) against transformers' fp32 eager forward, and the
exactness of their graphs: a row's routing and output do not depend on the other rows of the pass."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB
from test_families import make_family_model
from test_quantized_exact import PROMPTS, assert_greedy_speculative_equals_plain

MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "hunyuan_v1_moe", "gemma4-moe", "cohere2_moe", "cohere2_moe-sigmoid", "llama4_text"]
# tests/test_families.py: the tiny configs (a dense layer, a shared expert, renormalised top k; Mixtral with a sliding
# window; gpt-oss: biases, clamped SwiGLU, sinks, yarn; Hunyuan: an ungated shared MLP, q/k norms after rope; Gemma 4:
# normed routing with per-expert scales, GELU experts beside the dense MLP; Cohere 2 MoE: top k then softmax / sigmoid,
# shared experts averaged / summed; Llama 4: top-1 sigmoid weights on the experts' input, a dense layer 0, chunked attention)


@pytest.fixture(scope="module")
def moe_artifacts(tmp_path_factory):
    """Each family's checkpoint and its fp32 export (contract, fused CPU and slotted graphs)."""
    root = tmp_path_factory.mktemp("moe")
    built = {}
    for arch in MOE:
        model = root / arch
        make_family_model(model, arch)
        export_artifact(str(model), root / f"{arch}-art", ExportOptions(max_context=256))
        built[arch] = (model, root / f"{arch}-art")
    yield built
    shutil.rmtree(root, ignore_errors=True)


def _tril(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), bool))


def _logits_in_passes(session, ids: np.ndarray, prefix: int, step: int) -> np.ndarray:
    """Every position's logits: a prefill pass of `prefix` tokens, then passes of `step` tokens."""
    cache, rows = session.new_cache(), []
    for start in [0, *range(prefix, len(ids), step)]:
        q = prefix if start == 0 else min(step, len(ids) - start)
        out = session.run(ids[start:start + q], np.arange(start, start + q), cache.attention_mask(_tril(q)), cache)
        cache.append(out.presents, range(q), q)
        rows.append(out.logits)
    return np.concatenate(rows)


def _transformers_logits(model: Path, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(ids)[None]).logits[0].numpy()


IDS = np.random.default_rng(7).integers(3, TINY_VOCAB, 40)


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("graph", ["contract", "fused"])
def test_exported_logits_match_transformers(moe_artifacts, arch, graph):
    """Teacher-forced, every position (a prefill of 16, then passes of 5): within 1e-4 of each row's largest logit."""
    model, art = moe_artifacts[arch]
    session = open_artifact(art, threads=1, fused=graph == "fused").target
    assert session.spec.file == ("target.ort.onnx" if graph == "fused" else "target.onnx")
    expected = _transformers_logits(model, IDS)
    got = _logits_in_passes(session, IDS, 16, 5)
    error = np.abs(got - expected).max(axis=-1) / np.abs(expected).max(axis=-1)
    assert error.max() < 1e-4, float(error.max())
    assert len(set(expected.argmax(-1))) > 3  # not one token everywhere: the check can tell models apart


@pytest.mark.parametrize("arch", MOE)
def test_torch_reference_matches_transformers(moe_artifacts, arch):
    import torch

    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    model, _ = moe_artifacts[arch]
    loaded = load_model(str(model))
    decoder = build_decoder(loaded.config, loaded.weights)
    with torch.no_grad():
        got = decoder(torch.tensor(IDS)[None], torch.arange(len(IDS))[None], causal_mask(len(IDS), 0), *decoder.empty_past())[0]
    np.testing.assert_allclose(got[0].numpy(), _transformers_logits(model, IDS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", MOE)
def test_a_position_gets_the_same_bits_in_any_pass(moe_artifacts, arch):
    """The fused CPU graph: a position's logits are the same bits decoded alone (q = 1) or inside passes of 2, 3,
    7 rows, whichever experts the other rows of the pass chose."""
    _, art = moe_artifacts[arch]
    session = open_artifact(art, threads=1).target
    assert session.row_invariant
    one_row = _logits_in_passes(session, IDS, 8, 1)
    for q in (2, 3, 7):
        np.testing.assert_array_equal(_logits_in_passes(session, IDS, 8, q), one_row, err_msg=f"q={q}")


@pytest.mark.parametrize("arch", MOE)
def test_greedy_ngram_speculative_equals_plain(moe_artifacts, arch):
    _, art = moe_artifacts[arch]
    runner = Runner(art, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    assert runner.artifact.target.spec.file == "target.ort.onnx"
    assert_greedy_speculative_equals_plain(runner, PROMPTS, 32)


def test_moe_graph_is_sparse_standard_onnx(moe_artifacts):
    """Experts as plain 2-D MatMuls, each on its piece of one Split per layer (no com.microsoft MoE: not row-exact),
    and no per-expert routing nodes: an unchosen expert costs its five MLP nodes on zero rows."""
    _, art = moe_artifacts["qwen2_moe"]
    for name in ("target.onnx", "target.ort.onnx"):
        graph = onnx.load(str(art / name), load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert not {"MoE", "QMoE", "NonZero", "ScatterND"} & set(ops)
        dispatch = [n for n in graph.node if n.op_type == "Split" and len(n.output) == 4]  # 4 experts
        assert len(dispatch) == 2  # one per layer
        assert {f"layers.0.mlp.experts.{e}.weight_t" for e in range(4)} <= {i.name for i in graph.initializer}


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", "hunyuan_v1_moe", "gemma4-moe", "cohere2_moe"])
def test_int4_build_packs_every_expert_and_verifies_identical(moe_artifacts, tmp_path, arch):
    """`build --int4`: every expert (and shared expert) MatMul is a MatMulNBits of the packed fused CPU graph, the
    routers stay float; rows are exact in any pass and `verify` finds speculative decoding identical to plain."""
    from conftest import run_cli

    _, art = moe_artifacts[arch]
    built = tmp_path / "int4"
    result = run_cli("build", str(art), "--int4", "--onnx-only", "--calib-samples", "2", "--out", str(built))
    assert result.returncode == 0, result.stderr
    graph = onnx.load(str(built / "target.ort.onnx"), load_external_data=False).graph
    packed = {n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    float_matmuls = {n.input[1] for n in graph.node if n.op_type == "MatMul"} & {i.name for i in graph.initializer}
    shared = 0 if arch == "gpt_oss" else 2  # Gemma 4: its dense MLP beside the experts
    assert len(packed) == 2 * (2 + 4 * 2 + shared)  # per layer: qkv, o_proj, 4 experts x 2, shared expert x 2
    gated = arch == "qwen2_moe"  # Hunyuan's shared MLP is added ungated
    head = set() if arch in ("gemma4-moe", "cohere2_moe") else {"lm_head.weight_t"}  # a tied head reads the embedding table
    assert float_matmuls == head | {f"layers.{i}.mlp.{name}.weight_t" for i in range(2)
                                                     for name in ("router", *(["shared_expert_gate"] if gated else []))}
    session = open_artifact(built, threads=1).target
    assert session.spec.file == "target.ort.onnx" and session.row_invariant
    one_row = _logits_in_passes(session, IDS, 8, 1)
    np.testing.assert_array_equal(_logits_in_passes(session, IDS, 8, 4), one_row)
    result = run_cli("verify", str(built), "--max-tokens", "16", "--limit", "2")
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("arch", MOE)
def test_torch_moe_block_matches_transformers_block(moe_artifacts, arch):
    """models.moe.SparseMoe with the checkpoint's layer-0 tensors = transformers' MoE block on the same rows."""
    model, _ = moe_artifacts[arch]
    assert_moe_block_matches_transformers(model, 1 if arch == "llama4_text" else 0, 9)  # Llama 4's layer 0 is dense


def assert_moe_block_matches_transformers(model: Path, layer: int, rows: int):
    """SparseMoe with layer `layer`'s tensors vs transformers' block on `rows` random rows; returns the MoeConfig."""
    import torch
    import transformers

    from speccompile.models.load import load_model
    from speccompile.models.moe import SparseMoe

    loaded = load_model(str(model))
    moe = loaded.config.moe
    prefix = moe.prefix(layer)
    block = SparseMoe(loaded.config.hidden_size, moe)
    block.load_state_dict({k[len(prefix):]: v for k, v in loaded.torch_weights().items() if k.startswith(prefix)})
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    x = torch.randn(1, rows, loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if moe.beside_dense:  # Gemma 4: the router and the experts are the layer's own modules
            hf_layer, flat = hf.model.layers[layer], x.reshape(rows, -1)
            expected = hf_layer.experts(flat, *reversed(hf_layer.router(flat)[1:])).reshape(x.shape)
        else:
            expected = getattr(hf.model.layers[layer], moe.block if moe.block == "feed_forward" else "mlp")(x)  # `mlp` (Mixtral too), Llama 4's feed_forward
        expected = expected[0] if isinstance(expected, tuple) else expected
        expected = expected.reshape(x.shape).numpy()  # within 1e-5 of the block's largest output (sums in another expert order)
        np.testing.assert_allclose(block(x).numpy(), expected, atol=1e-5 * float(np.abs(expected).max()), rtol=0)
    return moe


def test_fp16_export_runs_on_the_cpu(moe_artifacts, tmp_path):
    """An fp16 export's contract graph runs on ONNX Runtime CPU (its ScatterND has no fp16 `add` reduction, so the
    block writes sums back without one) and stays near the fp32 graph."""
    model, art = moe_artifacts["qwen2_moe"]
    export_artifact(str(model), tmp_path / "fp16", ExportOptions(max_context=64, dtype="fp16"))
    half = _logits_in_passes(open_artifact(tmp_path / "fp16", threads=1).target, IDS[:20], 12, 4)
    full = _logits_in_passes(open_artifact(art, threads=1, fused=False).target, IDS[:20], 12, 4)
    error = np.abs(half - full).max(axis=-1) / np.abs(full).max(axis=-1)
    assert error.max() < 2e-2, float(error.max())


def test_calibration_takes_an_expert_that_got_no_rows():
    """A calibration sample may route no token to an expert: its MatMul input has zero rows, which adds nothing."""
    from speccompile.engines.calibrate import ActivationRecorder

    recorder = ActivationRecorder(["x"], total_tokens=4, max_rows=4)
    recorder.add("x", np.zeros((0, 8), np.float32))
    recorder.add("x", np.full((2, 8), -3.0, np.float32))
    recorder.add("x", np.zeros((0, 8), np.float32))
    stats = recorder.pop("x")
    assert stats.amax == 3.0 and stats.rows.shape == (2, 8)
