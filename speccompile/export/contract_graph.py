"""The contract graph (`target.onnx`), built node by node from the checkpoint without tracing torch.

It computes what `models.decoder.Decoder.forward` computes, operator for operator (the torch decoder stays
the numerical reference: tests compare the two), with the interface of docs/DESIGN.md "The verify graph":
inputs `input_ids`, `position_ids` [batch, q_len], a boolean `attention_mask` [batch, q_len, total_len] and
`past_key_values.{i}.key/value` [batch, kv_heads, past_len, head_dim]; outputs float32 `logits`
[batch, q_len, vocab], `present.{i}.key/value` [batch, kv_heads, total_len, head_dim] and, by
`hidden_states`, the final norm's output or the EAGLE-3 taps.

Why build instead of trace: tracing holds the whole model in torch plus a whole ONNX proto in memory, and a
protobuf cannot exceed 2 GiB. Here one function emits a layer's nodes and is called once per layer; each
weight goes from the memory-mapped checkpoint to the external data file as it is needed (`WeightStore`),
so memory is bounded by the largest tensor. Node names, operators and initializer names are those the
traced graph had (`/layers.3/self_attn/MatMul`, `layers.3.self_attn.weight_t`, ...), which the build passes
(engines/), TensorRT checks and reports rely on. Two deliberate differences: every weight is its own
initializer (the tracer merged equal tensors, e.g. all-ones norm gains, behind Identity nodes), and the
attention bias is tiled by one Tile (the tracer added a no-op Expand before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto

from ..models.config import ModelConfig
from ..models.rope import long_rope_start, rope_attention_factor, rounded_inv_freq
from .activations import activation
from .altup_ops import LayerParts, active_stream, altup_layer, altup_merge, altup_streams, gaussian_topk, soft_tokens
from .bitnet_ops import act_quant
from .contract_head import lm_head, outputs, softcap
from .graph_builder import GraphBuilder, value
from .normed_residual_ops import normed_residual_nodes
from .linear_ops import gated, gated_qkv, linear_layer, parallel_mixer, present_names, state_values
from .mla_ops import absorbed, absorbed_query, latent_inputs, latent_output, latent_scores
from .moe_ops import Emitter, beside_dense, moe_block, moe_names
from .per_layer_ops import per_layer_block, per_layer_inputs
from .query_scale import query_scale
from .rope_ops import rope
from .chunk_ops import before_chunk
from .recipes import (EMBED, LM_HEAD, POSITIONS, ELEM, DecoderWeights, Recipe, altup_recipes, final_norm_recipe, layer_recipe, layer_roles,
                      np_dtype, per_layer_recipes, position_recipes, top_bias_recipes)
from .weight_store import WeightStore

OPSET = 21
_FLOAT_MIN = float(-3.4028234663852886e38)  # torch.finfo(torch.float32).min: the mask's "may not attend"


_ROLE_NAMES = {  # the traced graph's initializer names of the Llama roles; other roles: layers.{i}.{role}
    "input_norm": "model.layers.{i}.input_layernorm.weight", "qkv": "layers.{i}.self_attn.weight_t",
    "o_proj": "layers.{i}.self_attn.o_proj.weight_t", "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate_up": "layers.{i}.mlp.weight_t", "down": "layers.{i}.mlp.down_proj.weight_t", "qkv_bias": "layers.{i}.self_attn.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}


def role_name(i: int, role: str) -> str:
    """The contract graph's initializer name of layer i's `role` weight."""
    return _ROLE_NAMES.get(role, "layers.{i}.%s" % role).format(i=i)


def contract_names(model: DecoderWeights, dtype: str) -> dict[str, Recipe]:
    """Initializer name -> recipe, for every weight of the contract graph (the names the traced graph had)."""
    cfg = model.config
    names = {"model.embed_tokens.weight": Recipe(EMBED, False, dtype), "model.norm.weight": final_norm_recipe(cfg, dtype)}
    if not model.tied:
        names["lm_head.weight_t"] = Recipe(LM_HEAD, True, dtype)
    names.update({**top_bias_recipes(cfg, dtype), **per_layer_recipes(cfg, dtype), **position_recipes(cfg, dtype), **altup_recipes(cfg, dtype)})
    for i in range(cfg.num_hidden_layers):
        names.update({role_name(i, role): layer_recipe(cfg, i, role, dtype) for role in layer_roles(cfg, i)})
        if cfg.moe is not None and cfg.moe.is_moe(i):
            names.update(moe_names(cfg, i, dtype))
    return names


@dataclass
class _Graph:
    """What every part of the graph reads: the node writer, the weights and the shared per-pass tensors."""

    b: GraphBuilder
    store: WeightStore
    model: DecoderWeights
    dtype: str
    recipes: dict[str, Recipe]
    rotary: dict[str, tuple[str, str]] = field(default_factory=dict)  # rope kind -> (cos, sin)
    biases: dict[tuple, str] = field(default_factory=dict)  # (sliding?, kv heads) -> the tiled bias
    padded: dict[tuple, str] = field(default_factory=dict)  # the biases with their last row repeated (made once)
    new_rows: dict[int, tuple[str, str]] = field(default_factory=dict)  # layer -> its pass's roped k / v (KV sharing)
    per_layer: str = ""  # every layer's per-layer input [b, q, layers, P] (PLE)
    query_scale: str = ""  # Llama 4's query scaling [b, 1, q, 1] (export/query_scale.py), or none
    gates: dict[int, str] = field(default_factory=dict)  # layer -> its attention output gate (gated attention)

    @property
    def elem(self) -> int:
        return ELEM[self.dtype]

    def weight(self, name: str) -> str:
        return self.b.initializer(self.store.tensor(name, self.recipes[name]))

    def role(self, i: int, role: str) -> str:
        return self.weight(role_name(i, role))

    def weight_of(self, name: str, recipe: Recipe) -> str:
        return self.b.initializer(self.store.tensor(name, recipe))

    def emitter(self, scope: str) -> Emitter:
        """The node writer of export/moe_ops.py / export/mla_ops.py, its nodes under `scope`."""
        b = self.b
        return Emitter(lambda op, inputs, outputs=1, **attrs: b.op(scope, op, inputs, outputs, **attrs),
                       lambda key, values, dtype=np.int64: b.const(scope, values, dtype), self.weight_of, self.elem, self.dtype)


def build_contract_graph(model: DecoderWeights, store: WeightStore, dtype: str, layers: int | None = None) -> onnx.ModelProto:
    """The contract graph of `model` in `dtype`, its weights through `store`. `layers`: only the first that many
    decoder layers (a probe of the full graph for the ONNX Runtime load check), the head included."""
    cfg = model.config
    count = cfg.num_hidden_layers if layers is None else layers
    g = _Graph(GraphBuilder(), store, model, dtype, contract_names(model, dtype))
    b = g.b
    x = b.one("/embed_tokens", "Gather", [g.weight("model.embed_tokens.weight"), "input_ids"])
    if cfg.embed_scale != 1.0:
        x = b.one("/embed_tokens", "Mul", [x, b.const("/embed_tokens", cfg.embed_scale, np_dtype(dtype))])
    if cfg.position_embeddings:  # learned absolute positions: the table's row of each position_ids entry
        rows = b.one("/embed_positions", "Add", ["position_ids", b.const("/embed_positions", [cfg.position_offset], np.int64)]) \
            if cfg.position_offset else "position_ids"
        x = b.one("/embed_positions", "Add", [x, b.one("/embed_positions", "Gather", [g.weight(POSITIONS[0]), rows])])
    x = soft_tokens(g.emitter("/soft_tokens"), cfg, x) if cfg.soft_token_offset else x  # Gemma 3n's image / audio tokens
    if cfg.embed_norm:  # nanochat: the final norm of the embeddings too
        x = _norm(g, "/embed_norm", x, "model.norm.weight")
    if cfg.per_layer_input_size:  # Gemma 4's per-layer embeddings (export/per_layer_ops.py)
        g.per_layer = per_layer_inputs(g.emitter("/per_layer"), cfg, x, lambda h, gain: _norm(g, "/per_layer_projection_norm", h, gain))
    x = altup_streams(g.emitter("/altup"), cfg, x) if cfg.altup_inputs else x  # Gemma 3n: x the streams (export/altup_ops.py)
    g.rotary = {kind: _rotary(g, kind) for kind in cfg.rope_kinds()}
    g.query_scale = query_scale(g.emitter("/query_scale"), cfg, "position_ids", [1, 3]) if cfg.query_scale_beta else ""
    keys = sorted({(cfg.sliding(i), cfg.layer(i).num_key_value_heads) for i in range(count) if not cfg.linear(i)})  # (none: attention_mask unread)
    g.biases = {key: _attention_bias(g, *key) for key in keys}
    taps, presents = [], []
    for i in range(count):
        if i in model.aux_layers:
            taps.append(active_stream(g.emitter("/altup"), x) if cfg.altup_inputs else x)
        x = _layer(g, i, x)
        presents += present_names(cfg, i)
    x = altup_merge(g.emitter("/altup"), cfg, x) if cfg.altup_inputs else x
    if count == cfg.num_hidden_layers and count in model.aux_layers:  # tap L: the final hidden state before the norm
        taps.append(x)
    final = _norm(g, "/norm", x, "model.norm.weight", "hidden_states" if model.hidden_states == "final" else None,
                  "model.norm.bias" if cfg.norm_bias else None)
    lm_head(b, model, g.weight, final)
    graph_outputs = outputs(model, g.elem, presents, len(taps))
    if model.hidden_states == "eagle3":
        b.one("", "Concat", taps, "aux_hidden_states", axis=-1)
    inputs = [value("input_ids", TensorProto.INT64, ["batch", "q_len"]),
              value("position_ids", TensorProto.INT64, ["batch", "q_len"]),
              value("attention_mask", TensorProto.BOOL, ["batch", "q_len", "total_len"])]
    for i in range(count):
        inputs += state_values(cfg, i, g.elem, past=True) if cfg.linear(i) else [value(f"past_key_values.{i}.{kind}", g.elem, ["batch", cfg.layer(i).num_key_value_heads, "past_len", cfg.layer(i).head_dim])
                   for kind in ("key", "value")] + (state_values(cfg, i, g.elem, past=True) if cfg.parallel_mixer(i) else [])
    return b.model("main_graph", inputs, graph_outputs, {"": OPSET})


def _rotary(g: _Graph, kind: str) -> tuple[str, str]:
    """cos/sin [b, 1, q, rope_dim] of the positions for rotary table `kind`, in the model dtype (RotaryEmbedding)."""
    b, s = g.b, "/rotary_emb" if kind == "global" else f"/rotary_emb_{kind}"
    cfg = g.model.config
    positions = b.one(s, "Cast", ["position_ids"], to=TensorProto.FLOAT)
    positions = b.one(s, "Unsqueeze", [positions, b.const(s, [-1])])
    inv_freq = rounded_inv_freq(cfg, np_dtype(g.dtype), kind)
    freqs = b.one(s, "Mul", [positions, b.const(s, inv_freq, inv_freq.dtype)])
    start = long_rope_start(cfg, kind, g.model.max_context)
    if start is not None:  # longrope: rows at positions >= start take the long set (models/rope.py)
        long = rounded_inv_freq(cfg, np_dtype(g.dtype), kind, long=True)
        short = b.one(s, "Unsqueeze", [b.one(s, "Less", ["position_ids", b.const(s, start)]), b.const(s, [-1])])
        freqs = b.one(s, "Where", [short, freqs, b.one(s, "Mul", [positions, b.const(s, long, long.dtype)])])
    if cfg.rope_interleaved:  # each frequency twice in a row: [f0, f0, f1, f1, ...]
        emb = b.one(s, "Reshape", [b.one(s, "Concat", [b.one(s, "Unsqueeze", [freqs, b.const(s, [-1])])] * 2, axis=-1),
                                   b.const(s, [0, 0, -1])])
    else:
        emb = b.one(s, "Concat", [freqs, freqs], axis=-1)
    emb = b.one(s, "Unsqueeze", [emb, b.const(s, [1])])
    factor = rope_attention_factor(cfg, kind)

    def table(op: str) -> str:  # nanochat's rope turned the other way: sin negated
        t = b.one(s, "Neg", [b.one(s, op, [emb])]) if op == "Sin" and cfg.rope_reversed else b.one(s, op, [emb])
        return b.one(s, "Cast", [t if factor == 1.0 else b.one(s, "Mul", [t, b.const(s, factor, "float32")])], to=g.elem)

    return table("Cos"), table("Sin")


def _attention_bias(g: _Graph, sliding: bool, kv_heads: int) -> str:
    """The boolean mask as an additive float32 bias [b, 1, groups*q, T], tiled over the query groups once (a
    layer whose kv heads are not the model's: a bias of its own, scope suffixed by them). A
    sliding layer's bias also masks the key slots j with position - j >= sliding_window (the KV contract: slot j
    holds position j for every past key; a pass's own keys sit at or after their positions)."""
    b = g.b
    cfg = g.model.config
    mask = "attention_mask"
    s = ("/sliding" if sliding else "") + ("" if kv_heads == cfg.num_key_value_heads else f"/kv{kv_heads}")
    if sliding and cfg.window_chunks:  # Llama 4's chunks (export/chunk_ops.py)
        mask = b.one(s, "And", [mask, b.one(s, "Not", [before_chunk(g.emitter(s), mask, "position_ids", cfg.sliding_window)])])
    elif sliding:
        slots = b.one(s, "Range", [b.const(s, 0), b.one(s, "Squeeze", [b.one(s, "Shape", [mask], start=2, end=3)]), b.const(s, 1)])
        distance = b.one(s, "Sub", [b.one(s, "Unsqueeze", ["position_ids", b.const(s, [-1])]), slots])
        mask = b.one(s, "And", [mask, b.one(s, "Less", [distance, b.const(s, cfg.sliding_window)])])
    bias = b.one(s, "Where", [mask, b.const(s, 0.0, "float32"), b.const(s, _FLOAT_MIN, "float32")])
    bias = b.one(s, "Unsqueeze", [bias, b.const(s, [1])])
    groups = cfg.num_attention_heads // kv_heads
    return b.one(s, "Tile", [bias, b.const(s, [1, 1, groups, 1])]) if groups > 1 else bias


def _norm(g: _Graph, scope: str, x: str, weight: str | None, output: str | None = None, bias: str | None = None) -> str:
    """The family's norm in float32, rounded to the model dtype before the gain (`weight` None: no gain, Gemma 4's
    value norm), then the bias if any (models.decoder.RMSNorm / LayerNorm)."""
    b = g.b
    cfg = g.model.config
    wide = b.one(scope, "Cast", [x], to=TensorProto.FLOAT)
    if cfg.norm == "layer":
        wide = b.one(scope, "Sub", [wide, b.one(scope, "ReduceMean", [wide, b.const(scope, [-1])], keepdims=1)])
    square = b.one(scope, "Pow", [wide, b.const(scope, 2.0, "float32")])
    mean = b.one(scope, "ReduceMean", [square, b.const(scope, [-1])], keepdims=1)
    root = b.one(scope, "Sqrt", [b.one(scope, "Add", [mean, b.const(scope, cfg.rms_norm_eps, "float32")])])
    inverse = b.one(scope, "Div", [b.const(scope, 1.0, "float32"), root])
    normed = b.one(scope, "Cast", [b.one(scope, "Mul", [wide, inverse])], to=g.elem)
    if weight is None:
        return normed
    if bias is None:
        return b.one(scope, "Mul", [g.weight(weight), normed], output)
    return b.one(scope, "Add", [b.one(scope, "Mul", [g.weight(weight), normed]), g.weight(bias)], output)


def _layer(g: _Graph, i: int, x: str) -> str:
    """Decoder layer i: attention and MLP blocks with their norms (by placement) and residual adds; returns the
    residual stream."""
    b, scope, cfg = g.b, f"/layers.{i}", g.model.config
    names = {role: role_name(i, role) for role in layer_roles(cfg, i)}

    def norm(role: str, h: str) -> str:
        return _norm(g, f"{scope}/{'post_attention_layernorm' if role == 'post_norm' else role.replace('input_norm', 'input_layernorm')}",
                     h, names[role], bias=names.get(f"{role}_bias")) if role in names else h

    def add(x: str, h: str) -> str:
        if cfg.residual_scale != 1.0:
            h = b.one(scope, "Mul", [h, b.const(scope, cfg.residual_scale, np_dtype(g.dtype))])
        return b.one(scope, "Add", [x, h])

    if cfg.altup_inputs:  # Gemma 3n: the layer on AltUp's streams (export/altup_ops.py)
        return altup_layer(g.emitter(f"{scope}/altup"), cfg, i, x, LayerParts(lambda h: _attention(g, i, h), lambda h: _mlp(g, i, h),
                                                                              norm, lambda role: g.role(i, role)), g.per_layer)
    if cfg.placement in ("parallel", "parallel2"):  # parallel2: the MLP on its own norm of x (GPT-NeoX)
        h = norm("input_norm", x)
        return add(add(x, _attention(g, i, h)), _mlp(g, i, norm("post_norm", x) if "post_norm" in names else h))
    mixer = (lambda h: linear_layer(g.emitter(f"{scope}/linear_attn"), cfg, i, h, lambda role: g.role(i, role))) if cfg.linear(i) \
        else (lambda h: parallel_mixer(g.emitter(f"{scope}/mamba"), cfg, i, h, _attention(g, i, h), lambda role: g.role(i, role)))
    if cfg.residual_factors:  # MiniMax-01: the residuals are the normed inputs, scaled (export/normed_residual_ops.py)
        h = norm("input_norm", x)
        return b.one(scope, "Add", list(normed_residual_nodes(g.emitter(scope), cfg.residual_factors[i], h, mixer(h),
                                                              lambda t, u: norm("post_norm", b.one(scope, "Add", [t, u])), lambda t: _mlp(g, i, t))))
    x = add(x, norm("post_attn_norm", mixer(norm("input_norm", x))))
    if cfg.has_mlp(i):  # Nemotron-H: a layer may be its mixer alone
        x = add(x, norm("post_mlp_norm", _mlp(g, i, norm("post_norm", x), x, norm)))
    if cfg.per_layer_input_size:
        x = per_layer_block(g.emitter(f"{scope}/per_layer"), cfg, i, x, g.per_layer, lambda role: g.role(i, role),
                            lambda h: norm("ple_norm", h))
    return b.one(scope, "Mul", [x, g.role(i, "layer_scalar")]) if cfg.layer_scalar else x


def _mlp(g: _Graph, i: int, h: str, x: str = "", norm: Callable[[str, str], str] | None = None) -> str:
    """down(act(gate) * up), gate and up from one MatMul (act: `_act`); or the layer's mixture of
    experts (export/moe_ops.py; Gemma 4's beside the dense MLP: on the residual `x`, `norm(role, t)` its norms)."""
    scope, moe = f"/layers.{i}/mlp", g.model.config.moe
    if moe is not None and moe.is_moe(i) and moe.beside_dense:
        return beside_dense(g.emitter(scope), g.model.config, i, h, x, lambda t: _dense_mlp(g, i, t), norm)
    if moe is not None and moe.is_moe(i):
        return moe_block(g.emitter(scope), g.model.config, i, h)
    return _dense_mlp(g, i, h)


def _dense_mlp(g: _Graph, i: int, h: str) -> str:
    """Layer i's dense MLP: gated, or plain (`_plain_mlp`)."""
    b, scope = g.b, f"/layers.{i}/mlp"
    if not g.model.config.mlp_gated:
        return _plain_mlp(g, i, h, scope)
    inter = g.model.config.layer(i).intermediate_size  # its own (KV sharing's double-wide MLP)
    both = b.one(scope, "MatMul", [_projected(g, i, "", h, scope), g.role(i, "gate_up")])
    both = b.one(scope, "Add", [both, g.role(i, "gate_up_bias")]) if g.model.config.mlp_bias else both  # RecurrentGemma
    gate, up = b.op(scope, "Split", [both, b.const(scope, [inter, inter])], 2, axis=-1)
    if g.model.config.activation_sparsity and g.model.config.activation_sparsity[i]:  # Gemma 3n's Gaussian top-k
        gate = gaussian_topk(g.emitter(scope), gate, g.model.config.activation_sparsity[i])
    act = _projected(g, i, "ffn_sub_norm", b.one(scope, "Mul", [_act(g, i, gate, scope), up]), scope)
    out = b.one(f"{scope}/down_proj", "MatMul", [act, g.role(i, "down")])
    return b.one(f"{scope}/down_proj", "Add", [out, g.role(i, "down_bias")]) if g.model.config.mlp_bias else out


def _act(g: _Graph, i: int, x: str, scope: str) -> str:
    """Layer i's MLP activation (export/activations.py; xIELU's scalars: the `act` role)."""
    kind = g.model.config.mlp_act
    return activation(g.emitter(scope), kind, x, g.role(i, "act") if kind == "xielu" else None)


def _plain_mlp(g: _Graph, i: int, h: str, scope: str) -> str:
    """down(act(up h + up_bias)) + down_bias (Phi-2's fc1 / fc2; biases when the family has them)."""
    b, cfg = g.b, g.model.config
    up = b.one(scope, "MatMul", [h, g.role(i, "up")])
    if cfg.mlp_bias:
        up = b.one(scope, "Add", [up, g.role(i, "up_bias")])
    out = b.one(f"{scope}/down_proj", "MatMul", [_act(g, i, up, scope), g.role(i, "down")])
    return b.one(f"{scope}/down_proj", "Add", [out, g.role(i, "down_bias")]) if cfg.mlp_bias else out


def _qkv(g: _Graph, i: int, h: str, s: str) -> tuple[str, str, str]:
    """q, k, v [b, heads, q, dim] of layer i: biases, q/k norms and rope applied (the norms before rope, or after it:
    `qk_norm_after_rope`)."""
    b, cfg = g.b, g.model.config.layer(i)
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = b.one(s, "MatMul", [h, g.role(i, "qkv")])
    if cfg.attention_bias:
        qkv = b.one(s, "Add", [g.role(i, "qkv_bias"), qkv])
    if cfg.attn_output_gate:  # gated attention: q rows doubled (per head q, gate), the gate kept for the output
        q, g.gates[i], k, v = gated_qkv(g.emitter(s), "", qkv, heads, kv_heads, dim, cfg.gate_dim)
    elif cfg.values_are_keys(i):  # q | k rows: the values are the keys before their norm (Gemma 4's attention_k_eq_v)
        q, k = b.op(s, "Split", [qkv, b.const(s, [heads * dim, kv_heads * dim])], 2, axis=-1)
        v = k
    else:
        q, k, v = b.op(s, "Split", [qkv, b.const(s, [heads * dim, kv_heads * dim, kv_heads * dim])], 3, axis=-1)
    bias = {t: role_name(i, f"{t}_bias") if cfg.norm_bias else None for t in ("q_norm", "k_norm")}  # Phi-2's LayerNorms
    if cfg.qk_norm_full:
        q = _norm(g, f"{s}/q_norm", q, role_name(i, "q_norm"), bias=bias["q_norm"])
        k = _norm(g, f"{s}/k_norm", k, role_name(i, "k_norm"), bias=bias["k_norm"])
    q = b.one(s, "Reshape", [q, b.const(s, [0, -1, heads, dim])])
    k = b.one(s, "Reshape", [k, b.const(s, [0, -1, kv_heads, dim])])
    v = b.one(s, "Reshape", [v, b.const(s, [0, -1, kv_heads, dim])])
    if cfg.qk_norm and not (cfg.qk_norm_full or cfg.qk_norm_after_rope):
        q = _norm(g, f"{s}/q_norm", q, role_name(i, "q_norm"), bias=bias["q_norm"])
        k = _norm(g, f"{s}/k_norm", k, role_name(i, "k_norm"), bias=bias["k_norm"])
    if cfg.v_norm:
        v = _norm(g, f"{s}/v_norm", v, None)
    q, k, v = (b.one(s, "Transpose", [t], perm=[0, 2, 1, 3]) for t in (q, k, v))
    kind = cfg.rope_kind(i)
    if kind:
        q, k = _rope(g, s, q, kind, cfg), _rope(g, s, k, kind, cfg)
    if cfg.qk_norm and cfg.qk_norm_after_rope:  # Hunyuan: each roped head [b, heads, q, dim] normalised
        q = _norm(g, f"{s}/q_norm", q, role_name(i, "q_norm"), bias=bias["q_norm"])
        k = _norm(g, f"{s}/k_norm", k, role_name(i, "k_norm"), bias=bias["k_norm"])
    return q, k, v


def _shared_qkv(g: _Graph, i: int, h: str, s: str) -> tuple[str, str, str]:
    """KV sharing: layer i's q (q_proj, its per-head norm before rope: Gemma 4's layers; roped) and, as its own new
    keys / values, the pass's roped k / v rows of the layer it shares them with (the same rope table: the same type)."""
    b, cfg = g.b, g.model.config.layer(i)
    q = b.one(s, "MatMul", [h, g.role(i, "qkv")])
    if cfg.attention_bias:
        q = b.one(s, "Add", [g.role(i, "qkv_bias"), q])
    q = b.one(s, "Reshape", [q, b.const(s, [0, -1, cfg.num_attention_heads, cfg.head_dim])])
    if cfg.qk_norm:
        q = _norm(g, f"{s}/q_norm", q, role_name(i, "q_norm"))
    q, kind = b.one(s, "Transpose", [q], perm=[0, 2, 1, 3]), cfg.rope_kind(i)
    return (_rope(g, s, q, kind, cfg) if kind else q), *g.new_rows[cfg.kv_source(i)]


def _latent_qkv(g: _Graph, i: int, h: str, s: str, w_uk: str) -> tuple[str, str, str]:
    """Multi-head latent attention's query [b, heads, q, dim] and key [b, 1, q, dim] (export/mla_ops.py; `w_uk`:
    kv_b_proj's per-head key slices), roped (unless the layer is NoPE); the key is also the value."""
    em, cfg = g.emitter(s), g.model.config

    def norm(x: str, role: str) -> str:
        return _norm(g, f"{s}/{role}", x, role_name(i, role))

    q, key = latent_inputs(em, cfg, i, h, norm, g.gates)
    query = g.b.one(s, "Transpose", [absorbed_query(em, cfg, q, w_uk)], perm=[0, 2, 1, 3])
    key = g.b.one(s, "Unsqueeze", [key, g.b.const(s, [1])])
    if not cfg.rope_kind(i):  # Kimi Linear: no rope
        return query, key, key
    key = _rope(g, s, key, "global")
    return _rope(g, s, query, "global"), key, key


def _attention(g: _Graph, i: int, h: str) -> str:
    """Grouped-query attention of layer i over past + new keys (models.decoder.Attention); writes present.{i}.*."""
    b, s = g.b, f"/layers.{i}/self_attn"
    cfg = g.model.config.layer(i)
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    w_uk, w_uv = absorbed(g.emitter(s), cfg, i) if cfg.mla else ("", "")  # kv_b_proj's per-head slices
    h = _projected(g, i, "", h, s)
    q, k, v = _latent_qkv(g, i, h, s, w_uk) if cfg.mla else _qkv(g, i, h, s) if cfg.kv_source(i) is None else _shared_qkv(g, i, h, s)
    if g.query_scale and cfg.query_scale_beta:  # after rope and the q norms (Llama 4: NoPE layers only)
        q = b.one(s, "Mul", [q, g.query_scale])
    g.new_rows[i] = (k, v)
    k_all = b.one(s, "Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
    v_all = b.one(s, "Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
    qg = b.one(s, "Reshape", [q, b.const(s, [0, kv_heads, -1, dim])])
    key = (cfg.sliding(i), kv_heads)
    bias = g.biases[key]
    if heads == kv_heads:  # one query head per KV head: keep >= 2 rows in the attention matmuls (with_last_row)
        qg = g.b.with_last_row(s, qg)
        g.padded[key] = bias = g.padded.get(key) or g.b.with_last_row(s, bias)  # once, as the tracer merged it
    scores = latent_scores(g.emitter(s), cfg, qg, b.one(s, "Transpose", [k_all], perm=[0, 1, 3, 2]))
    scores = b.one(s, "Mul", [b.one(s, "Cast", [scores], to=TensorProto.FLOAT), b.const(s, cfg.scale, "float32")])
    if cfg.attn_softcap:
        scores = softcap(g.b, s, scores, cfg.attn_softcap)
    scores = b.one(s, "Add", [scores, bias])
    if cfg.attn_sinks:
        probs = _with_sinks(g, i, s, scores, q)
    else:
        probs = b.one(s, "Softmax", [scores], axis=-1)
    context = b.one(s, "MatMul", [b.one(s, "Cast", [probs], to=g.elem), v_all])
    if heads == kv_heads:
        context = b.one(s, "Slice", [context, b.const(s, [0]), b.const(s, [-1]), b.const(s, [2]), b.const(s, [1])])
    out = b.one(s, "Transpose", [b.one(s, "Reshape", [context, b.const(s, [0, heads, -1, dim])])], perm=[0, 2, 1, 3])
    if cfg.mla:
        out = latent_output(g.emitter(s), cfg, out, w_uv)
    else:
        out = b.one(s, "Reshape", [out, b.const(s, [0, -1, heads * dim])])
    out = gated(g.emitter(s), out, g.gates.get(i, ""), heads * cfg.attn_head_gate)  # gated attention (export/linear_ops.py)
    out = b.one(f"{s}/o_proj", "MatMul", [_projected(g, i, "attn_sub_norm", out, s), g.role(i, "o_proj")])
    return b.one(f"{s}/o_proj", "Add", [out, g.role(i, "o_bias")]) if cfg.o_proj_bias else out


def _projected(g: _Graph, i: int, sub_norm: str, x: str, s: str) -> str:
    """A projection's input `x`: its `sub_norm` when the model has them, then through int8 and back (BitNet)."""
    cfg = g.model.config
    x = _norm(g, f"{s}/{sub_norm}", x, role_name(i, sub_norm)) if sub_norm and cfg.sub_norms else x
    return act_quant(g.emitter(s), x) if cfg.act_quant else x


def _with_sinks(g: _Graph, i: int, s: str, scores: str, q: str) -> str:
    """Softmax over the scores [b, kv, rows, T] and one more column per row, its head's sink logit (gpt-oss),
    which is then dropped: the rows' probabilities sum to less than 1."""
    b, cfg = g.b, g.model.config
    sinks = b.one(s, "Cast", [g.role(i, "sinks")], to=TensorProto.FLOAT)
    sinks = b.one(s, "Reshape", [sinks, b.const(s, [1, cfg.num_attention_heads, 1, 1])])
    rows = b.one(s, "Concat", [b.one(s, "Shape", [q], end=3), b.const(s, [1])], axis=0)  # [b, heads, q, 1]
    column = b.one(s, "Reshape", [b.one(s, "Expand", [sinks, rows]), b.const(s, [0, cfg.num_key_value_heads, -1, 1])])
    if cfg.num_attention_heads == cfg.num_key_value_heads:
        column = g.b.with_last_row(s, column)
    probs = b.one(s, "Softmax", [b.one(s, "Concat", [scores, column], axis=-1)], axis=-1)
    return b.one(s, "Slice", [probs, b.const(s, [0]), b.const(s, [-1]), b.const(s, [-1]), b.const(s, [1])])


def _rope(g: _Graph, scope: str, x: str, kind: str, cfg: ModelConfig | None = None) -> str:
    """`x` through the rope of `kind` (export/rope_ops.py); `cfg`: the layer's (its head_dim)."""
    return rope(g.b, scope, x, *g.rotary[kind], cfg or g.model.config)
