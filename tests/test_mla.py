"""Multi-head latent attention (DeepSeek-V3 / Kimi K2 / Moonlight; models/mla.py, export/mla_ops.py) and DeepSeek-V3's
sigmoid group routing against transformers' fp32 eager forward, and the exactness of their graphs. The tiny family
(tests/test_families.py "deepseek_v3": a 48-wide cache head) also runs in the per-family oracle."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

import test_families
from conftest import run_cli
from test_families import make_family_model
from test_moe import _logits_in_passes, _transformers_logits, assert_moe_block_matches_transformers
from test_ort_fused import _chunked_logits
from test_quantized_exact import PROMPTS, assert_greedy_speculative_equals_plain

# DeepSeek-V3's own widths (kv_lora_rank 512 + rope 64 = a 576-wide cache head, nope 128, v 128), 2 heads, q_proj
# (no q_lora_rank), rope not interleaved: the paths the tiny family does not take
WIDE = dict(test_families.FAMILIES["deepseek_v3"], model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
            rope_interleave=False)


def _with_score_bias(folder, name: str):
    """The family's checkpoint with e_score_correction_bias away from zero (it moves the choice, not the weights)."""
    import torch

    hf = make_family_model(folder, name)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(layer.mlp.gate.e_score_correction_bias.shape))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """(tiny checkpoint, its export, wide checkpoint, its export)."""
    root = tmp_path_factory.mktemp("mla")
    test_families.FAMILIES["deepseek_v3-wide"] = WIDE
    try:
        _with_score_bias(root / "tiny", "deepseek_v3")
        _with_score_bias(root / "wide", "deepseek_v3-wide")
    finally:
        del test_families.FAMILIES["deepseek_v3-wide"]
    export_artifact(str(root / "tiny"), root / "tiny-art", ExportOptions(max_context=256))
    export_artifact(str(root / "wide"), root / "wide-art", ExportOptions(max_context=256))
    yield root / "tiny", root / "tiny-art", root / "wide", root / "wide-art"
    shutil.rmtree(root, ignore_errors=True)


IDS = np.random.default_rng(11).integers(3, 90, 40)


@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_logits_match_transformers_at_every_position(mla, which):
    """Teacher-forced (a prefill of 16, then passes of 5), every graph the export wrote, and the torch reference:
    within 1e-4 of each row's largest logit (the absorbed form sums in another order than transformers)."""
    import torch

    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    model, art = mla[:2] if which == "tiny" else mla[2:]
    expected = _transformers_logits(model, IDS)
    loaded = load_model(str(model))
    decoder = build_decoder(loaded.config, loaded.weights)
    with torch.no_grad():
        torch_logits = decoder(torch.tensor(IDS)[None], torch.arange(len(IDS))[None], causal_mask(len(IDS), 0), *decoder.empty_past())[0]
    results = {"torch": torch_logits[0].numpy()}
    for fused in ((True, False) if which == "tiny" else (False,)):
        results[f"fused={fused}"] = _logits_in_passes(open_artifact(art, threads=1, fused=fused).target, IDS, 16, 5)
    for what, got in results.items():
        error = np.abs(got - expected).max(axis=-1) / np.abs(expected).max(axis=-1)
        assert error.max() < 1e-4, (what, float(error.max()))
    assert len(set(expected.argmax(-1))) > 3  # not one token everywhere


def test_the_cache_is_one_latent_head(mla):
    """Per layer and token one vector of kv_lora_rank + rope values (kv heads 1), not heads x (nope + rope + v)."""
    _, tiny_art, _, wide_art = mla
    spec = open_artifact(wide_art, threads=1).target.spec
    assert (spec.num_kv_heads, spec.head_dim) == (1, 576)
    graph = onnx.load(str(wide_art / "target.onnx"), load_external_data=False).graph
    past = next(i for i in graph.input if i.name == "past_key_values.0.key")
    assert [d.dim_value or d.dim_param for d in past.type.tensor_type.shape.dim] == ["batch", 1, "past_len", 576]
    assert open_artifact(tiny_art, threads=1).target.spec.head_dim == 48  # 32 + 16


def test_wide_head_refuses_the_fused_graph_and_the_contract_graph_is_row_exact(mla):
    """At 576 the fused CPU graph is not written (ONNX Runtime's GroupQueryAttention rounds a row by the pass at
    that width); the contract graph, which ort-cpu then runs, gives a position the same bits in passes of 1, 2, 3, 5
    and 8 rows, at totals on both sides of 16, 32, 64 and 128 (its scores in 128-dim slices)."""
    _, _, _, art = mla
    assert not (art / "target.ort.onnx").exists()
    session = open_artifact(art, threads=1).target
    assert session.spec.file == "target.onnx"
    rng = np.random.default_rng(3)
    for length in (8, 20, 56, 120):
        prompt, tokens = rng.integers(3, 90, length), rng.integers(3, 90, 15)
        one_row = _chunked_logits(session, prompt, tokens, 1)[0]
        for q in (2, 3, 5, 8):
            np.testing.assert_array_equal(_chunked_logits(session, prompt, tokens, q)[0], one_row, err_msg=f"{length} q={q}")


@pytest.mark.parametrize("which", ["tiny", "wide"])
def test_greedy_ngram_speculative_equals_plain(mla, which):
    art = mla[1] if which == "tiny" else mla[3]
    runner = Runner(art, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    assert_greedy_speculative_equals_plain(runner, PROMPTS, 32)


def test_group_routing_matches_transformers_block(mla):
    """models.moe.SparseMoe with layer 1's tensors (bias away from zero, 2 of 4 groups) = transformers' block."""
    from speccompile.models.load import load_model

    moe = assert_moe_block_matches_transformers(mla[0], 1, 33)
    assert (moe.routing, moe.n_group, moe.topk_group, moe.dense_layers, moe.shared_gated) == ("sigmoid_group", 4, 2, (0,), False)
    bias = load_model(str(mla[0])).weights.read("model.layers.1.mlp.gate.e_score_correction_bias")
    assert np.abs(bias).max() > 0


def test_int4_build_packs_and_verifies_identical(mla, tmp_path):
    """`build --int4`: the latent projections (q_a|kv_a, q_b, o_proj), dense MLP and experts are MatMulNBits; kv_b
    stays float (read through Reshape/Split as the per-head W_UK / W_UV); `verify` finds speculative == plain."""
    _, art, _, _ = mla
    built = tmp_path / "int4"
    result = run_cli("build", str(art), "--int4", "--onnx-only", "--calib-samples", "2", "--out", str(built))
    assert result.returncode == 0, result.stderr
    graph = onnx.load(str(built / "target.ort.onnx"), load_external_data=False).graph
    packed = {n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    for name in ("layers.0.q_kv_a", "layers.0.q_b", "layers.1.q_kv_a", "layers.1.q_b", "layers.1.mlp.shared_expert.weight_t"):
        assert any(f"/{name}_int4" in p for p in packed), name
    assert len(packed) == 2 * 3 + 2 + 8 * 2 + 2  # per layer q_a|kv_a, q_b, o_proj; layer 0's MLP; 8 experts, shared
    float_matmuls = {n.input[1] for n in graph.node if n.op_type == "MatMul"} & {i.name for i in graph.initializer}
    assert float_matmuls == {"lm_head.weight_t", "layers.1.mlp.router.weight_t"}
    assert {"layers.0.kv_b", "layers.1.kv_b"} <= {i.name for i in graph.initializer}
    result = run_cli("verify", str(built), "--max-tokens", "16", "--limit", "2")
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout + result.stderr


def test_slot_rounds_decode_as_alone(mla):
    """The slotted CPU graph (one GroupQueryAttention per slot over the latent cache): requests decoded together,
    drafts riding in slot passes, get the tokens they get alone."""
    from test_batch_slots import PROMPTS as TEXTS, _decode_together, _ids

    runner = Runner(mla[1], drafter="ngram", threads=1, adaptive=False)
    prompts = [_ids(runner, p) for p in TEXTS[:2]]
    decoder = runner.batch_decoder(2, slot_passes="drafts")
    results = _decode_together(decoder, runner, prompts, 24)
    assert decoder.slot_passes > 0
    for ids, result in zip(prompts, results):
        assert result.tokens == runner.generate_ids(ids, 24).tokens
