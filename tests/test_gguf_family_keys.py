"""llama.cpp's metadata of the families whose GGUF carries less than their config.json (no converter needed; the
converted files themselves: tests/test_gguf_llamacpp.py): MiniCPM3's fixed multipliers and default lengths, BitNet's
SiLU, a BitNet file's per-tensor `.scale` refused rather than dropped, Qwen3-Next's layers without `recurrent_layers`,
Kimi Linear's KDA heads and renormalised routing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from speccompile.errors import UnsupportedError
from speccompile.models.config import config_from_gguf
from speccompile.models.load import load_model

from conftest import write_gguf
from test_families import make_family_model


def _meta(arch: str, **keys) -> dict:
    base = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 128, f"{arch}.context_length": 512,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": 256}
    return {**base, **{f"{arch}.{k}": v for k, v in keys.items()}}


def test_minicpm3_gguf_takes_llamacpp_fixed_multipliers_and_default_lengths():
    """The converter writes no scale, value length or longrope original length: llama.cpp's minicpm3 fixes scale_emb
    12, scale_depth 1.4, dim_model_base 256 and uses hidden / heads and context_length; the config says the same."""
    meta = _meta("minicpm3", **{"attention.head_count_kv": 4, "attention.kv_lora_rank": 32, "attention.q_lora_rank": 48,
                                "attention.key_length": 40, "rope.dimension_count": 16})
    factors = {"long_factor": [2.0] * 8, "short_factor": [1.5] * 8}
    cfg = config_from_gguf(meta, True, False, "model.gguf", rope_factors=factors)
    assert cfg.architecture == "minicpm3" and (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.rope_dim) == (32, 48, 16)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim) == (24, 16)
    assert cfg.embed_scale == 12.0 and math.isclose(cfg.residual_scale, 1.4 / math.sqrt(2)) and cfg.logit_scale == 256 / 64
    assert cfg.rope_scaling["original_max_position_embeddings"] == 512 and cfg.rope_scaling["short_factor"] == [1.5] * 8


def test_bitnet_gguf_is_silu_float_with_sub_norms():
    """llama.cpp's bitnet graph is a gated SiLU MLP (the file names no activation) on float products: not the relu2
    default of transformers' BitNet, no 8-bit activations; its sub-norms read."""
    cfg = config_from_gguf(_meta("bitnet", **{"attention.head_count_kv": 2}), False, False, "model.gguf")
    assert (cfg.architecture, cfg.mlp_act, cfg.sub_norms, cfg.act_quant, cfg.tie_word_embeddings) == ("bitnet", "silu", True, False, True)


def test_bitnet_gguf_with_a_tensor_scale_is_refused(tmp_path):
    """A per-tensor scale beside a projection (`blk.N.attn_q.scale`, which llama.cpp multiplies in) is not read:
    the file is refused in one line naming it instead of loading without it."""
    make_family_model(tmp_path / "hf", "bitnet")
    write_gguf(tmp_path / "model.gguf", tmp_path / "hf", arch="bitnet",
               metadata=lambda writer: writer.add_tensor("blk.0.attn_q.scale", np.ones(1, np.float32)))
    with pytest.raises(UnsupportedError, match=r"tensor blk\.0\.attn_q\.scale .*not read for bitnet") as info:
        load_model(str(tmp_path / "model.gguf"))
    assert "\n" not in str(info.value)


def test_qwen3next_gguf_without_recurrent_layers_takes_the_full_attention_interval():
    """A qwen3next file whose converter saw no layer_types (it writes `recurrent_layers` only from them): every
    `full_attention_interval`-th layer full, as llama.cpp and transformers; the top k renormalised as llama.cpp's graph."""
    meta = _meta("qwen3next", **{"block_count": 6, "attention.head_count_kv": 2, "attention.key_length": 32, "full_attention_interval": 3,
                                 "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
                                 "ssm.inner_size": 32, "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
                                 "expert_shared_feed_forward_length": 48})
    cfg = config_from_gguf(meta, True, False, "model.gguf")
    assert cfg.architecture == "qwen3_next" and cfg.hybrid.linear == [True, True, False, True, True, False]
    assert (cfg.hybrid.num_k_heads, cfg.hybrid.num_v_heads, cfg.hybrid.k_dim, cfg.hybrid.v_dim) == (2, 4, 16, 8)
    assert cfg.moe.norm_topk_prob and cfg.norm_offset == 0.0


def test_kimi_linear_gguf_takes_kda_heads_from_head_count_and_always_renormalises():
    """llama.cpp's kimi-linear: KDA where head_count_kv is 0, its heads `attention.head_count` (no KDA head count is
    written), NoPE latent attention; its graph renormalises the top k whatever `expert_weights_norm` says, and routes
    by sigmoid: another `expert_gating_func` is refused in one line."""
    keys = {"block_count": 4, "attention.head_count_kv": [0, 0, 0, 1], "kda.head_dim": 16, "ssm.conv_kernel": 3,
            "attention.kv_lora_rank": 32, "rope.dimension_count": 16, "attention.key_length": 48, "attention.key_length_mla": 32,
            "attention.value_length_mla": 16, "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
            "expert_shared_count": 1, "leading_dense_block_count": 1, "expert_weights_scale": 2.5, "expert_weights_norm": False}
    cfg = config_from_gguf(_meta("kimi-linear", **keys, expert_gating_func=2), True, False, "model.gguf")
    hy, moe = cfg.hybrid, cfg.moe
    assert cfg.architecture == "kimi_linear" and hy.kind == "kda" and hy.linear == [True, True, True, False]
    assert (hy.num_v_heads, hy.k_dim, hy.conv_kernel, cfg.nope_layers) == (4, 16, 3, [0, 1, 2, 3])
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank) == (32, 16, 16, 0)
    assert moe.norm_topk_prob and moe.score_bias and moe.dense_layers == (0,) and moe.shared_expert_size == 32
    with pytest.raises(UnsupportedError, match="expert_gating_func 1 is not supported in a Kimi Linear model"):
        config_from_gguf(_meta("kimi-linear", **keys, expert_gating_func=1), True, False, "model.gguf")
