"""The roles of a decoder layer's weights and Llama's names for them (Hugging Face and GGUF): the vocabulary every
family of the architecture table (models/architectures.py) names its tensors in.

Roles of a layer's weights (HF names relative to `model.layers.{i}.`; a role with one name and several parts
is a fused tensor, stacked the same way the graphs stack separate parts: q/k/v rows, gate/up rows):
  input_norm      the norm before attention (pre / sandwich / parallel)
  qkv, qkv_bias   q, k, v projections (3 names) or one fused qkv_proj
  q_norm, k_norm  q / k norms (per head, or over all heads: `qk_norm_full`; per head after rope: `qk_norm_after_rope`)
  o_proj          attention output
  post_attn_norm  norm of the attention output before the residual add (sandwich / post)
  post_norm       the norm before the MLP (pre / sandwich)
  gate_up, down   the gated MLP (2 names or one fused gate_up_proj), gate_up_bias (its biases: RecurrentGemma)
  up, down        the plain MLP (`mlp_gated` False: down(act(up x)); Phi-2's fc1 / fc2), up_bias / down_bias
  post_mlp_norm   norm of the MLP output before the residual add (sandwich / post)
  attn_sub_norm, ffn_sub_norm  norms of o_proj's and down_proj's inputs (`sub_norms`: BitNet)
  layer_scalar    the layer output's learned multiplier [1] (Gemma 4)
  ple_gate, ple_proj, ple_norm  the per-layer embeddings' block (Gemma 4's PLE): gate [P, hidden], projection
                  [hidden, P], the norm of its output before the residual add
  (KV sharing: a shared layer's qkv role is q_proj alone, and it has no k_norm)
  act             xIELU's learned scalars alpha_p, alpha_n, beta, eps (Apertus; each shown as [1]), stacked [4]
  <norm>_bias     a norm's bias (`norm_bias`, q/k norms included; named as the norm's weight with `.bias`)
Multi-head latent attention (DeepSeek-V2/V3, `mla`) has its own attention roles instead of qkv (docs/DESIGN.md,
"Multi-head latent attention"):
  q_kv_a          q_a_proj and kv_a_proj_with_mqa stacked (one MatMul); `q_kv` when the model has no q_lora_rank:
                  q_proj and kv_a_proj_with_mqa
  q_a_norm, q_b   q_a_layernorm, q_b_proj (with q_lora_rank only); kv_a_norm: kv_a_layernorm (the latent's norm)
  kv_b            kv_b_proj [heads * (nope + v), kv_lora_rank]: absorbed into the query and the output per head
"""

from __future__ import annotations

LLAMA_NAMES: dict[str, tuple[str, ...]] = {
    "input_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "o_proj": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "gate_up_bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "down": ("mlp.down_proj.weight",),
    "o_bias": ("self_attn.o_proj.bias",),
    "sinks": ("self_attn.sinks",),
    "up": ("mlp.up_proj.weight",),
    "up_bias": ("mlp.up_proj.bias",),
    "down_bias": ("mlp.down_proj.bias",),
    "act": ("mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n", "mlp.act_fn.beta", "mlp.act_fn.eps"),  # xIELU's scalars
    "layer_scalar": ("layer_scalar",),
    "ple_gate": ("per_layer_input_gate.weight",), "ple_proj": ("per_layer_projection.weight",),
    "ple_norm": ("post_per_layer_input_norm.weight",),
    "attn_sub_norm": ("self_attn.attn_sub_norm.weight",), "ffn_sub_norm": ("mlp.ffn_sub_norm.weight",),  # BitNet
}
# Gemma 3n's AltUp (the streams' predict / correct coefficients, the router and its norm, the scale of the active stream's
# correction) and LAuReL (the low-rank residual: left [rank, hidden], right [hidden, rank], its output's norm) per layer
ALTUP_NAMES: dict[str, tuple[str, ...]] = {
    "altup_scale": ("altup.correct_output_scale",), "altup_correct": ("altup.correction_coefs.weight",),
    "altup_predict": ("altup.prediction_coefs.weight",), "altup_router": ("altup.modality_router.weight",),
    "altup_router_norm": ("altup.router_norm.weight",), "laurel_left": ("laurel.linear_left.weight",),
    "laurel_right": ("laurel.linear_right.weight",), "laurel_norm": ("laurel.post_laurel_norm.weight",)}
MLP_ROLES = ("post_norm", "post_norm_bias", "gate_up", "up", "down", "gate_up_bias", "up_bias", "down_bias", "act")  # a dense MLP block's
NORM_ROLES = ("input_norm", "post_attn_norm", "post_norm", "post_mlp_norm")
BESIDE_ROLES = ("dense_out_norm", "moe_in_norm", "moe_out_norm")  # a MoE layer's norms beside its dense MLP (Gemma 4)
PHI2_GGUF = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",  # Phi-2's GGUF names
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
LLAMA_GGUF: dict[str, str] = {  # GGUF block tensor -> role part (HF name relative to the layer)
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
