"""llama.cpp's tensor names (`Family.gguf`) of the hybrid recurrent families: Qwen3.5 / Qwen3-Next's gated delta nets,
LFM2's short convs, Granite 4.0-H's and Nemotron-H's Mamba-2 layers (models/architectures.py reads them)."""

from __future__ import annotations

from .weight_names import LLAMA_GGUF

# llama.cpp's qwen35 / qwen35moe: the gated delta net as attn_qkv | attn_gate, ssm_beta / ssm_alpha, ssm_* (A and dt's bias
# without `.weight`; value heads tiled: models/gated_delta_gguf.py); post_attention_norm the norm before the MLP
QWEN35_GGUF = {**LLAMA_GGUF, "post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
               "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
               "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias", "ssm_conv1d": "linear_attn.conv1d",
               "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
# llama.cpp's qwen3next: Qwen3-Next's in_proj_qkvz split as Qwen3.5's (attn_qkv, attn_gate), in_proj_ba kept (ssm_ba)
QWEN3NEXT_GGUF = {**QWEN35_GGUF, "ssm_ba": "linear_attn.in_proj_ba"}
# LFM2's llama.cpp names (lfm2 / lfm2moe): its final norm (embedding_norm) is token_embd_norm, the short conv `shortconv.*`
LFM2_GGUF = {**LLAMA_GGUF, "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
             "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1",
             "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2", "shortconv.conv": "conv.conv",
             "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"}
# llama.cpp's granitehybrid: Mamba-2 as `ssm_*` (A, D and dt's bias without `.weight`: models/mamba2_gguf.py), a dense
# model's MLP (Granite 4.0-H's shared MLP alone) as ffn_gate / ffn_up / ffn_down
MAMBA2_GGUF = {**LLAMA_GGUF, "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_dt": "mamba.dt_bias", "ssm_a": "mamba.A_log",
               "ssm_d": "mamba.D", "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj",
               **{f"ffn_{x}": f"block_sparse_moe.shared_expert.{x}_proj" for x in ("gate", "up", "down")}}
NEMOTRON_H_GGUF = {"attn_norm": "norm", **{f"attn_{x}": f"mixer.{x}_proj" for x in "qkv"}, "attn_output": "mixer.o_proj",
                   **{k: v.replace("mamba.", "mixer.") for k, v in MAMBA2_GGUF.items() if k.startswith("ssm_")},
                   "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # one block a `blk.N` (models/nemotron_h_gguf.py)
# llama.cpp's kimi-linear: Kimi Delta Attention as attn_q / attn_k / attn_v / attn_output and `ssm_*` (A and dt's bias without
# `.weight`, the conv kernels 4-D: models/kda_gguf.py); its latent attention as DeepSeek's (models/architectures.py)
KIMI_GGUF = {**{f"attn_{x}": f"self_attn.{x}_proj" for x in "kv"}, **{f"ssm_conv1d_{x}": f"self_attn.{x}_conv1d" for x in "qkv"},
             **{f"ssm_{x}": f"self_attn.{x}_proj" for x in ("f_a", "f_b", "g_a", "g_b")}, "ssm_beta": "self_attn.b_proj",
             "ssm_a": "self_attn.A_log", "ssm_dt": "self_attn.dt_bias", "ssm_norm": "self_attn.o_norm"}
