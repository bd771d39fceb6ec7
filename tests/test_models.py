"""The torch decoder is the numerical reference: it must match transformers on every supported family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speccompile.errors import InputError, UnsupportedError
from speccompile.models.config import config_from_gguf, config_from_hf
from speccompile.models.rope import rope_attention_factor
from speccompile.models.decoder import build_decoder, causal_mask, eagle3_tap_layers
from speccompile.models.load import gguf_to_hf_name, load_model

from conftest import make_tiny_hf_model, write_gguf

CASES = {
    "llama": {},
    "llama-rope3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "llama-tied": {"tie_word_embeddings": True},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
}


def _hf_and_ours(tmp_path, case):
    import transformers

    arch = case.split("-")[0]
    folder = make_tiny_hf_model(tmp_path / case, arch=arch, layers=3, **CASES[case])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    loaded = load_model(str(folder))
    return ref, build_decoder(loaded.config, loaded.weights)


@pytest.mark.parametrize("case", list(CASES))
def test_decoder_matches_transformers_prefill_and_decode(tmp_path, case):
    ref, ours = _hf_and_ours(tmp_path, case)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits
        pos = torch.arange(12)[None]
        full = ours(ids, pos, causal_mask(12, 0), *ours.empty_past())
        assert torch.allclose(full[0], expected, atol=1e-4), (full[0] - expected).abs().max()
        # prefill 7 tokens, then decode the rest one by one with the KV cache
        out = ours(ids[:, :7], pos[:, :7], causal_mask(7, 0), *ours.empty_past())
        past = out[1:]
        for t in range(7, 12):
            step = ours(ids[:, t:t + 1], pos[:, t:t + 1], causal_mask(1, t), *past)
            past = step[1:]
            assert torch.allclose(step[0][0, -1], expected[0, t], atol=1e-4)


def test_hidden_state_taps(tmp_path):
    folder = make_tiny_hf_model(tmp_path / "m", layers=8)
    loaded = load_model(str(folder))
    final = build_decoder(loaded.config, loaded.weights, "final")
    eagle3 = build_decoder(loaded.config, loaded.weights, "eagle3")
    ids = torch.randint(0, 96, (1, 5))
    pos = torch.arange(5)[None]
    with torch.no_grad():
        hidden = final(ids, pos, causal_mask(5, 0), *final.empty_past())[-1]
        aux = eagle3(ids, pos, causal_mask(5, 0), *eagle3.empty_past())[-1]
        # the final hidden state is what lm_head sees
        assert torch.allclose(final.lm_head(hidden), final(ids, pos, causal_mask(5, 0), *final.empty_past())[0], atol=1e-5)
        # taps are the inputs of layers (2, L//2, L-3): recompute by hand
        x = final.model.embed_tokens(ids)
        cos, sin = final.model.rotary_emb(pos, x.dtype)
        from speccompile.models.masks import mask_to_bias

        bias = mask_to_bias(causal_mask(5, 0)).unsqueeze(1).repeat(1, 1, 2, 1)  # tiled over the 2 query groups
        taps = []
        for i, layer in enumerate(final.model.layers):
            if i in eagle3_tap_layers(8):
                taps.append(x)
            x = layer(x, {"global": (cos, sin)}, {False: bias}, *final.empty_past()[2 * i: 2 * i + 2])[0]
    assert eagle3_tap_layers(8) == (2, 4, 5)
    assert aux.shape == (1, 5, 3 * 64)
    assert torch.allclose(aux, torch.cat(taps, -1), atol=1e-6)


def test_gguf_loads_f32_and_unpermutes_qk(tmp_path):
    folder = make_tiny_hf_model(tmp_path / "m")
    path = tmp_path / "tiny.gguf"
    hf = write_gguf(path, folder)
    gg = load_model(str(path))
    assert gg.config.num_hidden_layers == hf.config.num_hidden_layers
    assert gg.config.tie_word_embeddings is False
    for name, tensor in hf.weights.items():
        assert np.array_equal(gg.weights[name], np.asarray(tensor, np.float32)), name


def test_gguf_tensor_the_loader_does_not_read_is_refused(tmp_path):
    """A tensor with no name in the family's table is refused in one line, never dropped (a weight left out changes
    the model without a word: Llama 3.x's rope_freqs was once)."""
    folder = make_tiny_hf_model(tmp_path / "m")
    path = tmp_path / "extra.gguf"
    write_gguf(path, folder, metadata=lambda w: w.add_tensor("blk.0.mystery.weight", np.zeros(4, np.float32)))
    with pytest.raises(UnsupportedError, match=r"extra\.gguf: tensor blk\.0\.mystery\.weight \(1 unread in all\)"):
        load_model(str(path))


def test_gguf_q8_0_dequantizes_close(tmp_path):
    folder = make_tiny_hf_model(tmp_path / "m")
    path = tmp_path / "tiny_q8.gguf"
    hf = write_gguf(path, folder, quant="Q8_0")
    gg = load_model(str(path))
    for name, tensor in hf.weights.items():
        ref = np.asarray(tensor, np.float32)
        err = float(np.abs(gg.weights[name] - ref).max())
        assert err <= 0.02 * float(np.abs(ref).max()) + 1e-6, (name, err)


def test_gguf_nextn_names():
    """llama.cpp's MTP (nextn) tensors under the names the MTP loader reads; the block's layer under its own."""
    names = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "embed_tokens": "embed_tokens",
             "shared_head_head": "shared_head.head", "shared_head_norm": "shared_head.norm"}
    for gguf, hf in names.items():
        assert gguf_to_hf_name(f"blk.46.nextn.{gguf}.weight") == f"model.layers.46.{hf}.weight"
    assert gguf_to_hf_name("blk.46.attn_q.weight") == "model.layers.46.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.46.nextn.pre_projection.weight") is None


def test_config_errors():
    with pytest.raises(UnsupportedError, match="unsupported architecture 'bert'.*gemma3.*llama, llama4, mamba, mamba2, mellum, minicpm3, minicpm5_moe, minimax, minimax_m2, ministral3, mistral"):
        config_from_hf({"model_type": "bert"}, "cfg")
    with pytest.raises(UnsupportedError, match="DeepSeek-V2 topk_method 'noaux'"):
        config_from_hf({"model_type": "deepseek_v2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                        "num_hidden_layers": 1, "num_attention_heads": 1, "moe_intermediate_size": 4, "n_routed_experts": 2,
                        "topk_method": "noaux"}, "cfg")
    grouped = {"general.architecture": "deepseek2", "deepseek2.expert_group_count": 4, "deepseek2.expert_group_used_count": 2}
    with pytest.raises(UnsupportedError, match="deepseek2.expert_group_used_count 2 of 4 groups with softmax"):
        config_from_gguf(grouped, True, False, "m.gguf")  # llama.cpp's group score is not DeepSeek-V2's
    with pytest.raises(UnsupportedError, match="deepseek2.expert_gating_func 4 is not supported"):
        config_from_gguf({**grouped, "deepseek2.expert_gating_func": 4}, True, False, "m.gguf")
    with pytest.raises(UnsupportedError, match="lara_mini.*linear attention"):
        config_from_hf({"model_type": "lara_mini"}, "cfg")
    with pytest.raises(InputError, match="missing required key"):
        config_from_hf({"model_type": "llama"}, "cfg")
    with pytest.raises(UnsupportedError, match="rope_scaling type 'dynamic'"):
        config_from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                        "num_hidden_layers": 1, "num_attention_heads": 1, "rope_scaling": {"rope_type": "dynamic", "factor": 2}}, "cfg")


def test_hunyuan_config_keys():
    """Hunyuan: "dynamic" rope with an alpha is ntk_alpha (Llama's "dynamic" with an alpha stays refused, as does
    Hunyuan's without one: truly dynamic NTK); a per-layer moe_topk list is read when uniform, refused otherwise."""
    shape = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 1}
    alpha = {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}}
    cfg = config_from_hf({"model_type": "hunyuan_v1_dense", **shape, **alpha}, "cfg")
    assert cfg.rope_scaling == {"rope_type": "ntk_alpha", "alpha": 1000.0} and cfg.qk_norm and cfg.qk_norm_after_rope
    for data in ({"model_type": "llama", **shape, **alpha},
                 {"model_type": "hunyuan_v1_dense", **shape, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}):
        with pytest.raises(UnsupportedError, match="rope_scaling type 'dynamic'"):
            config_from_hf(data, "cfg")
    moe = {"model_type": "hunyuan_v1_moe", **shape, "num_experts": 4}
    assert config_from_hf({**moe, "moe_topk": [2, 2]}, "cfg").moe.top_k == 2
    with pytest.raises(UnsupportedError, match="moe_topk \\[2, 1\\] differs between layers"):
        config_from_hf({**moe, "moe_topk": [2, 1]}, "cfg")


def test_config_keys_of_a_family():
    """A family's own config.json keys (`Family.config_keys`): EXAONE 3's num_layers / layer_norm_epsilon, InternLM3's
    qkv_bias (q/k/v and o_proj biases) and bias (the gated MLP's: refused); Command R+'s per-head q/k norms refused;
    Phi-MoE's longrope mscale the cos/sin factor when short and long agree, else refused."""
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 1}
    cfg = config_from_hf({**base, "model_type": "exaone", "num_layers": 3, "layer_norm_epsilon": 1e-3}, "cfg")
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.rms_norm_eps) == ("exaone", 3, 1e-3)
    cfg = config_from_hf({**base, "model_type": "internlm3", "num_hidden_layers": 1, "qkv_bias": True}, "cfg")
    assert (cfg.attention_bias, cfg.o_proj_bias) == (True, True)
    with pytest.raises(UnsupportedError, match="internlm3 with mlp_bias"):
        config_from_hf({**base, "model_type": "internlm3", "num_hidden_layers": 1, "bias": True}, "cfg")
    with pytest.raises(UnsupportedError, match="cohere with use_qk_norm"):
        config_from_hf({**base, "model_type": "cohere", "num_hidden_layers": 1, "use_qk_norm": True}, "cfg")
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 64,
            "short_mscale": 1.25, "long_mscale": 1.25}  # Phi-3.5-MoE's: one cos/sin factor for every position
    moe = {**base, "model_type": "phimoe", "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2}
    assert rope_attention_factor(config_from_hf({**moe, "rope_scaling": rope}, "cfg")) == 1.25
    with pytest.raises(UnsupportedError, match="short_mscale 1.25 != long_mscale 1.5"):
        config_from_hf({**moe, "rope_scaling": {**rope, "long_mscale": 1.5}}, "cfg")


@pytest.mark.parametrize("key,value,says", [
    ("num_experts_per_tok", None, "missing required key 'num_experts_per_tok'"),  # DeepSeek-V2's default config
    ("num_hidden_layers", None, "config.json has a value this family cannot read"),
    ("num_attention_heads", "four", "config.json has a value this family cannot read"),
])
def test_null_or_mistyped_config_values_are_one_line_errors(key, value, says):
    """A config.json key that is null or of another type is an InputError naming the file, not a traceback
    (found by benchmarks/family_sweep.py: transformers' default DeepSeek-V2 config has num_experts_per_tok null)."""
    data = dict(model_type="deepseek_v2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=24, max_position_embeddings=512)
    data[key] = value
    with pytest.raises(InputError, match=says):
        config_from_hf(data, "folder")
