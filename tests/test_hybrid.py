"""Hybrid linear attention (Qwen3-Next, Qwen3.5 text and MoE: gated delta nets beside gated full attention; OLMo Hybrid:
gated delta nets beside OLMo 3's post-norm attention; LFM2 and
LFM2-MoE: short convs beside attention; Granite 4.0-H, Bamba and Nemotron-H: Mamba-2 layers beside attention; Jamba:
Mamba-1; Kimi Linear and Bailing hybrid: Kimi Delta Attention beside latent attention; MiniMax-01: lightning attention beside softmax attention; targets with no attention layer at all: pure Mamba-2, pure Mamba-1, Falcon-Mamba and all-recurrent hybrids, a cache of states alone) against
transformers' fp32 eager forward on tiny random checkpoints: the torch reference, the contract and the fused CPU graph
at every position; row invariance and exact chain verification (the committed states are plain decoding's, bitwise);
INT4; what such a target does not run, refused in one line (docs/DESIGN.md, "Hybrid linear attention")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import TINY_VOCAB
from test_families import UNSET, _close, _decoded, _hf_logits, make_family_model

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_LINEAR = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
_MAMBA2 = dict(num_hidden_layers=4, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2)
_GRANITE_H = dict(_MAMBA2, layer_types=["mamba", "mamba", "mamba", "attention"], intermediate_size=32, shared_intermediate_size=48,
                  position_embedding_type="nope", embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5,
                  logits_scaling=2.0)
_FALCON_H1 = dict(_MAMBA2, mamba_d_ssm=128, embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.8,
                  key_multiplier=0.6, attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.7,
                  ssm_multipliers=[0.9, 1.1, 0.8, 1.3, 0.6], mlp_multipliers=[0.75, 1.25])
HYBRID = {  # layers 0-2 gated delta nets (value heads twice the key heads), layer 3 gated full attention (rotary on 16 of
    # its 32 dims: GroupQueryAttention's rotary needs a multiple of 16)
    "qwen3_next": dict(_LINEAR, **_MOE, decoder_sparse_step=2),  # MoE on layers 1 and 3 (a shared expert), dense 0 and 2
    "qwen3_5_text": dict(_LINEAR),
    "qwen3_5_moe_text": dict(_LINEAR, **_MOE),
    # OLMo Hybrid: layers 1 and 3 gated delta nets (separate q/k/v/g/a/b projections, beta in [0, 2], pre norms), 0 and 2
    # OLMo 3's post-norm attention with full q / k norms (no head_dim key: hidden / heads): each way between the two
    # placements, and the final norm after a delta net
    "olmo_hybrid": dict(num_hidden_layers=4, head_dim=UNSET, layer_types=["full_attention", "linear_attention"] * 2, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8),
    # LFM2: layers 0-2 short convs (kernel 3), layer 3 attention with per-head q / k norms; the MLP width adjusted
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "conv", "conv", "full_attention"]),
    # LFM2-MoE: the same layers, layer 0's MLP dense, layers 1-3 sigmoid-routed experts with a score bias
    "lfm2_moe": dict(num_hidden_layers=4, layer_types=["conv", "conv", "conv", "full_attention"], num_dense_layers=1,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # LFM3: layers 0 and 2 short convs (kernel 7), 1 sliding attention (window 8, default rope), 3 full attention (proportional rope on
    # half of each head), each head's output times a sigmoid gate, sandwich norms (lfm3_plain: no gate, pre norms only)
    "lfm3": dict(num_hidden_layers=4, layer_types=["conv", "sliding_attention", "conv", "full_attention"], sliding_window=8),
    "lfm3_plain": dict(model_type="lfm3", num_hidden_layers=4, layer_types=["conv", "conv", "conv", "full_attention"],
                       use_sandwich_norm=False, use_attention_gate=False),
    # Granite 4.0-H: layers 0-2 Mamba-2 (8 heads of 16 in 2 groups, d_state 16, conv kernel 4 with its bias), layer 3 NoPE
    # attention; Granite's multipliers; MoE with a shared MLP (granitemoehybrid_dense: the shared MLP alone)
    "granitemoehybrid": dict(_GRANITE_H, num_local_experts=4, num_experts_per_tok=2),
    "granitemoehybrid_dense": dict(_GRANITE_H, model_type="granitemoehybrid", num_local_experts=0),
    # Bamba: the same Mamba-2 layers, attention at attn_layer_indices (rope on 16 of its 32 dims), a SwiGLU
    "bamba": dict(_MAMBA2, attn_layer_indices=[3], head_dim=32),
    # Jamba: layers 0-2 Mamba-1 (inner 128, d_state 16, dt rank 4, conv kernel 4 with its bias; dt / B / C RMS-normed), layer 3
    # NoPE attention; layers 1 and 3 softmax top 2 of 4 experts (not renormalised), 0 and 2 a SwiGLU
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, intermediate_size=32, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2),
    # jamba_dense: one expert (every MLP a SwiGLU), no conv bias, dt rank 8
    "jamba_dense": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3, num_experts=1, mamba_conv_bias=False,
                        mamba_dt_rank=8, model_type="jamba"),
    # Nemotron-H: blocks M - M M - * (Mamba-2 as Granite's above, NoPE attention, relu2 MLPs), table layers (M -) (M) (M -)
    # (*): a Mamba-2 and the attention layer without an MLP
    "nemotron_h": dict(layers_block_type=["linear_attention", "mlp", "linear_attention", "linear_attention", "mlp", "full_attention"],
                       mamba_num_heads=8, n_groups=2, ssm_state_size=16, mamba_head_dim=16, conv_kernel=4),
    # Nemotron 3 Nano: blocks M E M - M * E, table layers (M E) (M -) (M) (* E): ungated relu2 experts (8, top 2, sigmoid
    # routing with a score bias, scaled 2.5) and an ungated relu2 shared expert on layers 0 and 3, a dense MLP, an MLP-less layer
    # Falcon-H1: every layer attention (rope) beside a Mamba-2 mixer (as Granite's; its output y * SiLU(z), unnormed), a
    # SwiGLU; muP multipliers, none of them 1 (falcon_h1_norm: the mixer's group norm before the gate, mamba_rms_norm)
    "falcon_h1": dict(_FALCON_H1),
    "falcon_h1_norm": dict(_FALCON_H1, model_type="falcon_h1", mamba_rms_norm=True, mamba_norm_before_gate=True),
    "nemotron_h_moe": dict(model_type="nemotron_h", hybrid_override_pattern="MEM-M*E", mamba_num_heads=8, n_groups=2, ssm_state_size=16,
                           mamba_head_dim=16, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=64, routed_scaling_factor=2.5),
    # no attention layer at all (a cache of states alone, no KV rows): pure Mamba-2 (Mamba2ForCausalLM: 4 blocks, 8 heads of
    # 16 in 2 groups, d_state 16, no MLP) and a Qwen3.5 whose every layer is a gated delta net. Their pad token's zero
    # embedding would give zero logits after it (no attention to carry the context): no pad token. transformers' own cache
    # of linear layers alone has no mask sizes (use_cache false)
    "mamba2": dict(num_hidden_layers=4, num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4, expand=2,
                   pad_token_id=None, use_cache=False),
    "qwen3_5_text_linear": dict(_LINEAR, model_type="qwen3_5_text", layer_types=["linear_attention"] * 4, pad_token_id=None,
                                use_cache=False),
    # and a Jamba whose attention period (8) passes its 4 layers: every layer Mamba-1, one expert
    "jamba_linear": dict(num_hidden_layers=4, attn_layer_period=8, attn_layer_offset=4, num_experts=1, mamba_dt_rank=8, model_type="jamba",
                         pad_token_id=None, use_cache=False),
    # pure Mamba-1 (MambaForCausalLM: 4 blocks of norm -> mixer, inner 128, d_state 16, dt rank 4, no MLP) and Falcon-Mamba
    # (its dt / B / C RMS-normed without gains, mixer_rms_eps apart from the blocks' layer_norm_epsilon; dt rank 8). Mamba's
    # unnormed dt at transformers' initializer_range 0.1 (times the 4 of make_family_model) is ill-conditioned in fp32
    # (transformers' own fp32 logits 8e-5 from its fp64 ones): 0.05
    "mamba": dict(num_hidden_layers=4, state_size=16, conv_kernel=4, expand=2, initializer_range=0.05, pad_token_id=None, use_cache=False),
    "falcon_mamba": dict(num_hidden_layers=4, state_size=16, conv_kernel=4, expand=2, time_step_rank=8, mixer_rms_eps=1e-3,
                         pad_token_id=None, use_cache=False),
    # Kimi Linear: layers 0-2 Kimi Delta Attention (4 heads of 16, a decay per key channel), layer 3 DeepSeek-V3's latent
    # attention without rope (its cache head 16 + 32); layer 0 a dense SwiGLU, 1-3 sigmoid-routed experts with a shared one
    "kimi_linear": dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], num_key_value_heads=4,
                        linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4), kv_lora_rank=32, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
                        num_shared_experts=1, first_k_dense_replace=1),
    # and every layer Kimi Delta Attention (no latent attention layer)
    "kimi_linear_linear": dict(model_type="kimi_linear", num_hidden_layers=4, layer_types=["linear_attention"] * 4, num_key_value_heads=4,
                               linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4), kv_lora_rank=32,
                               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, num_experts=4,
                               num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1,
                               pad_token_id=None, use_cache=False),
    # and a group wider than the model: every layer KDA
    "bailing_hybrid_linear": dict(model_type="bailing_hybrid", num_hidden_layers=4, layer_group_size=8, num_key_value_heads=4, head_dim=16,
                                  kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                  topk_group=1, num_mtp_layers=0, pad_token_id=None, use_cache=False),
    # RecurrentGemma (Griffin): layers 0-2 RG-LRU blocks (lru_width 64 in 2 gate blocks, conv1d_width 4 with its bias; the
    # reset at position 0), layer 3 local attention over 8 keys (one KV head, rope on 16 of its 32 dims); Gemma's (1 + w)
    # norms, a gated tanh-GELU MLP with biases, o_proj's bias, sqrt(hidden) embedding scale, final logit soft-capping
    "recurrent_gemma": dict(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32, block_types=["recurrent"] * 3 + ["attention"],
                            attention_window_size=8, logits_soft_cap=8.0),
    # and every block recurrent (Griffin's Hawk)
    "recurrent_gemma_linear": dict(model_type="recurrent_gemma", num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   block_types=["recurrent"], logits_soft_cap=8.0, pad_token_id=None, use_cache=False),
    # Bailing hybrid: groups of 2 layers (0, 2 KDA with full-rank gates and the bounded decay; 1, 3 latent attention with
    # rope, q LoRA and a per-head output gate); layer 0 a dense SwiGLU, 1-3 sigmoid-routed experts in 2 groups, a shared one;
    # SwiGLU clamped after SiLU per layer: the experts' on layers 1 and 3, the shared experts' on layer 2 (layer 0's unused)
    "bailing_hybrid": dict(num_hidden_layers=4, layer_group_size=2, num_key_value_heads=4, head_dim=16, kv_lora_rank=32, qk_rope_head_dim=16,
                           qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           num_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, num_mtp_layers=0,
                           expert_swiglu_limit_list=[0, 0.5, 0, 0.7], share_expert_swiglu_limit_list=[0.6, 0, 0.4, 0]),
    # MiniMax-01: layers 0, 2, 3 lightning attention (4 heads of 16, decays by layer index; transformers' prefill in blocks of
    # 4), layer 1 softmax attention; Mixtral's top 2 of 4 experts on every layer; residual factors != 1 on both sides
    "minimax": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, block_size=4, linear_attn_alpha_factor=0.8,
                    linear_attn_beta_factor=1.2, full_attn_alpha_factor=1.3, full_attn_beta_factor=0.7, mlp_alpha_factor=0.9, mlp_beta_factor=1.1),
}
ATTENTION_FREE = ("mamba2", "qwen3_5_text_linear", "jamba_linear", "recurrent_gemma_linear", "kimi_linear_linear", "bailing_hybrid_linear", "mamba", "falcon_mamba")


def _reference(folder):
    from speccompile.models.decoder import build_decoder
    from speccompile.models.load import load_model

    loaded = load_model(str(folder))
    return build_decoder(loaded.config, loaded.weights)


def _pass(decoder, ids: list[int], start: int, past: list) -> tuple[np.ndarray, list]:
    """One pass of rows `ids` at positions start..; the cache after all its rows (a chain: every row accepted)."""
    import torch

    from speccompile.models.decoder import causal_mask

    q = len(ids)
    mask = causal_mask(q, start)
    with torch.no_grad():
        out = decoder(torch.tensor([ids]), torch.arange(start, start + q)[None], mask, *past)
    presents, committed = list(out[1:]), []
    for i in range(decoder.config.num_hidden_layers):  # a parallel mixer's (Falcon-H1) states after the layer's keys, values
        pair, presents = presents[:2], presents[2:]
        committed += [t[:, -1] for t in pair] if decoder.config.linear(i) else pair
        if decoder.config.parallel_mixer(i):
            committed += [t[:, -1] for t in presents[:2]]
            presents = presents[2:]
    return out[0][0].numpy(), committed


@pytest.mark.parametrize("name", list(HYBRID))
def test_torch_reference_matches_transformers(tmp_path, name):
    hf = make_family_model(tmp_path / "hf", name, families=HYBRID)
    decoder = _reference(tmp_path / "hf")
    parallel = decoder.config.hybrid.parallel  # Falcon-H1: every layer attention, each with its mixer
    types = HYBRID[name]["layer_types"] if name.startswith(("lfm", "olmo", "minimax")) else ["conv"] * 4 if name in ATTENTION_FREE else ["conv"] * 3 + ["full_attention"]
    types = ["linear_attention", "full_attention"] * 2 if name == "bailing_hybrid" else types  # groups of 2 layers
    assert [decoder.config.linear(i) for i in range(4)] == ([False] * 4 if parallel else [t in ("conv", "linear_attention") for t in types])
    assert [decoder.config.parallel_mixer(i) for i in range(4)] == [parallel] * 4
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    full = _hf_logits(hf, seq)
    logits, _ = _pass(decoder, seq, 0, decoder.empty_past())
    _close(logits, full, f"{name} prefill")
    rows, past = _pass(decoder, seq[:20], 0, decoder.empty_past())
    chained = [rows]
    for start in (20, 23):  # chain passes from the committed states
        rows, past = _pass(decoder, seq[start:start + 3], start, past)
        chained.append(rows)
    _close(np.concatenate(chained), full, f"{name} chain passes")
    one, past = [], decoder.empty_past()  # plain decoding, one row a pass
    for t, token in enumerate(seq[:8]):
        rows, past = _pass(decoder, [token], t, past)
        one.append(rows)
    _close(np.concatenate(one), full[:8], f"{name} one row a pass")


def _greedy(session, prompt: list[int], n: int, draft) -> tuple[list[int], np.ndarray, list[int]]:
    """Greedy decoding of n tokens after `prompt` in chain passes of the pending token + `draft(j)` (j: tokens so far),
    each verified by the exact greedy rule, the accepted rows committed: the tokens, each token's logits, and how
    many drafts each pass accepted."""
    cache = session.new_cache()
    q = len(prompt)
    out = session.run(np.array(prompt), np.arange(q), cache.attention_mask(np.tril(np.ones((q, q), bool))), cache)
    cache.append(out.presents, range(q), q)
    tokens, logits, accepted = [int(out.logits[-1].argmax())], [out.logits[-1]], []
    while len(tokens) < n:
        drafted = draft(len(tokens))
        ids, start = [tokens[-1], *drafted], q + len(tokens) - 1
        cache.maybe_compact(len(ids), 96)  # rejected rows squeezed out (as the runtime's loop does)
        out = session.run(np.array(ids), np.arange(start, start + len(ids)),
                          cache.attention_mask(np.tril(np.ones((len(ids),) * 2, bool))), cache)
        for r in range(len(ids)):
            tokens.append(int(out.logits[r].argmax()))
            logits.append(out.logits[r])
            if r == len(drafted) or drafted[r] != tokens[-1]:
                break
        accepted.append(r)
        cache.append(out.presents, range(r + 1), len(ids))
    return tokens[:n], np.stack(logits[:n]), accepted


def _partly_right(plain: list[int], width: int):
    """Drafts of the plain continuation, `width` long, one token changed every other pass."""
    def draft(j: int) -> list[int]:
        guess = list(plain[j:j + width])
        if j % 2 and len(guess) > 2:
            guess[2] = (guess[2] + 1) % TINY_VOCAB
        return guess
    return draft


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "olmo_hybrid", "lfm2", "lfm2_moe", "lfm3", "lfm3_plain", "granitemoehybrid",
                                  "granitemoehybrid_dense", "bamba", "jamba", "jamba_dense",
                                  "nemotron_h", "nemotron_h_moe", "falcon_h1", "falcon_h1_norm", "kimi_linear", "bailing_hybrid", "recurrent_gemma", "minimax", *ATTENTION_FREE])
def test_graphs_decode_speculatively_exactly(tmp_path, name):
    """The fused CPU graph (the default) and the contract graph (state inputs, per-row state outputs) against
    transformers at every position; a position's logits the same bits in a one-row and a three-row pass; chain
    passes whose drafts are partly right commit the states plain decoding reaches: every token's logits bitwise
    plain decoding's; greedy n-gram speculative decoding through the Runner equals plain decoding. A target without
    attention has no KV input at all (its caches count the committed tokens)."""
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.artifact import open_artifact
    from speccompile.runtime.session import Runner

    hf = make_family_model(tmp_path / "hf", name, families=HYBRID)
    manifest = export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    assert set(manifest.graphs) == {"target", "target-ort"}  # no GPU or slotted graph
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    prompt = seq[:10]
    for fused in (True, False):
        session = open_artifact(tmp_path / "art", threads=1, fused=fused).target
        assert session.spec.file == ("target.ort.onnx" if fused else "target.onnx")
        assert (not session.kv_shapes) == (name in ATTENTION_FREE)
        one = _decoded(session, seq, 1)
        _close(one, _hf_logits(hf, seq)[12:], f"{name} {session.spec.file}")
        np.testing.assert_array_equal(one, _decoded(session, seq, 3))
        plain, plain_logits, _ = _greedy(session, prompt, 30, lambda j: [])
        _close(plain_logits, _hf_logits(hf, prompt + plain)[9:39], f"{name} {session.spec.file} plain decoding")
        tokens, logits, accepted = _greedy(session, prompt, 30, _partly_right(plain, 4))
        assert tokens == plain and max(accepted) == 4 and 0 < min(accepted) < 4
        np.testing.assert_array_equal(logits, plain_logits)
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    text = "abc abd abc abd abc abd abc"
    assert runner.generate(text, chat=False, max_tokens=40).tokens == runner.generate(text, chat=False, max_tokens=40, drafter="none").tokens


def test_wide_heads_cut_passes_and_chain_the_states(tmp_path):
    """head_dim 256 (Qwen3-Next's): the fused CPU graph's passes are cut at the slots measured on this machine (a
    prefill of 247 rows, chain passes across slot 256); each segment starts from the last row's states of the one before: plain
    decoding within 1e-4 of transformers, partly right drafts bitwise plain decoding."""
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.artifact import open_artifact

    wide = {"qwen3_5_text": dict(HYBRID["qwen3_5_text"], head_dim=256)}
    hf = make_family_model(tmp_path / "hf", "qwen3_5_text", families=wide)
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=320))
    session = open_artifact(tmp_path / "art", threads=1).target
    from speccompile.runtime.backends.wide_head_probe import measured_cuts

    assert session.spec.file == "target.ort.onnx" and session.wide.cuts == measured_cuts(256, 1)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, TINY_VOCAB, 247)]
    plain, plain_logits, _ = _greedy(session, prompt, 20, lambda j: [])
    _close(plain_logits, _hf_logits(hf, prompt + plain)[246:266], "head_dim 256 plain decoding")
    tokens, logits, accepted = _greedy(session, prompt, 20, _partly_right(plain, 5))
    assert tokens == plain and max(accepted) > 2
    np.testing.assert_array_equal(logits, plain_logits)


@pytest.mark.parametrize("name, packed_roles", [("qwen3_5_moe_text", ("lin_qkvz", "lin_out")), ("olmo_hybrid", ("lin_qkvz", "lin_ba", "lin_out")), ("lfm2_moe", ("conv_in", "conv_out", "experts")),
                                                ("lfm3", ("conv_in", "conv_out", "self_attn.weight_t", "mlp")),
                                                ("granitemoehybrid", ("ssm_in", "ssm_out")), ("jamba", ("ssm_in", "ssm_out", "experts.3.down_proj")),
                                                ("nemotron_h", ("ssm_in", "up")), ("recurrent_gemma", ("lru_y", "lru_x", "lru_out", "mlp")), ("kimi_linear", ("kda_qkv", "kda_out", "experts.3.down_proj")),
                                                ("bailing_hybrid", ("kda_qkv", "kda_down", "mla_gate", "experts.3.down_proj")),
                                                ("minimax", ("lightning_qkv", "lightning_gate", "lightning_out", "experts.3.down_proj")),
                                                ("falcon_h1", ("ssm_in", "ssm_out", "self_attn.weight_t")),
                                                ("mamba2", ("ssm_in", "ssm_out")), ("falcon_mamba", ("ssm_in", "ssm_out")),
                                                ("nemotron_h_moe", ("ssm_in", "experts.7.down_proj", "shared_expert.weight_t", "shared_expert.down_proj"))])
def test_int4_build_packs_the_projections_and_decodes_exactly(tmp_path, name, packed_roles):
    """`build --int4 --onnx-only`: calibration feeds zero states, the fused graph's projections become MatMulNBits
    (the scan's body is left as it is), and greedy n-gram speculative decoding equals plain decoding (`verify`: identical)."""
    import onnx

    from conftest import run_cli
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.session import Runner

    make_family_model(tmp_path / "hf", name, families=HYBRID)
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    done = run_cli("build", str(tmp_path / "art"), "--int4", "--onnx-only", "--out", str(tmp_path / "int4"))
    assert done.returncode == 0, done.stderr
    nodes = onnx.load(str(tmp_path / "int4" / "target.ort.onnx"), load_external_data=False).graph.node
    packed = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert all(any(role in i for n in packed for i in n.input) for role in packed_roles)
    runner = Runner(tmp_path / "int4", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    text = "abc abd abc abd abc abd abc"
    assert runner.generate(text, chat=False, max_tokens=32).tokens == runner.generate(text, chat=False, max_tokens=32, drafter="none").tokens
    done = run_cli("verify", str(tmp_path / "int4"), "--raw", "--max-tokens", "16", "--limit", "2", "--drafter", "ngram")
    assert done.returncode == 0 and "identical" in done.stdout, done.stdout + done.stderr


def test_what_a_hybrid_target_does_not_run_is_refused(tmp_path):
    """Trees (a head's, at run time and at export; heads draft chains: tests/test_hybrid_drafters.py), shape-invariant
    (padded) passes, shared (slot) passes, a GPU dtype, TensorRT engines and a hybrid model as a draft model: one
    line each."""
    from conftest import run_cli
    from speccompile.errors import UnsupportedError
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.session import Runner

    make_family_model(tmp_path / "hf", "qwen3_5_text", families=HYBRID)
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=64))
    from speccompile.runtime.state_cache import check_hybrid_run
    from speccompile.manifest import read_manifest

    with pytest.raises(UnsupportedError, match="tree: drafter eagle3: a hybrid linear-attention target verifies chains only"):
        check_hybrid_run(read_manifest(tmp_path / "art"), "ort-cpu", "eagle3", str(tmp_path / "art"), chain=False)
    with pytest.raises(UnsupportedError, match="shape_invariant: a hybrid linear-attention target runs its passes as given"):
        Runner(tmp_path / "art", drafter="ngram", threads=1, shape_invariant=True)
    with pytest.raises(UnsupportedError, match="slot_passes all: a hybrid linear-attention target's recurrent states have no batch slots"):
        Runner(tmp_path / "art", drafter="ngram", threads=1).batch_decoder(2, slot_passes="all")
    for args, what in ((["run", str(tmp_path / "art"), "--prompt", "ab", "--drafter", "suffix", "--backend", "ort-cuda"],
                        "runs on --backend ort-cpu only"),
                       (["export", str(tmp_path / "hf"), "--out", str(tmp_path / "f16"), "--dtype", "fp16"], "fp32 only"),
                       (["export", str(tmp_path / "hf"), "--out", str(tmp_path / "e3"), "--drafter", "mtp", "--tree", "eagle-default"],
                        "verifies chains only"),
                       (["build", str(tmp_path / "art"), "--int4", "--out", str(tmp_path / "trt")], "--onnx-only")):
        done = run_cli(*args)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1 and what in errors[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "f16").exists() and not (tmp_path / "e3").exists() and not (tmp_path / "trt").exists()
    from speccompile.models.config import config_from_hf

    raw = json.loads((tmp_path / "hf" / "config.json").read_text())  # every layer linear: built (no attention layer)
    assert config_from_hf({**raw, "layer_types": ["linear_attention"] * 4}, "config.json").hybrid.attention_free
    make_family_model(tmp_path / "llama", "llama")  # a hybrid model as another target's draft model
    done = run_cli("export", str(tmp_path / "llama"), "--out", str(tmp_path / "dm"), "--drafter", f"draft-model:{tmp_path / 'hf'}")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "as a draft model is not supported" in errors[0], done.stderr
    assert not (tmp_path / "dm").exists()


def test_kimi_linear_config_keys_and_refusals():
    """Kimi Linear's config.json as Moonshot writes it: linear_attn_config's 1-indexed kda_layers / full_attn_layers,
    its MoE keys under DeepSeek-V3's names, every layer NoPE; what is not built refused in one line; llama.cpp's
    `kimi-linear` is the same family."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    raw = {"model_type": "kimi_linear", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
           "qk_nope_head_dim": 16, "v_head_dim": 16, "q_lora_rank": None, "mla_use_nope": True, "model_max_length": 512,
           "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 16, "num_heads": 2,
                                  "short_conv_kernel_size": 3},
           "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32, "num_expert_group": 2,
           "topk_group": 1, "moe_renormalize": False, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
           "moe_router_activation_func": "sigmoid"}
    cfg = config_from_hf(raw, "config.json")
    hy, moe = cfg.hybrid, cfg.moe
    assert hy.kind == "kda" and hy.linear == [True, True, False, True] and cfg.nope_layers == [0, 1, 2, 3]
    assert (hy.num_v_heads, hy.k_dim, hy.conv_kernel, hy.row_width()) == (2, 16, 3, 96 + 2 + 32)
    assert {"q_kv", "kv_a_norm", "kv_b"} <= set(cfg.layer_roles(2)) and not {"q_kv", "kv_b", "o_proj"} & set(cfg.layer_roles(0))
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.norm_topk_prob, moe.block, moe.dense_layers) == (8, 2, 2, False, "block_sparse_moe", (0,))
    assert cfg.max_position_embeddings == 512
    for key, value, what in (("mla_use_nope", False, "mla_use_nope false"), ("hidden_act", "gelu", "hidden_act 'gelu'"),
                             ("moe_router_activation_func", "softmax", "moe_router_activation_func 'softmax'"),
                             ("moe_layer_freq", 2, "moe_layer_freq 2"),
                             ("layer_types", ["linear_attention", "mamba", "full_attention", "linear_attention"], "layer_types 'mamba'")):
        with pytest.raises(UnsupportedError, match=what):
            config_from_hf({**raw, key: value}, "config.json")
    assert config_from_hf({**raw, "layer_types": ["linear_attention"] * 4}, "config.json").hybrid.attention_free  # built
    from speccompile.models.config import normalize_architecture

    assert normalize_architecture("kimi-linear", "model.gguf") == "kimi_linear"  # llama.cpp's name (tests/test_gguf_llamacpp.py)


def test_bailing_hybrid_config_keys_and_refusals():
    """Bailing hybrid's config.json as Ling's writes it: groups of layer_group_size layers (the last full attention), KDA
    heads / head_dim (linear_head_dim, else head_dim), its MoE keys under DeepSeek-V3's names, rope on the latent
    attention, the per-head output gate; what is not built refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    raw = {"model_type": "bailing_hybrid", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
           "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "rms_norm_eps": 1e-6, "kv_lora_rank": 32,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "q_lora_rank": None, "model_max_length": 512,
           "layer_group_size": 3, "short_conv_kernel_size": 3, "kda_safe_gate": True, "kda_lower_bound": -4.0,
           "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32, "num_expert_group": 2,
           "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 2,
           "num_nextn_predict_layers": 1, "expert_swiglu_limit_list": [0, 0, 7, 0, 0, 6.5], "share_expert_swiglu_limit_list": None}
    cfg = config_from_hf(raw, "config.json")
    hy, moe = cfg.hybrid, cfg.moe
    assert hy.kind == "kda" and hy.linear == [True, True, False] * 2 and cfg.nope_layers == [] and cfg.attn_head_gate
    assert (hy.num_v_heads, hy.k_dim, hy.conv_kernel, hy.full_gates, hy.gate_bound) == (4, 16, 3, True, -4.0)
    assert "mla_gate" in cfg.layer_roles(2) and not {"kda_f_up", "kda_g_up", "mla_gate", "q_kv"} & set(cfg.layer_roles(0))
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.norm_topk_prob, moe.dense_layers, moe.shared_expert_size) == (8, 2, 2, True, (0, 1), 32)
    assert (cfg.max_position_embeddings, cfg.rope_theta) == (512, 6e6)
    assert [(moe.at_layer(i).clip, moe.at_layer(i).shared_clip) for i in (2, 4, 5)] == [(7.0, 0.0), (0.0, 0.0), (6.5, 0.0)]
    assert config_from_hf({**raw, "rope_theta": 1e6}, "config.json").rope_theta == 1e6
    unsafe = config_from_hf({**raw, "kda_safe_gate": False, "linear_head_dim": 8, "head_dim": 16}, "config.json").hybrid
    assert (unsafe.gate_bound, unsafe.k_dim) == (0.0, 8)  # Kimi's softplus decay; KDA's own head_dim
    for key, value, what in (("hidden_act", "gelu", "hidden_act 'gelu'"), ("kda_lower_bound", 0.0, "kda_lower_bound 0"),
                             ("share_expert_swiglu_limit_list", [7.0] * 5, "share_expert_swiglu_limit_list has 5 limits for 6 layers"),
                             ("layer_types", ["linear_attention", "mamba"] * 3, "layer_types 'mamba'")):
        with pytest.raises(UnsupportedError, match=what):
            config_from_hf({**raw, key: value}, "config.json")
    assert config_from_hf({**raw, "layer_types": ["linear_attention"] * 6}, "config.json").hybrid.attention_free  # built


def test_minimax_config_keys_and_refusals():
    """MiniMax-01's config.json: layer_types (default: even layers softmax attention, odd ones lightning attention), the
    lightning heads (head_dim, else hidden / heads), the residual factors per layer by its kind, Mixtral's MoE keys, rope_theta
    1e6 unless given; what is not built refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    raw = {"model_type": "minimax", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 256,
           "linear_attn_alpha_factor": 0.5, "linear_attn_beta_factor": 2.0, "full_attn_alpha_factor": 3.0, "mlp_beta_factor": 0.25}
    cfg = config_from_hf(raw, "config.json")
    hy = cfg.hybrid
    assert hy.kind == "lightning" and hy.linear == [False, True] * 2 and (hy.num_v_heads, hy.v_dim) == (4, 16)
    assert hy.state_kinds() == ("recurrent", "rows") and hy.row_width() == 128 and hy.recurrent_state_shape() == (4, 16, 16)
    assert cfg.residual_factors == [[3.0, 1.0, 1.0, 0.25], [0.5, 2.0, 1.0, 0.25]] * 2
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.block, cfg.rope_theta) == (4, 2, "block_sparse_moe", 1e6)
    assert set(hy.roles()) <= set(cfg.layer_roles(1)) and "qkv" in cfg.layer_roles(0)
    typed = config_from_hf({**raw, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "head_dim": 8}, "config.json").hybrid
    assert typed.linear == [True] * 3 + [False] and typed.v_dim == 8
    for key, value, what in (("hidden_act", "gelu", "hidden_act 'gelu'"), ("layer_types", ["linear_attention", "mamba"] * 2, "layer_types 'mamba'")):
        with pytest.raises(UnsupportedError, match=what):
            config_from_hf({**raw, key: value}, "config.json")


def test_bailing_hybrid_mtp_layers_are_not_read(tmp_path):
    """The MTP layers a Ling checkpoint stores after the decoder (layers.{num_hidden_layers}.*, num_nextn_predict_layers)
    are left out of the target: its graphs and weights the same bytes as without them."""
    import torch
    from safetensors.torch import load_file, save_file

    from speccompile.export.pipeline import ExportOptions, export_artifact

    make_family_model(tmp_path / "hf", "bailing_hybrid", families=HYBRID)
    export_artifact(str(tmp_path / "hf"), tmp_path / "plain", ExportOptions(max_context=96))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights.update({k.replace(".layers.3.", ".layers.4."): v.clone() for k, v in weights.items() if ".layers.3." in k})
    weights.update({"model.layers.4.enorm.weight": torch.ones(64), "model.layers.4.eh_proj.weight": torch.ones(64, 128)})
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    export_artifact(str(tmp_path / "hf"), tmp_path / "mtp", ExportOptions(max_context=96))
    for name in ("target.onnx", "target.onnx.data", "target.ort.onnx", "target.ort.onnx.data"):
        assert (tmp_path / "mtp" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


def test_kimi_linear_released_latent_width_runs_the_contract_graph(tmp_path):
    """Kimi Linear at its released latent widths (kv_lora_rank 512, rope 64: a 576-wide cache head): no fused CPU graph,
    the contract graph within 1e-4 of transformers at every position, partly right chain drafts bitwise plain decoding."""
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.artifact import open_artifact

    wide = {"kimi_linear": dict(HYBRID["kimi_linear"], kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                num_attention_heads=2, num_key_value_heads=2)}
    hf = make_family_model(tmp_path / "hf", "kimi_linear", families=wide)
    assert set(export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96)).graphs) == {"target"}
    session = open_artifact(tmp_path / "art", threads=1).target
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    _close(_decoded(session, seq, 1), _hf_logits(hf, seq)[12:], "kimi_linear 576-wide target.onnx")
    plain, plain_logits, _ = _greedy(session, seq[:10], 20, lambda j: [])
    tokens, logits, accepted = _greedy(session, seq[:10], 20, _partly_right(plain, 4))
    assert tokens == plain and max(accepted) == 4 and 0 < min(accepted) < 4
    np.testing.assert_array_equal(logits, plain_logits)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_multimodal_checkpoint_exports_its_text_decoder(tmp_path, model_type):
    """Qwen3.5's published form (Qwen3_5ForConditionalGeneration: model.language_model.*, a vision tower, an MTP block
    mtp.*, interleaved mrope sections) exports its text decoder: the vision tower and the MTP block left out, the
    fused graph within 1e-4 of transformers' text-only forward at every position, n-gram speculative == plain."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from conftest import write_char_tokenizer
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.artifact import open_artifact
    from speccompile.runtime.session import Runner

    text = dict(HYBRID[f"{model_type}_text"], vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[3, 3, 2], mrope_interleaved=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.add_(0.2 * torch.randn_like(p))
    folder = tmp_path / "hf"
    hf.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)
    tensors = load_file(folder / "model.safetensors")  # the published checkpoints' MTP block
    tensors.update({"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64)})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    said: list[str] = []
    export_artifact(str(folder), tmp_path / "art", ExportOptions(max_context=96), said.append)
    assert any(m.startswith("text decoder only: visual") for m in said), said
    session = open_artifact(tmp_path / "art", threads=1).target
    assert session.spec.file == "target.ort.onnx"
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([seq])).logits[0].float().numpy()
    _close(_decoded(session, seq, 3), want[12:], f"{model_type} text decoder")
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=32).tokens == runner.generate(prompt, chat=False, max_tokens=32, drafter="none").tokens


def test_a_draft_model_drafts_chains_for_a_hybrid_target(tmp_path):
    """A (Llama) draft model sharing the tokenizer drafts chains for a hybrid target: speculative == plain."""
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.session import Runner

    make_family_model(tmp_path / "hf", "qwen3_next", families=HYBRID)
    make_family_model(tmp_path / "llama", "llama")
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96, drafter=f"draft-model:{tmp_path / 'llama'}"))
    runner = Runner(tmp_path / "art", drafter="draft-model", num_draft_tokens=4, adaptive=False, threads=1)
    text = "abc abd abc abd abc abd abc"
    spec = runner.generate(text, chat=False, max_tokens=32)
    assert sum(spec.stats.drafted) > 0 and spec.tokens == runner.generate(text, chat=False, max_tokens=32, drafter="none").tokens


def test_the_suffix_drafter_drafts_chains_for_a_hybrid_target(tmp_path):
    """The suffix drafter drafts chains for a hybrid target (a recurrent state cannot branch; the state cache
    refuses any other verdict): greedy output equal to plain decoding, alone with the store of earlier responses,
    and in the batch decoder (a server's), one pass per request."""
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.session import Runner

    from test_batch import _decode_together

    make_family_model(tmp_path / "hf", "qwen3_5_text", families=HYBRID)
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    runner = Runner(tmp_path / "art", drafter="suffix", threads=1)
    assert runner.suffix_cache.tree is False
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, TINY_VOCAB, 12)]
    plain = runner.generate_ids(prompt, max_tokens=24, drafter="none").tokens
    first = runner.generate_ids(prompt, max_tokens=24)  # learns the response: the next one drafts from it
    again = runner.generate_ids(prompt, max_tokens=24)
    assert first.tokens == plain and again.tokens == plain
    assert sum(again.stats.drafted) > sum(first.stats.drafted) and again.stats.target_passes < first.stats.target_passes
    together, decoder = _decode_together(runner, [prompt, prompt[:7]], 24, slots=2)
    assert decoder.passes.mode["passes"] == "one-per-request"
    assert [r.tokens for r in together] == [plain, runner.generate_ids(prompt[:7], max_tokens=24, drafter="none").tokens]


@pytest.mark.parametrize("name", ["qwen3_next", "mamba2"])
def test_batched_requests_run_one_pass_each(tmp_path, name):
    """The batch decoder (the server's) runs a hybrid target one pass per request, each request's states in its own
    cache: requests decoded together (continuous batching, 3 slots for 4 requests) get the tokens they get alone; a
    target without attention (mamba2: states alone) likewise, and `speccompile run`, `inspect` and `serve` on it."""
    from conftest import run_cli
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.session import Runner

    from test_batch import _decode_together

    make_family_model(tmp_path / "hf", name, families=HYBRID)
    export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(max_context=96))
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, threads=1)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, TINY_VOCAB, n)] for n in (5, 9, 14, 7)]
    together, decoder = _decode_together(runner, prompts, 20, slots=3)
    assert decoder.passes.mode["passes"] == "one-per-request"
    assert [r.tokens for r in together] == [runner.generate_ids(p, max_tokens=20, drafter="none").tokens for p in prompts]
    if name in ATTENTION_FREE:  # `speccompile run`, and `speccompile serve` answering as the Runner
        import httpx

        from conftest import load_benchmark

        done = run_cli("run", str(tmp_path / "art"), "--prompt", "abc abd abc", "--drafter", "ngram", "--max-tokens", "12")
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        done = run_cli("inspect", str(tmp_path / "art"))
        assert done.returncode == 0 and "0 heads / 0 KV heads" in done.stdout, done.stdout + done.stderr
        server = load_benchmark("server_process").ServerProcess(tmp_path / "art", "--served-model-name", "m", "--threads", "1")
        try:
            body = {"model": "m", "prompt": "abc abd abc", "max_tokens": 16, "temperature": 0}
            answer = httpx.post(f"{server.url}/completions", json=body, timeout=120).json()
        finally:
            assert server.stop() == 0
        assert answer["choices"][0]["text"] == runner.generate("abc abd abc", chat=False, max_tokens=16).text


def test_lfm2_config_keys_and_refusals():
    """LFM2's own config.json keys (LFM2-350M's: block_ff_dim, full_attn_idxs, tie_embedding): the MLP width after
    transformers' auto adjustment (6656 -> 4608), short convs where no attention; conv biases refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="lfm2", vocab_size=65536, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=8, block_ff_dim=6656, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                block_multiple_of=256, conv_L_cache=3, norm_eps=1e-5, tie_embedding=True, rope_theta=1000000.0,
                full_attn_idxs=[2, 5, 8, 10, 12, 14], max_position_embeddings=128000)
    cfg = config_from_hf(data, "lfm2.json")
    assert cfg.intermediate_size == 4608 and cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 1e6
    assert [i for i in range(16) if not cfg.linear(i)] == [2, 5, 8, 10, 12, 14]
    assert cfg.hybrid.short_conv and cfg.hybrid.conv_state_shape() == (1024, 2) and cfg.hybrid.state_kinds() == ("conv", "rows")
    with pytest.raises(UnsupportedError, match="lfm2.json: conv_bias true"):
        config_from_hf(dict(data, conv_bias=True), "lfm2.json")
    assert config_from_hf(dict(data, full_attn_idxs=[]), "lfm2.json").hybrid.attention_free  # every layer a short conv


def test_olmo_hybrid_config_keys_and_refusals():
    """OLMo Hybrid's config.json (OLMo-Hybrid-7B's shape, linear keys left to transformers' defaults): linear heads
    num_attention_heads, key head dim 0.75 hidden / heads, value head dim twice it, every 4th layer full; beta in [0, 2]
    unless linear_allow_neg_eigval is false, FLA's gated-norm epsilon, pre-norm delta-net layers beside post-norm
    attention (their roles), no output gate; what it does not build (and its GGUF) refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf, config_from_hf

    data = dict(model_type="olmo_hybrid", vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=8,
                num_attention_heads=30, max_position_embeddings=65536)
    cfg = config_from_hf(data, "olmo.json")
    h = cfg.hybrid
    assert (h.num_k_heads, h.num_v_heads, h.k_dim, h.v_dim, h.conv_kernel) == (30, 30, 96, 192, 4) and cfg.num_key_value_heads == 30
    assert [i for i in range(8) if not cfg.linear(i)] == [3, 7] and h.beta_scale == 2.0 and h.norm_eps == 1e-5
    assert cfg.rms_norm_eps == 1e-6 and not cfg.attn_output_gate and cfg.qk_norm and cfg.qk_norm_full
    assert [cfg.placement_of(i) for i in (0, 3)] == ["pre", "post"]
    assert {"input_norm", "post_norm"} <= set(cfg.layer_roles(0)) and "post_attn_norm" not in cfg.layer_roles(0)
    assert {"post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"} <= set(cfg.layer_roles(3)) and "input_norm" not in cfg.layer_roles(3)
    assert config_from_hf(dict(data, linear_allow_neg_eigval=False), "olmo.json").hybrid.beta_scale == 1.0
    assert [config_from_hf(dict(data, num_hidden_layers=3), "olmo.json").linear(i) for i in range(3)] == [True, True, False]
    for key, value, message in (("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
                                ("layer_types", ["linear_attention", "sliding_attention"] * 4, "layer_types 'sliding_attention'"),
                                ("linear_num_value_heads", 45, "not a multiple of linear_num_key_heads")):
        with pytest.raises(UnsupportedError, match=message):
            config_from_hf(dict(data, **{key: value}), "olmo.json")
    assert config_from_hf(dict(data, layer_types=["linear_attention"] * 8), "olmo.json").hybrid.attention_free  # no attention: built
    with pytest.raises(UnsupportedError, match="GGUF olmo_hybrid is not supported"):  # llama.cpp's converter has no OLMo Hybrid
        config_from_gguf({"general.architecture": "olmo_hybrid"}, False, False, "model.gguf")


def test_lfm2_moe_config_keys():
    """LFM2-MoE's config.json keys (LFM2-8B-A1B's shape): short convs where no attention, the dense MLP of
    intermediate_size unadjusted on the first num_dense_layers, sigmoid routing in one group with the score bias,
    renormalised with transformers' 1e-6."""
    from speccompile.models.config import config_from_hf

    data = dict(model_type="lfm2_moe", vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
                num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8, num_dense_layers=2, num_experts=32,
                num_experts_per_tok=4, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0, conv_L_cache=3,
                norm_eps=1e-5, tie_embedding=True, rope_theta=1000000.0, max_position_embeddings=128000,
                layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)])
    cfg = config_from_hf(data, "lfm2_moe.json")
    moe = cfg.moe
    assert cfg.intermediate_size == 7168 and [i for i in range(24) if not cfg.linear(i)] == [2, 6, 10, 14, 18, 21]
    assert (moe.routing, moe.score_bias, moe.norm_topk_prob, moe.renorm_eps) == ("sigmoid_group", True, True, 1e-6)
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.dense_layers) == (32, 4, 1792, (0, 1))
    assert moe.expert_sources(5, 3)["gate"] == "model.layers.5.feed_forward.experts.3.w1.weight"


def test_lfm3_config_keys_and_refusals():
    """LFM3's config.json keys (transformers' defaults, LFM3-1.7B's shape): short convs where no attention, sliding
    layers (window 256, their own default rope of base 1e4) and full ones (proportional rope on half of each 128-dim head,
    base 1e6), the per-head output gate, sandwich norms, the MLP width unadjusted; use_sandwich_norm / use_attention_gate
    false read; attention biases, conv biases, sliding layers without a window or with scaled rope, partial rotary
    without proportional rope, its GGUF refused."""
    import transformers

    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf, config_from_hf
    from speccompile.models.rope import rope_inv_freq

    data = transformers.Lfm3Config().to_dict()
    cfg = config_from_hf(data, "lfm3.json")
    assert (cfg.intermediate_size, cfg.head_dim, cfg.num_key_value_heads, cfg.hybrid.conv_state_shape()) == (7680, 128, 4, (2048, 6))
    assert [i for i in range(24) if not cfg.linear(i)] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]
    assert [i for i in range(24) if cfg.sliding(i)] == [4, 8, 12, 16, 20] and cfg.sliding_window == 256
    assert [cfg.rope_kind(i) for i in (2, 4)] == ["global", "local"] and (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.rotary_dim == 0 and (rope_inv_freq(cfg)[32:] == 0).all() and (rope_inv_freq(cfg)[:32] > 0).all()
    assert (rope_inv_freq(cfg, "local") > 0).all()
    assert (cfg.placement, cfg.attn_output_gate, cfg.gate_dim, cfg.qk_norm, cfg.tie_word_embeddings) == ("sandwich", True, 1, True, True)
    plain = config_from_hf(dict(data, use_sandwich_norm=False, use_attention_gate=False), "lfm3.json")
    assert (plain.placement, plain.attn_output_gate, plain.gate_dim) == ("pre", False, 0)
    for key, value, why in (("attention_bias", True, "lfm3 with attention_bias"), ("conv_bias", True, "conv_bias true"),
                            ("sliding_window", None, "without a sliding_window"),
                            ("rope_parameters", {**data["rope_parameters"], "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4,
                                                                                                 "factor": 2.0}}, "sliding_attention"),
                            ("rope_parameters", {**data["rope_parameters"], "full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                                                                              "partial_rotary_factor": 0.5}}, "full_attention")):
        with pytest.raises(UnsupportedError, match=f"lfm3.json: .*{why}"):
            config_from_hf(dict(data, **{key: value}), "lfm3.json")
    with pytest.raises(UnsupportedError, match="a GGUF lfm3 is not supported"):
        config_from_gguf({"general.architecture": "lfm3"}, False, False, "lfm3.gguf")


def test_granite_4_h_config_keys_and_refusals():
    """A Granite 4.0-H-Tiny-shaped config.json (its sizes as published, the attention indices assumed: no hub here to read
    the file; transformers 4.56's keys: layer_types "mamba" / "attention", NoPE, 64 experts
    and a shared MLP): Mamba-2 layers where no attention, their shape, Granite's multipliers; what is not built refused
    in one line naming the file and the key (Mamba-1: not in the table)."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    attention = [5, 15, 25, 35]
    data = dict(model_type="granitemoehybrid", vocab_size=100352, hidden_size=1536, intermediate_size=512, num_hidden_layers=40,
                num_attention_heads=12, num_key_value_heads=4, layer_types=["attention" if i in attention else "mamba" for i in range(40)],
                mamba_n_heads=48, mamba_n_groups=1, mamba_d_state=128, mamba_d_head=64, mamba_d_conv=4, mamba_expand=2,
                mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, num_local_experts=64, num_experts_per_tok=6,
                shared_intermediate_size=1024, position_embedding_type="nope", embedding_multiplier=12, attention_multiplier=0.0078125,
                residual_multiplier=0.22, logits_scaling=6, rms_norm_eps=1e-5, rope_theta=10000, tie_word_embeddings=True,
                hidden_act="silu", max_position_embeddings=131072, attention_bias=False, normalization_function="rmsnorm")
    cfg = config_from_hf(data, "granite.json")
    assert [i for i in range(40) if not cfg.linear(i)] == attention and cfg.nope_layers == list(range(40))
    hy = cfg.hybrid
    assert hy.mamba2 and hy.conv_bias and hy.conv_dim == 3072 + 2 * 128 and hy.row_width() == 3328 + 48 + 1
    assert hy.conv_state_shape() == (3328, 3) and hy.recurrent_state_shape() == (48, 128, 64) and hy.state_kinds() == ("conv", "recurrent", "rows")
    assert cfg.moe.num_experts == 64 and cfg.moe.top_k == 6 and cfg.moe.shared_expert_size == 1024 and cfg.moe.expert_size == 512
    assert cfg.attn_scale == 0.0078125 and cfg.embed_scale == 12 and cfg.residual_scale == 0.22 and cfg.logit_scale == 1 / 6
    assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    dense = config_from_hf(dict(data, num_local_experts=0, position_embedding_type="rope"), "granite.json")
    assert dense.moe is None and dense.intermediate_size == 1024 and dense.nope_layers == []
    assert config_from_hf(dict(data, layer_types=["mamba"] * 40), "granite.json").hybrid.attention_free  # every layer Mamba-2: built
    for key, value, said in (("mamba_proj_bias", True, "granite.json: mamba_proj_bias true"),
                             ("time_step_limit", [0.001, 0.1], "granite.json: time_step_limit"),
                             ("hidden_act", "gelu", "granite.json: hidden_act 'gelu'"),
                             ("layer_types", ["mamba"] * 39 + ["moe"], "granite.json: layer_types 'moe'")):
        with pytest.raises(UnsupportedError, match=said):
            config_from_hf(dict(data, **{key: value}), "granite.json")


def test_jamba_config_keys_and_refusals():
    """A Jamba-v0.1-shaped config.json (its published keys): attention every 8th layer from 4, NoPE; Mamba-1 layers
    (inner 2 x 4096, d_state 16, dt rank 256 or "auto": ceil(hidden / 16)), their state shapes; 16 experts top 2 not
    renormalised every other layer from 1, SwiGLUs between; transformers' defaults where keys are absent; what is not
    built refused in one line naming the file and the key (every layer Mamba-1, no attention layer, is built)."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="jamba", vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                expert_layer_offset=1, num_experts=16, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                mamba_dt_rank=256, mamba_conv_bias=True, mamba_proj_bias=False, hidden_act="silu", rms_norm_eps=1e-6,
                use_mamba_kernels=True, sliding_window=None, n_ctx=262144, max_position_embeddings=262144, tie_word_embeddings=False)
    cfg = config_from_hf(data, "jamba.json")
    assert [i for i in range(32) if not cfg.linear(i)] == [4, 12, 20, 28] and cfg.nope_layers == list(range(32))
    hy = cfg.hybrid
    assert hy.mamba1 and not hy.mamba2 and hy.conv_bias and hy.width == hy.conv_dim == 8192 and hy.k_dim == 16 and hy.dt_rank == 256
    assert hy.row_width() == 8193 and hy.conv_state_shape() == (8192, 3) and hy.recurrent_state_shape() == (8192, 16)
    assert hy.state_kinds() == ("conv", "recurrent", "rows") and "ssm_conv_bias" in hy.roles() and "ssm_dt_norm" in hy.roles()
    moe = cfg.moe
    assert moe.num_experts == 16 and moe.top_k == 2 and moe.expert_size == 14336 and cfg.intermediate_size == 14336
    assert moe.routing == "softmax_topk" and not moe.norm_topk_prob and moe.dense_layers == tuple(range(0, 32, 2))
    assert moe.shapes(1, 4096)["model.layers.1.feed_forward.router.weight"] == (16, 4096)
    assert cfg.rms_norm_eps == 1e-6 and not cfg.tie_word_embeddings
    bare = {k: v for k, v in data.items() if not k.startswith(("attn_layer", "expert_layer", "num_experts", "mamba_"))}
    defaults = config_from_hf(dict(bare, hidden_size=4100, num_attention_heads=41), "jamba.json")  # transformers' defaults
    assert [i for i in range(32) if not defaults.linear(i)] == [4, 12, 20, 28] and defaults.hybrid.dt_rank == 257
    assert defaults.hybrid.width == 8200 and defaults.hybrid.k_dim == 16 and defaults.hybrid.conv_kernel == 4 and defaults.hybrid.conv_bias
    assert defaults.moe.num_experts == 16 and defaults.moe.top_k == 2 and defaults.moe.dense_layers == tuple(range(0, 32, 2))
    dense = config_from_hf(dict(data, num_experts=1, mamba_conv_bias=False, use_mamba_kernels=False), "jamba.json")
    assert dense.moe is None and "ssm_conv_bias" not in dense.hybrid.roles()
    for key, value, said in (("mamba_proj_bias", True, "jamba.json: mamba_proj_bias true"),
                             ("hidden_act", "gelu", "jamba.json: hidden_act 'gelu'")):
        with pytest.raises(UnsupportedError, match=said):
            config_from_hf(dict(data, **{key: value}), "jamba.json")
    assert config_from_hf(dict(data, attn_layer_offset=40), "jamba.json").hybrid.attention_free  # every layer Mamba-1: built


def test_bamba_config_keys():
    """Bamba-9B's config.json keys: attention at attn_layer_indices with rope on half of each head (transformers'
    hard-coded partial_rotary_factor 0.5), Mamba-2 layers elsewhere, a dense SwiGLU; MLP biases refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="bamba", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64,
                mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=262144, tie_word_embeddings=False)
    cfg = config_from_hf(data, "bamba.json")
    assert [i for i in range(32) if not cfg.linear(i)] == [9, 18, 27] and cfg.nope_layers == [] and cfg.rotary_dim == 64
    assert cfg.moe is None and cfg.intermediate_size == 14336 and cfg.hybrid.recurrent_state_shape() == (128, 128, 64)
    assert cfg.embed_scale == 1.0 and cfg.residual_scale == 1.0 and cfg.logit_scale == 1.0
    with pytest.raises(UnsupportedError, match="bamba.json: bamba with mlp_bias"):
        config_from_hf(dict(data, mlp_bias=True), "bamba.json")


def test_falcon_h1_config_keys_and_refusals():
    """A Falcon-H1-0.5B-shaped config.json (its sizes and multipliers as recalled, no hub here to read the file): every layer
    attention (full rope) with a Mamba-2 mixer beside it of mamba_d_ssm channels (not mamba_expand x hidden), its output
    unnormed; the embedding and LM head multipliers as the table's scales, the others folded into the projections' rows;
    the gate norm by mamba_rms_norm / mamba_norm_before_gate; what is not built refused in one line naming the file and key."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    ssm = [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]
    data = dict(model_type="falcon_h1", vocab_size=32784, hidden_size=1024, intermediate_size=2048, num_hidden_layers=36,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
                mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128, mamba_conv_bias=True,
                mamba_proj_bias=False, mamba_norm_before_gate=False, mamba_rms_norm=False, rope_theta=1e11, rms_norm_eps=1e-5,
                embedding_multiplier=5.65625, lm_head_multiplier=0.0390625, attention_in_multiplier=1.0, attention_out_multiplier=0.9375,
                key_multiplier=0.390625, ssm_in_multiplier=1.25, ssm_out_multiplier=0.2357, ssm_multipliers=ssm,
                mlp_multipliers=[0.8838834764831844, 0.5859375], projectors_bias=False, attention_bias=False, mlp_bias=False,
                tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=16384, time_step_limit=[0.0, float("inf")])
    cfg = config_from_hf(data, "fh1.json")
    hy = cfg.hybrid
    assert not any(map(cfg.linear, range(36))) and all(map(cfg.parallel_mixer, range(36))) and cfg.nope_layers == []
    assert hy.mamba2 and hy.parallel and hy.gate_norm == "none" and hy.value_dim == 1536 and hy.recurrent_state_shape() == (24, 128, 64)
    assert "ssm_in" in cfg.layer_roles(0) and "qkv" in cfg.layer_roles(0) and "ssm_norm" not in cfg.layer_roles(0)
    assert (cfg.embed_scale, cfg.logit_scale, cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (5.65625, 0.0390625, 64, 0, 1e11)
    assert hy.scales["mamba.in_proj.weight"] == [[1536, ssm[0] * 1.25], [1536, 0.3125], [128, ssm[2] * 1.25], [128, 0.625], [24, ssm[4] * 1.25]]
    assert hy.scales["self_attn.k_proj.weight"] == [[128, 0.390625]] and "self_attn.q_proj.weight" not in hy.scales  # all 1: none
    assert hy.scales["feed_forward.down_proj.weight"] == [[1024, 0.5859375]] and hy.scales["mamba.out_proj.weight"] == [[1024, 0.2357]]
    for norm, before, gate in ((True, False, "gated"), (True, True, "before_gate")):
        assert config_from_hf(dict(data, mamba_rms_norm=norm, mamba_norm_before_gate=before), "fh1.json").hybrid.gate_norm == gate
    assert config_from_hf(dict(data, mamba_d_ssm=None, mamba_d_head="auto", mamba_n_heads=32), "fh1.json").hybrid.value_dim == 2048
    for key, value, said in (("attention_bias", True, "fh1.json: falcon_h1 with attention_bias"),
                             ("projectors_bias", True, "fh1.json: falcon_h1 with projectors_bias"),
                             ("mamba_proj_bias", True, "fh1.json: mamba_proj_bias true"), ("mlp_bias", True, "fh1.json: falcon_h1 with mlp_bias"),
                             ("time_step_limit", [0.001, 0.1], "fh1.json: time_step_limit"), ("hidden_act", "gelu", "fh1.json: hidden_act 'gelu'")):
        with pytest.raises(UnsupportedError, match=said) as info:
            config_from_hf(dict(data, **{key: value}), "fh1.json")
        assert "\n" not in str(info.value)


def test_falcon_h1_gguf_metadata_and_refusals():
    """llama.cpp's falcon-h1 metadata (the converter folds every multiplier into the tensors): the Mamba-2 sizes from
    `ssm.*` beside attention in every layer, no multiplier left, the conv bias from the file's tensors; a file with the
    mixer's norm (its order against the gate not recorded) or without an output tensor refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf

    p = "falcon-h1."
    meta = {"general.architecture": "falcon-h1", p + "block_count": 3, p + "embedding_length": 64, p + "attention.head_count": 4,
            p + "attention.head_count_kv": 2, p + "attention.key_length": 16, p + "feed_forward_length": 128, p + "vocab_size": 256,
            p + "attention.layer_norm_rms_epsilon": 1e-5, p + "rope.freq_base": 1e11, p + "ssm.conv_kernel": 4, p + "ssm.state_size": 16,
            p + "ssm.group_count": 2, p + "ssm.inner_size": 96, p + "ssm.time_step_rank": 6}
    tensors = {"output.weight": (256, 64), **{f"blk.{b}.ssm_in.weight": (262, 64) for b in range(3)}}
    cfg = config_from_gguf(meta, True, False, "fh1.gguf", tensors=tensors)
    hy = cfg.hybrid
    assert cfg.architecture == "falcon_h1" and all(map(cfg.parallel_mixer, range(3))) and not any(map(cfg.linear, range(3)))
    assert (hy.value_dim, hy.num_v_heads, hy.v_dim, hy.num_k_heads, hy.k_dim, hy.conv_bias, hy.gate_norm) == (96, 6, 16, 2, 16, False, "none")
    assert hy.scales == {} and (cfg.embed_scale, cfg.logit_scale, cfg.rope_theta, cfg.head_dim) == (1.0, 1.0, 1e11, 16)
    assert config_from_gguf(meta, True, False, "fh1.gguf", tensors={**tensors, "blk.0.ssm_conv1d.bias": (160,)}).hybrid.conv_bias
    for change, said in (({"blk.0.ssm_norm.weight": (2, 48)}, "fh1.gguf: a falcon-h1 GGUF with ssm_norm"),
                         ({"output.weight": None}, "fh1.gguf: a falcon-h1 GGUF without output.weight")):
        names = {k: v for k, v in {**tensors, **change}.items() if v is not None}
        with pytest.raises(UnsupportedError, match=said) as info:
            config_from_gguf(meta, "output.weight" in names, False, "fh1.gguf", tensors=names)
        assert "\n" not in str(info.value)


_NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"  # Nemotron-H-8B-Base-8K's: 24 M, 4 *, 24 -
_NANO_2_9B = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"  # Nemotron Nano 2 9B's: 27 M, 4 *, 25 -


def test_nemotron_h_config_keys_and_refusals():
    """Nemotron-H-8B-like (hybrid_override_pattern, attention_head_dim, the legacy mamba_* keys) and Nemotron-Nano-2-9B-like config.json
    (mamba heads x head_dim != expand x hidden): each mixer block and the MLP block after it one table layer, a mixer
    followed by a mixer a layer without an MLP, every layer NoPE; what is not built refused in one line naming the key."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="nemotron_h", vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=52,
                num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128, hybrid_override_pattern=_NEMOTRON_H_8B,
                mamba_num_heads=128, mamba_head_dim=64, mamba_n_groups=8, ssm_state_size=128, mamba_d_conv=4, mamba_expand=2,
                mamba_conv_bias=True, mamba_proj_bias=False, mamba_dt_limit=[0.0, float("inf")], mamba_hidden_act="silu",
                mlp_hidden_act="relu2", layer_norm_epsilon=1e-5, attention_bias=False, use_bias=False, mlp_bias=False,
                residual_in_fp32=False, tie_word_embeddings=False, max_position_embeddings=8192)
    cfg = config_from_hf(data, "nh.json")
    attention = [i for i, m in enumerate(c for c in _NEMOTRON_H_8B if c != "-") if m == "*"]
    assert cfg.num_hidden_layers == 28 and [i for i in range(28) if not cfg.linear(i)] == attention == [4, 10, 16, 22]
    assert [i for i in range(28) if not cfg.has_mlp(i)] == [a - 1 for a in attention] and cfg.nope_layers == list(range(28))
    assert cfg.hybrid.mamba2 and cfg.hybrid.conv_bias and cfg.hybrid.recurrent_state_shape() == (128, 128, 64)
    assert cfg.hybrid.conv_dim == 8192 + 2 * 8 * 128 and cfg.layer(0).intermediate_size == 21504 and not cfg.mlp_gated
    assert cfg.mlp_act == "relu2" and cfg.rms_norm_eps == 1e-5 and cfg.head_dim == 128 and not cfg.attention_bias
    assert "post_norm" not in cfg.layer_roles(attention[0] - 1) and "up" in cfg.layer_roles(attention[0])
    assert config_from_hf(dict(data, attention_head_dim=None, head_dim=96), "nh.json").head_dim == 96
    nano = dict(data, hidden_size=4480, intermediate_size=15680, num_attention_heads=40, hybrid_override_pattern=None,
                layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp"}[c] for c in _NANO_2_9B],
                mamba_head_dim=80, n_groups=8, conv_kernel=4, time_step_limit=[0.0, {"__float__": "Infinity"}])
    cfg = config_from_hf(nano, "nano.json")
    assert cfg.num_hidden_layers == 31 and sum(not cfg.linear(i) for i in range(31)) == 4 and cfg.hybrid.value_dim == 10240
    assert [i for i in range(31) if not cfg.has_mlp(i)] == [3, 7, 11, 16, 21, 24]
    mamba_only = config_from_hf(dict(data, hybrid_override_pattern="M-M-"), "nh.json")  # no attention block: built
    assert mamba_only.hybrid.attention_free and mamba_only.num_hidden_layers == 2
    for key, value, said in (("hybrid_override_pattern", "MEE*", "nh.json: layers_block_type 'moe' at block 2"),
                             ("hybrid_override_pattern", "E*M", "nh.json: layers_block_type 'moe' at block 0"),
                             ("hybrid_override_pattern", "M--*-", "nh.json: layers_block_type 'mlp' at block 2"),
                             ("hybrid_override_pattern", "-M*", "nh.json: layers_block_type 'mlp' at block 0"),
                             ("hybrid_override_pattern", "MX*", "nh.json: hybrid_override_pattern 'MX\\*'"),
                             ("num_nextn_predict_layers", 1, "nh.json: num_nextn_predict_layers 1"),
                             ("mamba_dt_limit", [0.001, 0.1], "nh.json: time_step_limit"),
                             ("mamba_hidden_act", "gelu", "nh.json: hidden_act 'gelu'"),
                             ("use_bias", True, "nh.json: nemotron_h with use_bias"), ("mlp_bias", True, "nh.json: nemotron_h with mlp_bias"),
                             ("mlp_hidden_act", "tanh", "nh.json: nemotron_h with mlp_hidden_act 'tanh'")):
        with pytest.raises(UnsupportedError, match=said):
            config_from_hf(dict(data, **{key: value}), "nh.json")


def test_mamba2_config_keys_and_refusals():
    """A Mamba-2-2.7B-shaped config.json (transformers' Mamba2Config keys): every layer Mamba-2 without an MLP, no attention
    layer, the SSM's shape under its own key names; in / out projection biases, a clamped dt and another activation
    refused in one line naming the key."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="mamba2", vocab_size=50288, hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, state_size=128,
                expand=2, n_groups=1, conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
                residual_in_fp32=True, time_step_limit=[0.0, float("inf")], tie_word_embeddings=True)
    cfg = config_from_hf(data, "mamba2.json")
    assert cfg.hybrid.attention_free and cfg.num_hidden_layers == 64 and not any(cfg.has_mlp(i) for i in range(64))
    assert cfg.hybrid.mamba2 and cfg.hybrid.recurrent_state_shape() == (80, 128, 64) and cfg.hybrid.conv_dim == 5120 + 2 * 128
    assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings and cfg.hybrid.conv_bias and cfg.rope_kinds() == []
    for key, value, said in (("use_bias", True, "mamba2.json: mamba2 with use_bias"), ("time_step_limit", [0.0, 0.1], "mamba2.json: time_step_limit"),
                             ("hidden_act", "gelu", "mamba2.json: hidden_act 'gelu'")):
        with pytest.raises(UnsupportedError, match=said) as info:
            config_from_hf(dict(data, **{key: value}), "mamba2.json")
        assert "\n" not in str(info.value)


def test_mamba_and_falcon_mamba_config_keys_and_refusals():
    """mamba-2.8b-hf's and Falcon-Mamba-7B's config.json (transformers' MambaConfig / FalconMambaConfig keys): every layer
    Mamba-1 of intermediate_size channels without an MLP, no attention layer; Mamba's mixer without dt / B / C norms,
    Falcon-Mamba's without gains at mixer_rms_eps (the blocks' norms at layer_norm_epsilon); in / out projection biases
    and another activation refused in one line naming the key; no conv bias built."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="mamba", vocab_size=50280, hidden_size=2560, num_hidden_layers=64, state_size=16, expand=2,
                intermediate_size=5120, conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
                residual_in_fp32=True, time_step_rank=160, tie_word_embeddings=True)
    cfg = config_from_hf(data, "mamba.json")
    hy = cfg.hybrid
    assert cfg.architecture == "mamba" and hy.attention_free and cfg.num_hidden_layers == 64 and not any(cfg.has_mlp(i) for i in range(64))
    assert hy.mamba1 and hy.width == 5120 and hy.k_dim == 16 and hy.dt_rank == 160 and hy.conv_bias and hy.mixer_norms == "none"
    assert hy.recurrent_state_shape() == (5120, 16) and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings and cfg.rope_kinds() == []
    assert "ssm_b_norm" not in cfg.layer_roles(0) and "input_norm" in cfg.layer_roles(0) and "down" not in cfg.layer_roles(0)
    falcon = config_from_hf(dict(data, model_type="falcon_mamba", hidden_size=4096, intermediate_size=8192, time_step_rank=256,
                                 mixer_rms_eps=1e-6, use_conv_bias=False, tie_word_embeddings=False), "falcon.json")
    fy = falcon.hybrid
    assert fy.mixer_norms == "plain" and fy.norm_eps == 1e-6 and falcon.rms_norm_eps == 1e-5 and fy.width == 8192 and not fy.conv_bias
    assert "ssm_dt_norm" not in falcon.layer_roles(0) and "ssm_conv_bias" not in falcon.layer_roles(0) and "ssm_x" in falcon.layer_roles(0)
    auto = config_from_hf({k: v for k, v in data.items() if k not in ("time_step_rank", "intermediate_size")}, "mamba.json")
    assert auto.hybrid.dt_rank == 160 and auto.hybrid.width == 5120  # transformers' "auto": ceil(hidden / 16); expand x hidden
    for key, value, said in (("use_bias", True, "mamba.json: mamba with use_bias"), ("hidden_act", "gelu", "mamba.json: hidden_act 'gelu'")):
        with pytest.raises(UnsupportedError, match=said) as info:
            config_from_hf(dict(data, **{key: value}), "mamba.json")
        assert "\n" not in str(info.value)


_NANO_3_30B = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # Nemotron-3-Nano-30B-A3B's: 23 M, 6 *, 23 E


def test_nemotron_3_nano_config_keys_and_refusals():
    """Nemotron-3-Nano-30B-A3B-like config.json: each mixer block and the MoE block after it one table layer; 128 ungated
    relu2 experts, 6 active, DeepSeek-V3's sigmoid routing with the score bias in one group, renormalised, times 2.5; one
    ungated shared expert of moe_shared_expert_intermediate_size; the layers without an MLP (a Mamba-2 block before attention)
    in `dense_layers`; latent expert projections and xIELU experts refused in one line naming the key."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf

    data = dict(model_type="nemotron_h", vocab_size=131072, hidden_size=2688, intermediate_size=1856, num_attention_heads=32,
                num_key_value_heads=2, head_dim=128, hybrid_override_pattern=_NANO_3_30B, mamba_num_heads=64, mamba_head_dim=64,
                n_groups=8, ssm_state_size=128, conv_kernel=4, n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=1,
                moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, moe_latent_size=None, n_group=1, topk_group=1,
                norm_topk_prob=True, routed_scaling_factor=2.5, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    cfg = config_from_hf(data, "nano3.json")
    mixers = [c for c in _NANO_3_30B if c != "E"]
    assert cfg.num_hidden_layers == 29 and [i for i in range(29) if not cfg.linear(i)] == [i for i, c in enumerate(mixers) if c == "*"]
    moe, no_mlp = cfg.moe, [i for i in range(29) if not cfg.has_mlp(i)]
    assert no_mlp == [2, 6, 10, 14, 18, 23] and moe.dense_layers == tuple(no_mlp) and sum(map(moe.is_moe, range(29))) == 23
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.shared_expert_size) == (128, 6, 1856, 3712)
    assert (moe.routing, moe.score_bias, moe.norm_topk_prob, moe.routed_scale, moe.n_group, moe.topk_group) == ("sigmoid_group", True, True, 2.5, 1, 1)
    assert (moe.act, moe.expert_gated, moe.shared_gated, moe.shared_name) == ("relu2", False, False, "shared_experts")
    assert moe.expert_sources(0, 3) == {"up": "model.layers.0.mlp.experts.3.up_proj.weight", "down": "model.layers.0.mlp.experts.3.down_proj.weight"}
    shapes = moe.shapes(0, 2688)
    assert len(shapes) == 2 + 2 * 128 + 2 and shapes["model.layers.0.mlp.shared_experts.up_proj.weight"] == (3712, 2688)
    assert not any("gate_proj" in name for name in shapes) and shapes["model.layers.0.mlp.gate.e_score_correction_bias"] == (128,)
    for key, value, said in (("moe_latent_size", 1024, "nano3.json: moe_latent_size 1024"),
                             ("mlp_hidden_act", "xielu", "nano3.json: mlp_hidden_act 'xielu'")):
        with pytest.raises(UnsupportedError, match=said):
            config_from_hf(dict(data, **{key: value}), "nano3.json")


def _nemotron_h_gguf(pattern: str, arch: str) -> tuple[dict, dict]:
    """(metadata, tensor shapes) as llama.cpp's converter writes a tiny Nemotron-H of block pattern `pattern` (M, *, -, E):
    head_count_kv per block, feed_forward_length per block (nemotron_h: its MLP blocks', nemotron_h_moe: its MoE blocks')."""
    p, moe = f"{arch}.", arch == "nemotron_h_moe"
    meta = {"general.architecture": arch, p + "block_count": len(pattern), p + "embedding_length": 64, p + "attention.head_count": 4,
            p + "attention.head_count_kv": [2 * (c == "*") for c in pattern], p + "attention.key_length": 16,
            p + "feed_forward_length": [32 if c == "E" else 0 if moe else 128 * (c == "-") for c in pattern], p + "vocab_size": 256,
            p + "attention.layer_norm_epsilon": 1e-5, p + "ssm.conv_kernel": 4, p + "ssm.state_size": 16, p + "ssm.group_count": 2,
            p + "ssm.inner_size": 128, p + "ssm.time_step_rank": 8, p + "expert_count": 8, p + "expert_used_count": 2,
            p + "expert_feed_forward_length": 32, p + "expert_shared_feed_forward_length": 64, p + "expert_weights_norm": True,
            p + "expert_weights_scale": 2.5, p + "expert_group_count": 1, p + "expert_group_used_count": 1}
    own = {"M": ("ssm_in.weight", "ssm_conv1d.bias"), "*": ("attn_q.weight",), "-": ("ffn_up.weight",), "E": ("ffn_gate_inp.weight",)}
    tensors = {f"blk.{b}.{name}": (128, 64) for b, c in enumerate(pattern) for name in own[c]}
    return meta, tensors


def test_nemotron_h_gguf_metadata_and_refusals():
    """llama.cpp's nemotron_h metadata (Nemotron-H / Nano 2 as the converter writes it where transformers has no
    NemotronHConfig) and nemotron_h_moe's (Nemotron 3 Nano, a dense MLP block too): the blocks' kinds from head_count_kv
    and each block's tensors, grouped into table layers as from safetensors, the MLP width from ffn_up (a MoE file writes
    0 for it); an MTP block, latent experts, MLP blocks of different widths, a block of no kind refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf

    meta, tensors = _nemotron_h_gguf("M-MM-*", "nemotron_h")
    cfg = config_from_gguf(meta, True, False, "nh.gguf", tensors=tensors)
    assert cfg.architecture == "nemotron_h" and cfg.num_hidden_layers == 4 and [cfg.linear(i) for i in range(4)] == [True] * 3 + [False]
    assert cfg.layer_intermediate_sizes == [128, 0, 128, 0] and cfg.moe is None and cfg.nope_layers == [0, 1, 2, 3]
    assert (cfg.hybrid.num_v_heads, cfg.hybrid.v_dim, cfg.hybrid.num_k_heads, cfg.hybrid.k_dim, cfg.hybrid.conv_bias) == (8, 16, 2, 16, True)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.mlp_act, cfg.mlp_gated) == (2, 16, "relu2", False)
    meta, tensors = _nemotron_h_gguf("MEM-M*E", "nemotron_h_moe")
    moe = config_from_gguf(meta, True, False, "nano3.gguf", tensors=tensors).moe
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.shared_expert_size, moe.routed_scale, moe.dense_layers) == (8, 2, 32, 64, 2.5, (1, 2))
    assert config_from_gguf(meta, True, False, "nano3.gguf", tensors=tensors).layer(1).intermediate_size == 128
    for change, said in (({"nemotron_h_moe.nextn_predict_layers": 1}, "nano3.gguf: nemotron_h_moe.nextn_predict_layers 1"),
                         ({"nemotron_h_moe.moe_latent_size": 16}, "nano3.gguf: moe_latent_size 16"),
                         ({"blk.3.ffn_up.weight": None}, "nano3.gguf: block 3 has neither"),
                         ({"blk.3.ffn_up.weight": (96, 64), "blk.1.ffn_gate_inp.weight": None, "blk.1.ffn_up.weight": (128, 64)},
                          r"nano3.gguf: MLP blocks of widths \[96, 128\]")):
        names = {k: v for k, v in {**tensors, **{k: v for k, v in change.items() if k.startswith("blk.")}}.items() if v is not None}
        with pytest.raises(UnsupportedError, match=said) as info:
            config_from_gguf({**meta, **{k: v for k, v in change.items() if not k.startswith("blk.")}}, True, False, "nano3.gguf", tensors=names)
        assert "\n" not in str(info.value)


def test_jamba_gguf_metadata_and_refusals():
    """llama.cpp's jamba metadata as its converter writes it (no layer periods): attention where head_count_kv is not
    0, MoE where a layer has a router (ffn_gate_inp), both read back as transformers' period / offset; the Mamba-1 sizes
    from ssm.* (the dt rank as time_step_rank), the conv bias where the file has one, no attention layer at all; layer
    sets no period gives refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_gguf

    p = "jamba."
    meta = {"general.architecture": "jamba", p + "block_count": 8, p + "embedding_length": 64, p + "attention.head_count": 4,
            p + "attention.head_count_kv": [0, 0, 0, 2, 0, 0, 0, 2], p + "feed_forward_length": 32, p + "vocab_size": 256,
            p + "attention.layer_norm_rms_epsilon": 1e-6, p + "ssm.conv_kernel": 4, p + "ssm.inner_size": 128, p + "ssm.state_size": 16,
            p + "ssm.time_step_rank": 4, p + "expert_count": 4, p + "expert_used_count": 2}
    tensors = {**{f"blk.{i}.ssm_conv1d.bias": (128,) for i in (0, 1, 2, 4, 5, 6)}, **{f"blk.{i}.ffn_gate_inp.weight": (4, 64) for i in (1, 3, 5, 7)}}
    cfg = config_from_gguf(meta, True, False, "jamba.gguf", tensors=tensors)
    assert cfg.architecture == "jamba" and [i for i in range(8) if not cfg.linear(i)] == [3, 7] and cfg.nope_layers == list(range(8))
    hy = cfg.hybrid
    assert (hy.kind, hy.width, hy.k_dim, hy.dt_rank, hy.conv_kernel, hy.conv_bias, cfg.num_key_value_heads) == ("mamba1", 128, 16, 4, 4, True, 2)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_size, cfg.moe.norm_topk_prob, cfg.moe.dense_layers) == (4, 2, 32, False, (0, 2, 4, 6))
    one = config_from_gguf({**meta, p + "attention.head_count_kv": [0, 0, 0, 0, 0, 2, 0, 0]}, True, False, "jamba.gguf",
                           tensors={f"blk.{i}.ffn_gate_inp.weight": (4, 64) for i in (2,)})
    assert [i for i in range(8) if not one.linear(i)] == [5] and one.moe.dense_layers == (0, 1, 3, 4, 5, 6, 7) and not one.hybrid.conv_bias
    for kv, routers, said in (([0, 2, 0, 0, 2, 0, 0, 0], (1, 3, 5, 7), r"jamba.gguf: the attention layers \[1, 4\] are not every n-th"),
                              ([0, 0, 0, 2, 0, 0, 0, 2], (1, 3, 7), r"jamba.gguf: the expert layers \[1, 3, 7\] are not every n-th")):
        with pytest.raises(UnsupportedError, match=said) as info:
            config_from_gguf({**meta, p + "attention.head_count_kv": kv}, True, False, "jamba.gguf",
                             tensors={f"blk.{i}.ffn_gate_inp.weight": (4, 64) for i in routers})
        assert "\n" not in str(info.value)
    no_attention = config_from_gguf({**meta, p + "attention.head_count_kv": [0] * 8}, True, False, "jamba.gguf", tensors=tensors)
    assert no_attention.hybrid.attention_free and no_attention.moe.dense_layers == (0, 2, 4, 6)  # every layer Mamba-1: built
