"""Mixture-of-experts GGUF files (llama.cpp's layout: each layer's experts as one 3-D tensor `ffn_{gate,up,down}_exps`,
the router `ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp`; Mixtral written
as a `llama` with `expert_count`; `gpt-oss` with biases, sinks and MXFP4 experts) read into the MoE description (models/moe_config.py): a tiny transformers checkpoint
written as such a GGUF loads to the same config and tensors, and its export matches transformers and decodes exactly."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

import test_families
from conftest import TINY_VOCAB, _permute_for_gguf, finish_gguf, new_gguf_writer
from test_families import _check_graph, make_family_model
from test_quantized_exact import PROMPTS, assert_greedy_speculative_equals_plain

# llama.cpp has no dense layers in these families (no mlp_only_layers) and no sliding window for a llama / Mixtral
CHECKPOINTS = {
    "qwen3_moe": ("qwen3moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2_moe": ("qwen2moe", dict(test_families.FAMILIES["qwen2_moe"])),  # a shared expert, top k not renormalised
    "mixtral": ("llama", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # llama.cpp stores no SwiGLU clamp for gpt-oss (it hard-codes 7): the checkpoint keeps that one
    "gpt_oss": ("gpt-oss", dict(test_families.FAMILIES["gpt_oss"], swiglu_limit=7.0)),
}


def write_moe_gguf(path, folder, arch: str, quant: str | None = None, per_expert: bool = False) -> None:
    """The checkpoint in `folder` as llama.cpp writes a MoE model of architecture `arch`: per-expert tensors stacked
    into [experts, out, in] (`quant`: the 3-D expert tensors in that gguf type, e.g. Q8_0 or MXFP4); `per_expert`: as early
    llama.cpp Mixtral files, one 2-D tensor per expert (`blk.N.ffn_gate.E.weight`)."""
    import gguf

    from speccompile.models.architectures import family
    from speccompile.models.load import _GGUF_NAMES, load_model

    loaded = load_model(str(folder))
    cfg, moe = loaded.config, loaded.config.moe
    fam = family(cfg.architecture)
    writer = new_gguf_writer(path, arch, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.rope_dim)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, folder)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if arch != "llama":
        writer.add_expert_feed_forward_length(moe.expert_size)
    if moe.shared_expert_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_size)
    if arch == "gpt-oss":  # what llama.cpp's converter writes: the window and yarn's factor and original context
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_scaling["original_max_position_embeddings"])
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)  # newer llama.cpp's optional period
    top = {v: k for k, v in _GGUF_NAMES.items()}
    block = {v: k for k, v in {**fam.gguf, **moe.gguf_names()}.items()}
    experts: dict[str, list] = {}
    for name in loaded.weights.names():
        stored = np.asarray(loaded.weights.read(name), dtype=np.float32)
        if name in top:
            writer.add_tensor(top[name], stored)
            continue
        parts = name.split(".")
        layer, rest = parts[2], ".".join(parts[3:-1])
        if name.endswith(".self_attn.sinks"):  # gpt-oss' [heads], a `.weight` in llama.cpp's name
            writer.add_tensor(f"blk.{layer}.attn_sinks.weight", stored)
            continue
        if ".experts." in rest:  # mlp.experts.{e}.gate_proj -> mlp.experts.*.gate_proj, stacked by expert
            experts.setdefault(f"blk.{layer}.{block[rest.replace(f'.experts.{parts[5]}.', '.experts.*.')]}.{parts[-1]}", []).append(stored)
            continue
        gname = f"blk.{layer}.{block[rest]}.{parts[-1]}"
        if fam.gguf_llama_order and gname.endswith(("attn_q.weight", "attn_k.weight")):
            stored = _permute_for_gguf(stored, cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            stored = stored.reshape(-1)  # llama.cpp's [hidden]
        writer.add_tensor(gname, stored)
    for gname, stack in experts.items():
        if per_expert:
            for e, matrix in enumerate(stack):
                writer.add_tensor(gname.replace("_exps.", f".{e}."), matrix)
            continue
        stacked = np.stack(stack)
        if quant:
            qtype = gguf.GGMLQuantizationType[quant]
            packed = gguf.quants.quantize(stacked, qtype)
            writer.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gname, stacked)
    finish_gguf(writer)


def _add_tokenizer(writer, folder) -> None:
    """The checkpoint's vocabulary as llama.cpp's `gpt2` tokenizer metadata (a BPE without merges: every token
    whole), which transformers converts for the Qwen families (real GGUFs carry their BPE vocabulary and merges)."""
    import json

    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _checkpoint(tmp_path, monkeypatch, name: str):
    arch, overrides = CHECKPOINTS[name]
    monkeypatch.setitem(test_families.FAMILIES, f"{name}-gguf", dict(model_type=name, **overrides))
    hf = make_family_model(tmp_path / "hf", f"{name}-gguf")
    return arch, hf


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_moe_gguf_matches_transformers_and_decodes_exactly(tmp_path, monkeypatch, name):
    """The GGUF loads to the safetensors checkpoint's MoE config and tensors (bitwise, F32); exported, its fused CPU
    graph's logits are within 1e-4 of transformers at every position of a prefill, a tree and a chain pass, and
    greedy n-gram speculative decoding equals plain."""
    from speccompile.models.load import load_model

    arch, hf = _checkpoint(tmp_path, monkeypatch, name)
    (tmp_path / "g").mkdir()
    write_moe_gguf(tmp_path / "g" / "model.gguf", tmp_path / "hf", arch)
    want, got = load_model(str(tmp_path / "hf")), load_model(str(tmp_path / "g" / "model.gguf"))
    assert got.config.architecture == name and got.config.moe == want.config.moe
    assert (got.config.layer_types, got.config.sliding_window) == (want.config.layer_types, want.config.sliding_window)
    assert got.config.rope_scaling == want.config.rope_scaling and got.config.attn_sinks == want.config.attn_sinks
    assert sorted(got.weights.names()) == sorted(want.weights.names())
    for tensor in want.weights.names():
        np.testing.assert_array_equal(got.weights.read(tensor), want.weights.read(tensor), err_msg=tensor)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "hf" / file, tmp_path / "g" / file)
    export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=128))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    _check_graph(open_artifact(tmp_path / "art", threads=1).target, hf, seq, 7, f"{name} gguf fused")
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    assert_greedy_speculative_equals_plain(runner, PROMPTS, 24)


def test_quantized_3d_experts_are_read_one_expert_at_a_time(tmp_path, monkeypatch):
    """Q8_0 experts: each expert's matrix is its slice of the whole tensor's dequantization (the reader maps only
    that expert's blocks), close to the checkpoint's weights."""
    import gguf

    from speccompile.models.load import load_model

    _checkpoint(tmp_path, monkeypatch, "qwen3_moe")
    write_moe_gguf(tmp_path / "model.gguf", tmp_path / "hf", "qwen3moe", quant="Q8_0")
    got, want = load_model(str(tmp_path / "model.gguf")), load_model(str(tmp_path / "hf"))
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    whole = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert whole.tensor_type == gguf.GGMLQuantizationType.Q8_0
    full = gguf.quants.dequantize(whole.data, whole.tensor_type).reshape(4, 64, 32)
    for e in range(4):
        name = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
        np.testing.assert_array_equal(got.weights.read(name), full[e])
        assert got.weights.shape(name) == (64, 32)
        np.testing.assert_allclose(full[e], want.weights.read(name), atol=0.02 * np.abs(full[e]).max())


def test_early_mixtral_gguf_with_a_tensor_per_expert_loads_the_same(tmp_path, monkeypatch):
    """Mixtral GGUFs written before llama.cpp stacked the experts (`blk.N.ffn_gate.E.weight`) load to the same
    config and tensors as the checkpoint."""
    from speccompile.models.load import load_model

    arch, _ = _checkpoint(tmp_path, monkeypatch, "mixtral")
    write_moe_gguf(tmp_path / "model.gguf", tmp_path / "hf", arch, per_expert=True)
    got, want = load_model(str(tmp_path / "model.gguf")), load_model(str(tmp_path / "hf"))
    assert got.config.moe == want.config.moe and sorted(got.weights.names()) == sorted(want.weights.names())
    for tensor in want.weights.names():
        np.testing.assert_array_equal(got.weights.read(tensor), want.weights.read(tensor), err_msg=tensor)


def test_q4_experts_build_int4_packed_and_verify_identical(tmp_path, monkeypatch):
    """Qwen2-MoE with Q4_0 3-D experts: exported and built `--int4`, every expert and shared-expert MatMul is a
    MatMulNBits (the routers stay float) and `verify` finds speculative decoding identical to plain."""
    import onnx

    from conftest import run_cli

    arch, _ = _checkpoint(tmp_path, monkeypatch, "qwen2_moe")
    (tmp_path / "g").mkdir()
    write_moe_gguf(tmp_path / "g" / "model.gguf", tmp_path / "hf", arch, quant="Q4_0")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "hf" / file, tmp_path / "g" / file)
    export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=128))
    result = run_cli("build", str(tmp_path / "art"), "--int4", "--onnx-only", "--calib-samples", "2", "--out", str(tmp_path / "int4"))
    assert result.returncode == 0, result.stderr
    graph = onnx.load(str(tmp_path / "int4" / "target.ort.onnx"), load_external_data=False).graph
    packed = {n.input[1] for n in graph.node if n.op_type == "MatMulNBits"}
    assert len(packed) == 2 * (2 + 4 * 2 + 2)  # per layer: qkv, o_proj, 4 experts x 2, the shared expert x 2
    result = run_cli("verify", str(tmp_path / "int4"), "--raw", "--max-tokens", "16", "--limit", "2")
    assert result.returncode == 0 and "identical" in result.stdout, result.stdout + result.stderr


def test_gpt_oss_mxfp4_experts_are_gguf_dequantized_per_expert_and_decode_exactly(tmp_path, monkeypatch):
    """gpt-oss with MXFP4 3-D experts (llama.cpp's type for the published models; their biases stay F32): each
    expert's matrix is its slice of gguf's own dequantization of the whole tensor, near the checkpoint's weights;
    exported, greedy n-gram speculative decoding equals plain."""
    import gguf

    from speccompile.models.load import load_model

    arch, _ = _checkpoint(tmp_path, monkeypatch, "gpt_oss")
    hf = tmp_path / "hf"
    (tmp_path / "g").mkdir()
    write_moe_gguf(tmp_path / "g" / "model.gguf", hf, arch, quant="MXFP4")
    got, want = load_model(str(tmp_path / "g" / "model.gguf")), load_model(str(hf))
    assert got.config.moe == want.config.moe and sorted(got.weights.names()) == sorted(want.weights.names())
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    for proj, gname, shape in (("gate_proj", "ffn_gate_exps", (128, 64)), ("down_proj", "ffn_down_exps", (64, 128))):
        whole = next(t for t in reader.tensors if t.name == f"blk.1.{gname}.weight")
        assert whole.tensor_type == gguf.GGMLQuantizationType.MXFP4
        full = gguf.quants.dequantize(whole.data, whole.tensor_type).reshape(4, *shape)
        for e in range(4):
            name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            np.testing.assert_array_equal(got.weights.read(name), full[e])
            assert got.weights.shape(name) == shape
            np.testing.assert_allclose(full[e], want.weights.read(name), atol=0.2 * np.abs(full[e]).max())
    bias = "model.layers.1.mlp.experts.2.up_proj.bias"
    np.testing.assert_array_equal(got.weights.read(bias), want.weights.read(bias))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / file, tmp_path / "g" / file)
    export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=128))
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    assert_greedy_speculative_equals_plain(runner, PROMPTS, 24)


def test_gguf_sliding_pattern_and_gpt_oss_one_rope_base():
    """llama.cpp's sliding period (layer i slides iff i % period < period - 1; the family's when absent: gpt-oss 2)
    or per-layer flags give the layer types; a family llama.cpp reads no pattern for, or a second rope base for
    gpt-oss' sliding layers, is refused in one line naming the key."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.architectures import family
    from speccompile.models.config import _gguf_layer_keys
    from speccompile.models.rope_keys import gpt_oss_gguf_keys as _gpt_oss_gguf_keys

    meta = {"gpt-oss.rope.freq_base": 150000.0, "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0,
            "gpt-oss.attention.sliding_window": 128}
    data = {"num_hidden_layers": 4, "head_dim": 16, "rope_theta": 150000.0}

    def types(extra: dict, arch: str = "gpt_oss") -> list[str]:
        return _gguf_layer_keys({**meta, **extra}, "gpt-oss.", family(arch), arch, dict(data), "m.gguf").get("layer_types", [])

    assert types({}) == ["sliding_attention", "full_attention"] * 2
    assert types({"gpt-oss.attention.sliding_window_pattern": 3}) == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    assert types({"gpt-oss.attention.sliding_window_pattern": [False, True, True, False]}) == [
        "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert types({"gpt-oss.attention.sliding_window": 0}) == []
    assert _gpt_oss_gguf_keys(meta, "gpt-oss.", "m.gguf")["rope_scaling"] == dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False)
    with pytest.raises(UnsupportedError, match="m.gguf: GGUF gpt-oss with gpt-oss.rope.freq_base_swa"):
        _gpt_oss_gguf_keys({**meta, "gpt-oss.rope.freq_base_swa": 10000.0}, "gpt-oss.", "m.gguf")
    with pytest.raises(UnsupportedError, match="m.gguf: a GGUF qwen2 with gpt-oss.attention.sliding_window"):
        types({}, "qwen2")
