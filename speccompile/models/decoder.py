"""Export-friendly Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3): the numerical reference.

It implements the verify-graph contract (docs/DESIGN.md, "The verify graph"): one forward serves
prefill and chain/tree verification. Inputs are `input_ids`, `position_ids`, a boolean `attention_mask` [batch, q_len,
past_len + q_len] and the past KV cache; outputs are logits at every position, the present KV cache
and optional hidden-state taps. Parameter names equal Hugging Face's, so HF state dicts load as is.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .altup import altup_layer, altup_merge, altup_projections, altup_streams, attach_altup, soft_token_embeds
from .module_roles import by_role
from .mla import LatentAttention
from .moe import SparseMoe, attach_beside_dense, beside_dense
from .config import HIDDEN_STATE_MODES, ModelConfig, eagle3_tap_layers  # noqa: F401 - re-exported
from .weights import WeightSource, describe_key_mismatch  # noqa: F401 - re-exported
from .trace_ops import static_reshape
from .rotary import RotaryEmbedding, apply_rope, bound_positions, query_scale, rotate_half  # noqa: F401 - re-exported
from .feed_forward import MLP, XIELU, activation, fused_linear  # noqa: F401 - re-exported
from .linear_attention import gated_output, split_output_gate
from .short_conv import mixer_name, recurrent_layer
from .normed_residual import normed_residual
from .per_layer import attach_per_layer_block, per_layer_block, per_layer_inputs, per_layer_modules
from .bitnet import act_quant
from .masks import attention_bias, chunk_mask, sliding_mask


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (or, `layer`, LayerNorm), computed in float32; the gain is `offset` + weight
    (Gemma: 1 + weight, added in float32 as the graphs' weight recipes do), then the bias if any (Phi-2)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0, layer: bool = False, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps, self.offset, self.layer = eps, offset, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        if self.layer:
            x32 = x32 - x32.mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = self.weight if not self.offset else (self.weight.float() + self.offset).to(self.weight.dtype)
        out = gain * x32.to(dtype)
        return out if self.bias is None else out + self.bias


def norm_of(config: ModelConfig, size: int | None = None) -> RMSNorm:
    """The family's norm over `size` (default: hidden_size)."""
    return RMSNorm(size or config.hidden_size, config.rms_norm_eps, config.norm_offset, config.norm == "layer", config.norm_bias)


class _TiedLMHead(torch.autograd.Function):
    """hidden @ embed.T whose ONNX form reads the embedding table itself (Gemm with transB=1).

    A plain Linear on a tied weight makes the exporter store a second, transposed copy of the table
    (113 MB for SmolLM2); this keeps one initializer shared by the Gather and the lm_head.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.matmul(hidden, table.t())

    @staticmethod
    def symbolic(g, hidden, table):  # noqa: D102
        rows = g.op("Reshape", hidden, g.op("Constant", value_t=torch.tensor([-1, _hidden_size(table)], dtype=torch.int64)))
        flat = g.op("Gemm", rows, table, transB_i=1)
        lead = g.op("Slice", g.op("Shape", hidden), g.op("Constant", value_t=torch.tensor([0])), g.op("Constant", value_t=torch.tensor([2])))
        shape = g.op("Concat", lead, g.op("Constant", value_t=torch.tensor([-1], dtype=torch.int64)), axis_i=0)
        return g.op("Reshape", flat, shape)


def _hidden_size(table) -> int:
    """Static width of the embedding table inside the exporter's graph."""
    sizes = table.type().sizes()
    return int(sizes[1])


class Attention(nn.Module):
    """Grouped-query attention over past + new keys with an explicit boolean mask."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.config, self.layer = config, layer
        shape = config.layer(layer)  # per-layer head_dim / kv heads (Gemma 4's full-attention layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = shape.num_key_value_heads
        self.head_dim = shape.head_dim
        bias = config.attention_bias
        own = config.kv_source(layer) is None  # KV sharing: no k/v projections (another layer's keys / values)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * (self.head_dim + shape.gate_dim), bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias) if own else None
        self.v_proj = None if config.values_are_keys(layer) or not own else nn.Linear(config.hidden_size, shape.kv_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attn_sinks else None  # gpt-oss
        self.attn_sub_norm = norm_of(config, self.num_heads * self.head_dim) if config.sub_norms else None  # BitNet
        if shape.qk_norm:  # Llama 4: rope layers only
            full = config.qk_norm_full
            self.q_norm = norm_of(config, self.num_heads * self.head_dim if full else self.head_dim)
            self.k_norm = norm_of(config, shape.kv_dim if full else self.head_dim) if own else None
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rotary: dict, biases: dict, past_k: torch.Tensor, past_v: torch.Tensor,
                shared: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rotary`: rope kind -> (cos, sin), and "query" -> Llama 4's query scaling if any (`query_scale`); `biases`:
        sliding? -> additive bias; `shared`: KV sharing, the pass's new key / value rows [b, kv, q, dim] (roped) of the
        layer whose keys this one takes: only the query is computed."""
        heads, kv_heads, dim, cfg = self.num_heads, self.num_kv_heads, self.head_dim, self.config
        x = act_quant(x) if cfg.act_quant else x  # BitNet's BitLinear inputs (models/bitnet.py)
        q, k, v, gate = self._qkv(x, rotary) if shared is None else (self._shared_q(x, rotary), *shared, None)
        if "query" in rotary and cfg.layer(self.layer).query_scale_beta:  # after rope and the q norms (Ministral 3 / Llama 4)
            q = q * rotary["query"]
        sliding = cfg.sliding(self.layer)
        bias = biases[(sliding, kv_heads)] if (sliding, kv_heads) in biases else biases[sliding]
        k_all = torch.cat((past_k, k), dim=2)
        v_all = torch.cat((past_v, v), dim=2)
        # [b, kv, groups*q, d]: the query heads of a group attend the same kv head without repeating KV;
        # `bias` is already tiled over the groups: [b, 1, groups*q, T].
        qg = static_reshape(q, 0, kv_heads, -1, dim)
        if heads == kv_heads:  # one query head per KV head: keep >= 2 rows in the attention matmuls
            qg, bias = _with_last_row(qg), _with_last_row(bias)
        scores = torch.matmul(qg, k_all.transpose(2, 3)).to(torch.float32) * cfg.scale
        if cfg.attn_softcap:
            scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        probs = torch.softmax(scores + bias, dim=-1) if self.sinks is None else self._with_sinks(scores + bias, q)
        probs = probs.to(v_all.dtype)
        context = torch.matmul(probs, v_all)
        if heads == kv_heads:
            context = context[:, :, :-1]
        out = static_reshape(context, 0, heads, -1, dim)
        out = static_reshape(out.transpose(1, 2), 0, -1, heads * dim)
        out = out if self.attn_sub_norm is None else self.attn_sub_norm(out)
        out = out if gate is None else gated_output(out, gate, heads)  # gated attention (Qwen3-Next, LFM3)
        return self.o_proj(act_quant(out) if cfg.act_quant else out), k_all, v_all

    def _qkv(self, x: torch.Tensor, rotary: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q, k, v [b, heads, q, dim] of `x`: projected, q/k norms (before rope, or after it), value norm, roped; the
        output gate [b, q, heads * dim] (gated attention: q_proj gives it) or None."""
        heads, kv_heads, dim, cfg = self.num_heads, self.num_kv_heads, self.head_dim, self.config
        if self.v_proj is None:  # values = the key projection (Gemma 4's attention_k_eq_v)
            q, k = fused_linear(x, (self.q_proj, self.k_proj))
            v = k
        else:
            q, k, v = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        q, gate = split_output_gate(q, heads, dim, cfg.layer(self.layer).gate_dim) if cfg.attn_output_gate else (q, None)
        if self.q_norm is not None and cfg.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = static_reshape(q, 0, -1, heads, dim)
        k = static_reshape(k, 0, -1, kv_heads, dim)
        v = static_reshape(v, 0, -1, kv_heads, dim)
        if self.q_norm is not None and not (cfg.qk_norm_full or cfg.qk_norm_after_rope):
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.v_norm:
            v = scale_free_norm(v, cfg.rms_norm_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kind = cfg.rope_kind(self.layer)
        if kind:
            q, k = (apply_rope(t, *rotary[kind], cfg.layer(self.layer)) for t in (q, k))  # the layer's head_dim
        if self.q_norm is not None and cfg.qk_norm_after_rope:  # Hunyuan: each roped head normalised
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def _shared_q(self, x: torch.Tensor, rotary: dict) -> torch.Tensor:
        """KV sharing: the roped query [b, heads, q, dim] alone (its per-head norm before rope: Gemma 4's layers)."""
        q = static_reshape(self.q_proj(x), 0, -1, self.num_heads, self.head_dim)
        q = (q if self.q_norm is None else self.q_norm(q)).transpose(1, 2)
        kind = self.config.rope_kind(self.layer)
        return apply_rope(q, *rotary[kind], self.config.layer(self.layer)) if kind else q

    def _with_sinks(self, scores: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Softmax over the scores [b, kv, rows, T] and each row's head sink logit, the sink column dropped after."""
        column = self.sinks.to(torch.float32).view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        column = column.reshape(q.shape[0], self.num_kv_heads, -1, 1)
        if self.num_heads == self.num_kv_heads:
            column = _with_last_row(column)
        return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def scale_free_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a gain over the last axis, in float32 (Gemma 4's value norm)."""
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _with_last_row(x: torch.Tensor) -> torch.Tensor:
    """`x` [b, h, rows, n] with a copy of its last row appended (dropped again after the attention matmuls).

    ONNX Runtime CPU multiplies a one-row matrix with MLAS's one-row SGEMM kernel, which sums in another order
    than the general kernel, so a plain-decoding pass (q = 1) would round a position differently from a verify
    pass. Grouped-query attention folds its query heads into the rows (groups x q >= 2); with one query head per
    KV head the rows are q, hence the copy: the real rows are then computed alike in every pass."""
    return torch.cat((x, x[:, :, -1:]), dim=2)


class DecoderLayer(nn.Module):
    """Attention and MLP blocks with the family's norms where its placement puts them (pre / sandwich / post /
    parallel / parallel2; module names: Llama's, plus post_attn_norm and post_mlp_norm)."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.config = config
        roles = config.layer_roles(layer)
        for role, name in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"),
                           ("post_attn_norm", "post_attn_norm"), ("post_mlp_norm", "post_mlp_norm")):
            setattr(self, name, norm_of(config) if role in roles else None)
        self.mixer = mixer_name(config.hybrid) if config.linear(layer) else "self_attn"  # a recurrent layer's cache: its states
        setattr(self, self.mixer, recurrent_layer(config.hidden_size, config.hybrid, config.rms_norm_eps, layer) if config.linear(layer)
                else LatentAttention(config, norm_of, layer) if config.mla else Attention(config, layer))
        if config.parallel_mixer(layer):  # Falcon-H1: a Mamba-2 mixer beside the attention, on the same normed input
            self.mamba = recurrent_layer(config.hidden_size, config.hybrid, config.rms_norm_eps)
        is_moe = config.moe is not None and config.moe.is_moe(layer)
        self.mlp_name = config.moe.block if is_moe else "mlp"  # Mixtral's MoE block is `block_sparse_moe`
        sparsity = config.activation_sparsity[layer] if config.activation_sparsity else 0.0  # Gemma 3n's Gaussian top-k
        self.has_mlp = config.has_mlp(layer)  # Nemotron-H: a mixer block with no MLP block after it
        if self.has_mlp:
            setattr(self, self.mlp_name, SparseMoe(config.hidden_size, config.moe.at_layer(layer)) if is_moe else MLP(config.layer(layer), sparsity))
        if config.sub_norms:  # BitNet: the norm of down_proj's input
            getattr(self, self.mlp_name).ffn_sub_norm = norm_of(config, config.layer(layer).intermediate_size)
        self.beside_dense = is_moe and config.moe.beside_dense
        if self.beside_dense:  # Gemma 4: the dense MLP beside the experts (models/moe.py)
            attach_beside_dense(self, config, layer, norm_of)
        self.factors = config.residual_factors[layer] if config.residual_factors else None  # MiniMax-01 (models/normed_residual.py)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalar else None  # Gemma 4: the output's multiplier
        if config.per_layer_input_size:  # Gemma 4's per-layer embeddings: the block after the MLP (models/per_layer.py)
            attach_per_layer_block(self, config, norm_of)
        if config.altup_inputs:  # Gemma 3n's AltUp streams and LAuReL (models/altup.py)
            attach_altup(self, config, norm_of)

    def _mlp(self, h: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP block on its normed input `h` (`x`: the residual stream, Gemma 4's experts' input)."""
        return beside_dense(self, self.mlp_name, h, x) if self.beside_dense else getattr(self, self.mlp_name)(h)

    def forward(self, x, rotary, biases, past_k, past_v, shared=None, per_layer=None, states=()):
        """`shared`: KV sharing, the new key / value rows this layer takes (Attention); `per_layer`: its per-layer
        input [b, q, P] (Gemma 4's PLE); Gemma 3n (AltUp): `x` is the streams [n, b, q, hidden] (models/altup.py);
        `states`: the parallel Mamba-2 mixer's (Falcon-H1), whose states per row follow the keys and values out."""
        if self.config.altup_inputs:
            return altup_layer(self, self.config, x, lambda h: self.self_attn(h, rotary, biases, past_k, past_v,
                                                                             *([shared] if shared is not None else [])), per_layer)
        out, presents = self._blocks(x, rotary, biases, past_k, past_v, shared, states)
        if per_layer is not None:
            out = per_layer_block(self, self.config, out, per_layer)
        return (out if self.layer_scalar is None else out * self.layer_scalar), *presents

    def _mixer(self, h, rotary, biases, past_k, past_v, shared=None, states=()):
        """The attention (or recurrent) block's output on the normed input `h` and its presents; a parallel Mamba-2
        mixer's output added (Falcon-H1: `states` its conv and SSM states, its states after each row presents too)."""
        attn, k_all, v_all = getattr(self, self.mixer)(h, rotary, biases, past_k, past_v, *([shared] if shared is not None else []))
        if not states:
            return attn, [k_all, v_all]
        ssm, convs, ssms = self.mamba(h, rotary, biases, *states)
        return attn + ssm, [k_all, v_all, convs, ssms]

    def _blocks(self, x, rotary, biases, past_k, past_v, shared=None, states=()):
        def norm(module, h):
            return h if module is None else module(h)

        scale = self.config.residual_scale
        h = norm(self.input_layernorm, x)
        attn, presents = self._mixer(h, rotary, biases, past_k, past_v, shared, states)
        if self.factors:  # MiniMax-01: the residuals are the normed inputs, scaled
            return normed_residual(self.factors, h, attn, self.post_attention_layernorm, self._mlp), presents
        if self.config.placement in ("parallel", "parallel2"):  # parallel2: the MLP on its own norm of x (GPT-NeoX)
            mlp = self._mlp(h if self.post_attention_layernorm is None else self.post_attention_layernorm(x))
            return x + attn * scale + mlp * scale if scale != 1.0 else x + attn + mlp, presents
        attn = norm(self.post_attn_norm, attn)
        x = x + (attn * scale if scale != 1.0 else attn)
        if not self.has_mlp:
            return x, presents
        out = norm(self.post_mlp_norm, self._mlp(norm(self.post_attention_layernorm, x), x))
        return x + (out * scale if scale != 1.0 else out), presents


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embeddings:  # learned absolute positions (GPT-2's wpe)
            self.embed_positions = nn.Embedding(config.position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm_of(config)
        self.rotary_emb = RotaryEmbedding(config)
        self.rotary_local = RotaryEmbedding(config, "local") if "local" in config.rope_kinds() else None
        if config.per_layer_input_size:  # Gemma 4's per-layer embeddings (models/per_layer.py)
            self.embed_tokens_per_layer, self.per_layer_model_projection, self.per_layer_projection_norm = \
                per_layer_modules(config, norm_of)
        if config.altup_inputs:  # Gemma 3n's projections into and out of the AltUp streams (models/altup.py)
            self.altup_projections, self.altup_unembed_projections = altup_projections(config)
        if config.soft_token_offset:  # Gemma 3n's wrapper: its image / audio tokens' table (models/soft_tokens.py)
            self.soft_token_embeds = nn.Embedding(config.vocab_size - config.soft_token_offset, config.hidden_size)


class Decoder(nn.Module):
    """Causal LM with the verify-graph interface. `hidden_states` selects extra outputs: none|final|eagle3."""

    def __init__(self, config: ModelConfig, hidden_states: str = "none", aux_layers: tuple[int, ...] | None = None):
        super().__init__()
        if hidden_states not in HIDDEN_STATE_MODES:
            raise ValueError(f"hidden_states must be one of {HIDDEN_STATE_MODES}")
        self.config = config
        self.hidden_mode = hidden_states
        self.aux_layers = tuple(aux_layers) if aux_layers else eagle3_tap_layers(config.num_hidden_layers)
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def output_names(self) -> list[str]:
        names = ["logits"]
        for i in range(self.config.num_hidden_layers):
            names += [f"present_state.{i}.conv", f"present_state.{i}.recurrent"] if self.config.linear(i) else [f"present.{i}.key", f"present.{i}.value"]
            names += [f"present_state.{i}.conv", f"present_state.{i}.recurrent"] if self.config.parallel_mixer(i) else []
        if self.hidden_mode == "final":
            names.append("hidden_states")
        elif self.hidden_mode == "eagle3":
            names.append("aux_hidden_states")
        return names

    @property
    def input_names(self) -> list[str]:
        names = ["input_ids", "position_ids", "attention_mask"]
        for i in range(self.config.num_hidden_layers):
            names += [f"past_state.{i}.conv", f"past_state.{i}.recurrent"] if self.config.linear(i) else \
                [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
            names += [f"past_state.{i}.conv", f"past_state.{i}.recurrent"] if self.config.parallel_mixer(i) else []
        return names

    def forward(self, input_ids, position_ids, attention_mask, *past_key_values):
        """Run the decoder; `past_key_values` is the flat list (k0, v0, k1, v1, ...; a parallel mixer's conv and SSM
        states after its layer's k, v)."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        dtype = x.dtype
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=dtype)
        if cfg.position_embeddings:  # the table's row of each position (OPT: position + 2)
            x = x + self.model.embed_positions(position_ids + cfg.position_offset if cfg.position_offset else position_ids)
        if cfg.embed_norm:  # nanochat: the final norm of the embeddings too
            x = self.model.norm(x)
        rotary = {"global": self.model.rotary_emb(position_ids, dtype), "positions": position_ids}  # positions: RG-LRU's reset
        if self.model.rotary_local is not None:
            rotary["local"] = self.model.rotary_local(position_ids, dtype)
        if cfg.query_scale_beta:
            rotary["query"] = query_scale(cfg, position_ids, dtype)
        masks = {False: attention_mask}
        if cfg.layer_types:
            masks[True] = (chunk_mask if cfg.window_chunks else sliding_mask)(attention_mask, position_ids, cfg.sliding_window)
        biases = {sliding: attention_bias(mask, cfg.num_attention_heads, cfg.num_key_value_heads) for sliding, mask in masks.items()}
        for i in range(cfg.num_hidden_layers):  # layers with kv heads of their own: a bias tiled for their groups
            kv, sliding = cfg.layer(i).num_key_value_heads, cfg.sliding(i)
            if kv != cfg.num_key_value_heads and (sliding, kv) not in biases:
                biases[(sliding, kv)] = attention_bias(masks[sliding], cfg.num_attention_heads, kv)
        presents, taps, new_rows = [], [], {}  # new_rows: KV sharing, a layer's pass's new key / value rows
        x = soft_token_embeds(self.model, cfg, input_ids, x) if cfg.soft_token_offset else x
        per_layer = per_layer_inputs(self.model, cfg, input_ids, x) if cfg.per_layer_input_size else None
        x = altup_streams(self.model.altup_projections, x) if cfg.altup_inputs else x  # Gemma 3n: x the streams
        at = 0  # the layer's first cache tensor
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_layers:
                taps.append(x[0] if cfg.altup_inputs else x)
            past, width = past_key_values[at].shape[2], 4 if cfg.parallel_mixer(i) else 2
            x, k_all, v_all, *states = layer(x, rotary, biases, past_key_values[at], past_key_values[at + 1], new_rows.get(cfg.kv_source(i)),
                                             None if per_layer is None else per_layer[:, :, i], past_key_values[at + 2:at + width])
            if cfg.kv_sources:
                new_rows[i] = (k_all[:, :, past:], v_all[:, :, past:])
            presents += [k_all, v_all, *states]
            at += width
        x = altup_merge(self.model.altup_unembed_projections, x) if cfg.altup_inputs else x
        if self.config.num_hidden_layers in self.aux_layers:  # tap L: the final hidden state before the norm
            taps.append(x)
        hidden = self.model.norm(x)
        if self.config.tie_word_embeddings:
            logits = _TiedLMHead.apply(hidden, self.model.embed_tokens.weight).to(torch.float32)
        else:
            logits = self.lm_head(hidden).to(torch.float32)
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        outputs = [logits, *presents]
        if self.hidden_mode == "final":
            outputs.append(hidden)
        elif self.hidden_mode == "eagle3":
            outputs.append(torch.cat(taps, dim=-1))
        return tuple(outputs)

    def empty_past(self, batch: int = 1, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """A zero-length KV cache for prefill (a gated delta net layer: its zero states)."""
        dtype = dtype or self.lm_head.weight.dtype
        layers = [(self.config.layer(i), layer, self.config.linear(i), self.config.parallel_mixer(i)) for i, layer in enumerate(self.model.layers)]
        return [t for c, layer, linear, both in layers for t in (getattr(layer, layer.mixer).empty_states(batch, dtype) if linear else  # states
                [*(torch.zeros((batch, c.num_key_value_heads, 0, c.head_dim), dtype=dtype) for _ in "kv"),
                 *(layer.mamba.empty_states(batch, dtype) if both else [])])]  # Falcon-H1: the parallel mixer's states


def build_decoder(config: ModelConfig, weights: "Mapping[str, torch.Tensor] | WeightSource", hidden_states: str = "none",
                  aux_layers: tuple[int, ...] | None = None) -> Decoder:
    """Instantiate a Decoder and load the checkpoint's weights (torch tensors, or a WeightSource: read whole into
    memory) by role (models/architectures.py: the family's names, fused tensors split); `aux_layers`: the EAGLE-3
    taps to return (default `eagle3_tap_layers`); missing or unexpected keys are an error."""
    from ..errors import InputError

    if isinstance(weights, WeightSource):
        weights = weights.to_torch()
    model = Decoder(config, hidden_states, aux_layers)
    state = {k: v for k, v in by_role(config, weights).items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise InputError(f"weights do not match the {config.architecture} architecture ({describe_key_mismatch(missing, unexpected)})")
    return model.eval()


def causal_mask(q_len: int, past_len: int, batch: int = 1) -> torch.Tensor:
    """Boolean causal mask [batch, q_len, past_len + q_len]."""
    full = torch.ones(q_len, past_len + q_len, dtype=torch.bool).tril(diagonal=past_len)
    return full.unsqueeze(0).expand(batch, -1, -1)
