"""Longrope past its original length (Phi-3.x): a row at position p >= original_max_position_embeddings takes the
long factors, one below it the short ones (models/rope.py). Checked against transformers decoding one token per
forward after a prompt inside the original length (where its per-forward switch gives every row the same set as the
per-row rule) at every position, in the torch reference, the contract graph, the fused CPU graph and the fp32 form
of the GPU graph; verify passes straddling the boundary give each row the bits it gets alone, and greedy n-gram
speculative decoding equals plain decoding past the boundary."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB
from test_families import FAMILIES, _close, make_family_model

ORIGINAL = 16  # original_max_position_embeddings: the first position with the long factors
PROMPT = 8  # prefilled in one forward: inside the original length
LENGTH = 40
MAX_CONTEXT = 48
LONG = dict(FAMILIES["phi3"], original_max_position_embeddings=ORIGINAL, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "original_max_position_embeddings": ORIGINAL,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 1.8, 2.0, 2.5, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0]})


def _model(tmp_path, monkeypatch, long_factor=None):
    """The tiny phi3 checkpoint with original length ORIGINAL (max_position_embeddings 512: attention factor > 1)."""
    overrides = dict(LONG)
    if long_factor is not None:
        overrides["rope_parameters"] = dict(LONG["rope_parameters"], long_factor=long_factor)
    monkeypatch.setitem(FAMILIES, "phi3-long", dict(overrides, model_type="phi3"))
    folder = tmp_path / ("hf" if long_factor is None else "hf-short")
    return make_family_model(folder, "phi3-long"), folder


def _hf_incremental(hf, seq: list[int]) -> np.ndarray:
    """transformers: the prompt in one forward, then one token per forward through its KV cache."""
    import torch

    rows = []
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([seq[:PROMPT]]), use_cache=True)
        rows.append(out.logits[0])
        for p in range(PROMPT, len(seq)):
            out = hf(input_ids=torch.tensor([[seq[p]]]), position_ids=torch.tensor([[p]]),
                     past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0])
    return torch.cat(rows).float().numpy()


def _rows(session, seq: list[int], q: int) -> np.ndarray:
    """The prompt in one pass, then chain passes of q rows: every row's logits."""
    cache = session.new_cache()
    logits, start = [], 0
    for size in [PROMPT] + [q] * ((len(seq) - PROMPT + q - 1) // q):
        chunk = seq[start:start + size]
        out = session.run(np.array(chunk), np.arange(start, start + len(chunk)),
                          cache.attention_mask(np.tril(np.ones((len(chunk),) * 2, bool))), cache)
        cache.append(out.presents, range(len(chunk)), len(chunk))
        logits.append(np.array(out.logits))  # (the GPU session's logits: a buffer the next pass rewrites)
        start += len(chunk)
    return np.concatenate(logits)


def test_longrope_switches_per_row_as_transformers(tmp_path, monkeypatch):
    import torch

    from speccompile.export.ort_fused_graph import export_fused_variant
    from speccompile.export.recipes import DecoderWeights
    from speccompile.manifest import read_manifest
    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model
    from speccompile.runtime.backends.ort_cuda import OrtCudaSession

    hf, folder = _model(tmp_path, monkeypatch)
    assert hf.config.rope_parameters["original_max_position_embeddings"] == ORIGINAL
    seq = [int(t) for t in np.random.default_rng(3).integers(3, TINY_VOCAB, LENGTH)]
    want = _hf_incremental(hf, seq)
    # the test can fail: the short factors alone (the export before) miss transformers past the boundary
    hf_short, _ = _model(tmp_path, monkeypatch, long_factor=LONG["rope_parameters"]["short_factor"])
    short = _hf_incremental(hf_short, seq)
    _close(short[:ORIGINAL], want[:ORIGINAL], "short factors below the boundary")
    rel = np.abs(short - want).max(-1) / np.abs(want).max(-1)
    assert rel[ORIGINAL:].min() > 1e-3, "the long factors must matter in this test"

    model = load_model(str(folder))
    decoder = build_decoder(model.config, model.weights)
    with torch.no_grad():
        logits = decoder(torch.tensor([seq]), torch.arange(LENGTH)[None], causal_mask(LENGTH, 0), *decoder.empty_past())[0]
    _close(logits[0].numpy(), want, "torch reference")

    out = tmp_path / "art"
    export_artifact(str(folder), out, ExportOptions(max_context=MAX_CONTEXT))
    for fused in (False, True):
        session = open_artifact(out, threads=1, fused=fused).target
        _close(_rows(session, seq, 1), want, f"{'fused' if fused else 'contract'} one row per pass")
        _close(_rows(session, seq, 5), want, f"{'fused' if fused else 'contract'} 5-row passes")
    fused = open_artifact(out, threads=1).target  # passes straddling position 16: each row the bits it gets alone
    np.testing.assert_array_equal(_rows(fused, seq, 1), _rows(fused, seq, 3))
    np.testing.assert_array_equal(_rows(fused, seq, 1), _rows(fused, seq, 5))

    contract = read_manifest(out).graph("target")
    (spec,), _ = export_fused_variant(DecoderWeights(model.config, model.weights), contract, out, MAX_CONTEXT, target="cuda")
    gpu = OrtCudaSession(out, spec, device="cpu", max_context=MAX_CONTEXT, threads=1)
    _close(_rows(gpu, seq, 1), want, "GPU form (fp32, ORT CPU) one row per pass")
    _close(_rows(gpu, seq, 4), want, "GPU form (fp32, ORT CPU) 4-row passes")

    runner = Runner(out, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd ab"  # 10 tokens: the generation crosses position 16 and runs to 40
    plain = runner.generate(prompt, chat=False, max_tokens=30, drafter="none")
    spec_out = runner.generate(prompt, chat=False, max_tokens=30)
    assert len(plain.tokens) == 30 and spec_out.tokens == plain.tokens


def test_longrope_inside_the_original_length_keeps_the_short_set(tmp_path, monkeypatch):
    """An export whose context stays inside the original length holds no switch: the short tables alone."""
    import onnx.numpy_helper

    from speccompile.models.load import load_model
    from speccompile.models.rope import long_rope_start, rope_attention_factor, rounded_inv_freq

    _, folder = _model(tmp_path, monkeypatch)
    out = tmp_path / "art"
    export_artifact(str(folder), out, ExportOptions(max_context=ORIGINAL))
    contract = onnx.load(str(out / "target.onnx"), load_external_data=False)
    assert not [n for n in contract.graph.node if n.name.startswith("/rotary_emb") and n.op_type == "Where"]
    fused = onnx.load(str(out / "target.ort.onnx"))
    cos = next(onnx.numpy_helper.to_array(i) for i in fused.graph.initializer if i.name == "rotary.cos_cache")
    cfg = load_model(str(folder)).config
    assert long_rope_start(cfg, positions=ORIGINAL) is None and long_rope_start(cfg, positions=ORIGINAL + 1) == ORIGINAL
    rows = np.arange(cos.shape[0], dtype=np.float32)[:, None] * rounded_inv_freq(cfg, np.float32)[None, :]
    np.testing.assert_array_equal(cos, np.cos(rows).astype(np.float32) * np.float32(rope_attention_factor(cfg)))


@pytest.mark.parametrize("positions", [None, MAX_CONTEXT])
def test_contract_graph_holds_the_switch_when_positions_reach_it(tmp_path, monkeypatch, positions):
    """The contract graph selects per row with a Where on position_ids < original (no row-wide switch)."""
    from speccompile.export.contract_graph import build_contract_graph
    from speccompile.export.recipes import DecoderWeights
    from speccompile.export.weight_store import WeightStore
    from speccompile.models.load import load_model

    from speccompile.weights_file import WeightsWriter

    _, folder = _model(tmp_path, monkeypatch)
    model = load_model(str(folder))
    with WeightsWriter(tmp_path / "w.data") as writer:
        graph = build_contract_graph(DecoderWeights(model.config, model.weights, max_context=positions),
                                     WeightStore(model.weights, writer), "fp32", layers=1)
    ops = [n.op_type for n in graph.graph.node if n.name.startswith("/rotary_emb")]
    assert "Less" in ops and "Where" in ops


def test_phi3_config_json_top_level_original_length(tmp_path, monkeypatch):
    """Phi-3.5's config.json keeps original_max_position_embeddings outside rope_scaling; as in transformers, it
    sets the boundary and the attention factor (not max_position_embeddings)."""
    import json

    from speccompile.models.config import config_from_hf
    from speccompile.models.rope import long_rope_start, rope_attention_factor

    _, folder = _model(tmp_path, monkeypatch)
    data = json.loads((folder / "config.json").read_text())
    scaling = dict(data.pop("rope_parameters"))
    scaling.pop("original_max_position_embeddings")
    data["rope_scaling"], data["original_max_position_embeddings"] = scaling, ORIGINAL
    cfg = config_from_hf(data, "config.json")
    assert long_rope_start(cfg) == ORIGINAL
    assert rope_attention_factor(cfg) == pytest.approx((1 + np.log(512 / ORIGINAL) / np.log(ORIGINAL)) ** 0.5)


def test_torch_rotary_table_per_row_and_bounded(tmp_path, monkeypatch):
    """The torch reference's table (also what traced drafters export): rows below the boundary from the short set,
    rows at and past it from the long set; bounded to positions inside the original length, the short set alone."""
    import torch

    from speccompile.models.decoder import RotaryEmbedding, bound_positions
    from speccompile.models.load import load_model

    _, folder = _model(tmp_path, monkeypatch)
    cfg = load_model(str(folder)).config
    short_cfg = type(cfg).from_dict({**cfg.to_dict(), "rope_scaling": {**cfg.rope_scaling, "long_factor": cfg.rope_scaling["short_factor"]}})
    long_cfg = type(cfg).from_dict({**cfg.to_dict(), "rope_scaling": {**cfg.rope_scaling, "short_factor": cfg.rope_scaling["long_factor"]}})
    pos = torch.arange(2 * ORIGINAL)[None]
    table, short, long = (RotaryEmbedding(c)(pos, torch.float32)[0] for c in (cfg, short_cfg, long_cfg))
    assert torch.equal(table[..., :ORIGINAL, :], short[..., :ORIGINAL, :])
    assert torch.equal(table[..., ORIGINAL:, :], long[..., ORIGINAL:, :])
    assert not torch.equal(short[..., ORIGINAL:, :], long[..., ORIGINAL:, :])
    rotary = torch.nn.Sequential(RotaryEmbedding(cfg))
    bound_positions(rotary, ORIGINAL + 1)
    assert rotary[0].long_start == ORIGINAL
    bound_positions(rotary, ORIGINAL)
    assert rotary[0].long_start is None and torch.equal(rotary[0](pos, torch.float32)[0], short)


def test_eagle_head_on_a_longrope_target(tmp_path, monkeypatch):
    """A traced EAGLE head shares the target's rope: its graph selects per row when the context passes the
    boundary (none inside it), and greedy EAGLE decoding across the boundary equals plain decoding. (Full rotary:
    the heads' attention rotates whole heads.)"""
    import test_heads_helpers as helpers

    full = dict(LONG, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_parameters=dict(LONG["rope_parameters"], partial_rotary_factor=1.0))
    monkeypatch.setitem(FAMILIES, "phi3-long-full", dict(full, model_type="phi3"))
    make_family_model(tmp_path / "hf", "phi3-long-full")
    monkeypatch.setattr(helpers, "VOCAB", TINY_VOCAB)
    ckpt = helpers.write_checkpoint(tmp_path / "eagle", "eagle")
    for max_context, switch in ((ORIGINAL, False), (MAX_CONTEXT, True)):
        out = tmp_path / f"art{max_context}"
        export_artifact(str(tmp_path / "hf"), out, ExportOptions(drafter=f"eagle:{ckpt}", max_context=max_context))
        ops = {n.op_type for n in onnx.load(str(out / "eagle.onnx"), load_external_data=False).graph.node}
        assert ("Less" in ops) == switch  # (the position test of the per-row select)
    runner = Runner(out, drafter="eagle", num_draft_tokens=4, adaptive=False, threads=1)
    plain = runner.generate("abc abd ab", chat=False, max_tokens=30, drafter="none")
    assert len(plain.tokens) == 30 and runner.generate("abc abd ab", chat=False, max_tokens=30).tokens == plain.tokens


def test_eagle_head_on_a_partial_rotary_target(tmp_path, monkeypatch):
    """A head on a target that rotates part of each head (Phi-3 / Phi-4-mini's partial_rotary_factor) rotates the same
    dims as its rotary table (it used to rotate whole heads and failed to export); greedy EAGLE == plain."""
    import test_heads_helpers as helpers

    make_family_model(tmp_path / "hf", "phi3")  # partial rotary 0.5, head_dim 32
    monkeypatch.setattr(helpers, "VOCAB", TINY_VOCAB)
    ckpt = helpers.write_checkpoint(tmp_path / "eagle", "eagle")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(drafter=f"eagle:{ckpt}", max_context=96))
    runner = Runner(tmp_path / "art", drafter="eagle", num_draft_tokens=4, adaptive=False, threads=1)
    plain = runner.generate("abc abd ab", chat=False, max_tokens=30, drafter="none")
    assert runner.generate("abc abd ab", chat=False, max_tokens=30).tokens == plain.tokens
