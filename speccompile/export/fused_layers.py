"""The decoder layers of the fused ONNX Runtime graphs (export/ort_fused_graph.py), by the layer description.

Each layer reads only `ModelConfig`'s layer description (models/architectures.py): norm kind and placement (pre: the residual
add fused into the next norm, `SkipSimplifiedLayerNormalization`; sandwich; post; parallel), q/k norms (before rope, or after it:
roped by a `RotaryEmbedding` before GroupQueryAttention), rope kind per layer (global / local table, or none), the attention scale,
soft-capping and sliding window, the MLP activation (or no MLP: Nemotron-H). A sliding layer reads its own additive bias: the pass's `attention_bias` with
the key slots j at position - j >= window masked (the contract graph's rule, `fused_ops.window_bias`; Llama 4's chunks: `chunk_ops.chunk_bias`); the causal
CUDA graphs, which verify chains only, use GroupQueryAttention's `local_window_size` (the slotted GPU graph's tree form takes a bias, windowed as the CPU graph's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto

from .activations import activation
from .linear_ops import gated, gated_qkv, linear_block, parallel_block
from .altup_ops import LayerParts, active_stream, altup_layer, altup_merge, altup_streams, gaussian_topk, soft_tokens
from .bitnet_ops import act_quant
from .mla_ops import absorbed, absorbed_query, latent_inputs, latent_output
from .moe_ops import Emitter, beside_dense, moe_block
from .normed_residual_ops import normed_residual_nodes, scaled
from .per_layer_ops import per_layer_block, per_layer_inputs
from .query_scale import query_scale
from .fused_ops import LOWEST, MS_DOMAIN, GpuSlotInputs, Nodes, OneRowPadding, SlotInputs, head_norm, layer_norm, rms_norm, rotary_names, skip_norm
from .chunk_ops import sliding_bias
from .recipes import ELEM, DecoderWeights, Recipe, final_norm_recipe, layer_recipe, np_dtype, per_layer_recipes, top_bias_recipes
from .weight_store import WeightStore


@dataclass
class _Fused:
    """One fused graph under construction: nodes, initializers and what every layer reads."""

    model: DecoderWeights
    store: WeightStore
    dtype: str
    target: str
    n: Nodes = field(default_factory=Nodes)
    inits: list[TensorProto] = field(default_factory=list)
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    biases: dict[tuple, str] = field(default_factory=dict)  # (slot, sliding) -> the attention bias
    new_rows: dict[int, list[str]] = field(default_factory=dict)  # layer -> its k / v inputs (KV sharing)
    per_layer: str = ""  # every layer's per-layer input [b, q, layers, P] (PLE)
    query_scale: str = ""  # Llama 4's query scaling [b, q, 1] (export/query_scale.py), or none
    named: set[str] = field(default_factory=set)  # the initializers written
    gates: dict[int, str] = field(default_factory=dict)  # layer -> its attention output gate (gated attention)

    @property
    def elem(self) -> int:
        return ELEM[self.dtype]

    def weight(self, name: str, recipe: Recipe) -> str:
        if name not in self.named:  # a weight read twice (Gemma 3n's router norm): one initializer
            self.named.add(name)
            self.inits.append(self.store.tensor(name, recipe))
        return name

    def layer_weight(self, i: int, name: str, role: str) -> str:
        return self.weight(f"layers.{i}.{name}", layer_recipe(self.model.config, i, role, self.dtype))

    def emitter(self) -> Emitter:
        """The node writer of export/moe_ops.py / export/mla_ops.py."""
        return Emitter(self.n, self.const, self.weight, self.elem, self.dtype)

    def const(self, name: str, values, dtype=np.int64) -> str:
        """An integer constant initializer; asking again for `name` (with the same values) reuses it."""
        values = np.asarray(values, dtype=dtype)
        if name in self.consts:
            assert np.array_equal(self.consts[name], values), name
            return name
        self.consts[name] = values
        self.inits.append(onnx.numpy_helper.from_array(values, name))
        return name


_WEIGHT_NAMES = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
                 "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


class _Norms:
    """The family's norm (RMSNorm or LayerNorm), alone or fused with the residual add before it."""

    def __init__(self, f: _Fused):
        self.f = f
        self.eps = float(f.model.config.rms_norm_eps)
        self.layer = f.model.config.norm == "layer"

    def gain(self, i: int, role: str) -> str:
        return self.f.layer_weight(i, _WEIGHT_NAMES.get(role, role), role)

    def gamma(self, i: int, role: str) -> list[str]:
        """The norm's gain, and its bias when the family's norms have one (LayerNorm only)."""
        gain = [self.gain(i, role)]
        return gain + [self.f.layer_weight(i, f"{role}_bias", f"{role}_bias")] if self.f.model.config.norm_bias else gain

    def plain(self, x: str, gamma: list[str], prefix: str) -> str:
        f = self.f
        if self.layer:
            return layer_norm(f.n, x, gamma, self.eps)
        return rms_norm(f.n, x, gamma[0], self.eps, f.const, prefix, f.elem)

    def skip(self, x: str, residual: str, gamma: list[str]) -> tuple[str, str]:
        """norm(x + residual) and x + residual."""
        if self.layer:
            normed, total = f"{x}_normed", f"{x}_plus_residual"
            self.f.n("SkipLayerNormalization", [x, residual, *gamma], [normed, "", "", total], domain=MS_DOMAIN,
                     epsilon=self.eps)
            return normed, total
        return skip_norm(self.f.n, x, residual, gamma[0], self.eps)


def decoder_layers(f: _Fused, x: str, count: int, padding: OneRowPadding | None,
                   slots: SlotInputs | None) -> tuple[str, list[str], list[str]]:
    """The first `count` layers and the final norm; returns (final hidden, EAGLE-3 taps, present names)."""
    cfg, n = f.model.config, f.n
    norms = _Norms(f)
    x = soft_tokens(f.emitter(), cfg, x) if cfg.soft_token_offset else x  # Gemma 3n's image / audio tokens
    residual, pending, taps, presents = x, None, [], []  # pending: the block output not yet added to residual
    embed_gain = _final_gain(f) if cfg.embed_norm else []  # nanochat: the final norm of the embeddings too
    if embed_gain:
        residual = norms.plain(x, embed_gain, "embed")
    if cfg.per_layer_input_size:  # Gemma 4's per-layer embeddings (export/per_layer_ops.py)
        f.per_layer = per_layer_inputs(f.emitter(), cfg, x, lambda h, gain: norms.plain(
            h, [f.weight(gain, per_layer_recipes(cfg, f.dtype)[gain])], "per_layer"))
    f.query_scale = query_scale(f.emitter(), cfg, "position_ids", [2]) if cfg.query_scale_beta else ""
    if cfg.altup_inputs:  # Gemma 3n: the layers on AltUp's streams
        return _altup_layers(f, x, count, padding, slots, norms)
    for i in range(count):
        if (placement := cfg.placement_of(i)) == "post":  # OLMo Hybrid: pre-norm delta nets beside post-norm attention
            residual = residual if pending is None else n("Add", [residual, pending])[0]
            h = residual
        elif pending is None:
            h = norms.plain(residual, norms.gamma(i, "input_norm"), f"layers.{i}")
        else:
            h, residual = norms.skip(pending, residual, norms.gamma(i, "input_norm"))
        if i in f.model.aux_layers:
            taps.append(residual)
        attn, layer_presents = _attention_block(f, i, h, norms, padding, slots)
        presents += layer_presents
        if cfg.residual_factors:  # MiniMax-01: the residuals are the normed inputs, scaled (export/normed_residual_ops.py)
            residual, pending = normed_residual_nodes(f.emitter(), cfg.residual_factors[i], h, attn, lambda t, u: norms.skip(t, u, norms.gamma(i, "post_norm"))[0], lambda t: _mlp(f, i, t))
            continue
        if placement in ("parallel", "parallel2"):  # parallel2: the MLP on its own norm of the residual (GPT-NeoX)
            h = norms.plain(residual, norms.gamma(i, "post_norm"), f"layers.{i}.mlp") if placement == "parallel2" else h
            pending = n("Add", [_scaled(f, attn), _scaled(f, _mlp(f, i, h))])[0]
            continue
        if not cfg.has_mlp(i):  # Nemotron-H: its mixer alone, added by the next norm
            pending = _scaled(f, attn)
            continue
        if placement in ("sandwich", "post"):
            attn = norms.plain(attn, norms.gamma(i, "post_attn_norm"), f"layers.{i}.post_attn")
        if placement == "post":
            residual = n("Add", [residual, attn])[0]
            h = residual
        else:
            h, residual = norms.skip(_scaled(f, attn), residual, norms.gamma(i, "post_norm"))
        pending = _mlp(f, i, h, residual, norms)
        if placement in ("sandwich", "post"):
            pending = norms.plain(pending, norms.gamma(i, "post_mlp_norm"), f"layers.{i}.post_mlp")
        pending = _scaled(f, pending)
        if cfg.layer_scalar or cfg.per_layer_input_size:  # Gemma 4 (the next norm is then a plain one)
            residual, pending = _layer_end(f, i, n("Add", [residual, pending])[0], norms), None
    final_gain = embed_gain or _final_gain(f)
    if pending is None:
        final, last = norms.plain(residual, final_gain, "final"), residual
    else:
        final, last = norms.skip(pending, residual, final_gain)
    if count == cfg.num_hidden_layers and count in f.model.aux_layers:  # tap L: the final hidden state before the norm
        taps.append(last)
    return final, taps, presents


def _attention_block(f: _Fused, i: int, h: str, norms: "_Norms", padding: OneRowPadding | None,
                     slots: SlotInputs | None) -> tuple[str, list[str]]:
    """Layer i's attention on the normed input `h` through o_proj (and its bias); returns (output, present names)."""
    cfg, n = f.model.config, f.n
    if cfg.linear(i):  # a gated delta net (export/linear_ops.py): its states instead of KV buffers
        return linear_block(f.emitter(), cfg, i, h, lambda role: f.layer_weight(i, f"linear_attn.{role}", role))
    w_uk, w_uv = absorbed(f.emitter(), cfg, i) if cfg.mla else ("", "")  # kv_b_proj's per-head slices
    a = _projected(f, i, "", h)  # BitNet: through int8 and back
    query = _latent_qkv(f, i, a, norms, w_uk) if cfg.mla else _qkv(f, i, a, norms) if cfg.kv_source(i) is None else \
        _shared_query(f, i, a, norms)
    f.new_rows[i] = query[1:]
    if f.query_scale and cfg.layer(i).query_scale_beta:  # after the q norms; GroupQueryAttention's rope commutes with a per-position scalar
        query = [n("Mul", [query[0], f.query_scale])[0], *query[1:]]
    out, layer_presents = _attention(f, i, query, padding, slots)
    if cfg.mla:  # the heads' latent outputs through W_UV (export/mla_ops.py)
        heads = n("Reshape", [out, f.const("mla.context_heads", [0, 0, cfg.num_attention_heads, cfg.head_dim])])[0]
        out = latent_output(f.emitter(), cfg, heads, w_uv)
    out = gated(f.emitter(), out, f.gates.get(i, ""), cfg.num_attention_heads * cfg.attn_head_gate)  # gated attention (export/linear_ops.py)
    attn = n("MatMul", [_projected(f, i, "attn_sub_norm", out), f.layer_weight(i, "self_attn.o_proj.weight_t", "o_proj")])[0]
    if cfg.o_proj_bias:
        attn = n("Add", [attn, f.layer_weight(i, "self_attn.o_proj.bias", "o_bias")])[0]
    return parallel_block(f.emitter(), cfg, i, h, attn, layer_presents, lambda role: f.layer_weight(i, f"mamba.{role}", role))  # Falcon-H1


def _altup_layers(f: _Fused, x: str, count: int, padding: OneRowPadding | None, slots: SlotInputs | None,
                  norms: _Norms) -> tuple[str, list[str], list[str]]:
    """Gemma 3n's layers on AltUp's streams of the embeddings `x` (export/altup_ops.py), the streams' mean and the
    final norm; returns (final hidden, EAGLE-3 taps, present names)."""
    cfg, em, taps, presents = f.model.config, f.emitter(), [], []

    def attend(i: int, h: str) -> str:
        attn, layer_presents = _attention_block(f, i, h, norms, padding, slots)
        presents.extend(layer_presents)
        return attn

    streams = altup_streams(em, cfg, x)
    for i in range(count):
        if i in f.model.aux_layers:
            taps.append(active_stream(em, streams))
        parts = LayerParts(lambda h, i=i: attend(i, h), lambda h, i=i: _mlp(f, i, h),
                           lambda role, h, i=i: norms.plain(h, norms.gamma(i, role), f"layers.{i}.{role}"),
                           lambda role, i=i: f.layer_weight(i, role, role))
        streams = altup_layer(em, cfg, i, streams, parts, f.per_layer)
    last = altup_merge(em, cfg, streams)
    if count == cfg.num_hidden_layers and count in f.model.aux_layers:  # tap L: the final hidden state before the norm
        taps.append(last)
    return norms.plain(last, _final_gain(f), "final"), taps, presents


def _final_gain(f: _Fused) -> list[str]:
    """The final norm's gain, and its bias when the family's norms have one."""
    cfg = f.model.config
    gain = [f.weight("model.norm.weight", final_norm_recipe(cfg, f.dtype))]
    return gain + ([f.weight("model.norm.bias", top_bias_recipes(cfg, f.dtype)["model.norm.bias"])] if cfg.norm_bias else [])


def _layer_end(f: _Fused, i: int, residual: str, norms: _Norms) -> str:
    """Layer i's residual stream after its per-layer input block (PLE) and times its scalar (Gemma 4)."""
    cfg = f.model.config
    if cfg.per_layer_input_size:
        residual = per_layer_block(f.emitter(), cfg, i, residual, f.per_layer, lambda role: f.layer_weight(i, role, role),
                                   lambda h: norms.plain(h, norms.gamma(i, "ple_norm"), f"layers.{i}.ple"))
    return f.n("Mul", [residual, f.layer_weight(i, "layer_scalar", "layer_scalar")])[0] if cfg.layer_scalar else residual


def _scaled(f: _Fused, x: str) -> str:
    """A block's output times the residual multiplier (Granite)."""
    return scaled(f.emitter(), x, f.model.config.residual_scale, "residual_scale")


def _qkv(f: _Fused, i: int, h: str, norms: _Norms) -> list[str]:
    """GroupQueryAttention's query inputs: the packed q/k/v rows, or q, k, v after their norms (values = the keys
    before their norm where the layer has no v_proj; Gemma 4's scale-free value norm)."""
    cfg, n = f.model.config.layer(i), f.n
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = n("MatMul", [h, f.layer_weight(i, "self_attn.qkv.weight_t", "qkv")])[0]
    if cfg.attention_bias:
        qkv = n("Add", [qkv, f.layer_weight(i, "self_attn.qkv.bias", "qkv_bias")])[0]
    if not (cfg.qk_norm or cfg.v_norm or cfg.values_are_keys(i) or cfg.kv_sources or cfg.query_scale_beta or cfg.attn_output_gate):  # apart
        return [qkv, "", ""]
    pre = f"layers.{i}"
    if cfg.attn_output_gate:  # q rows doubled (per head q, gate): the gate kept for the attention's output
        q, f.gates[i], k, v = gated_qkv(f.emitter(), f"{pre}.qkv_split", qkv, heads, kv_heads, dim, cfg.gate_dim)
    elif cfg.values_are_keys(i):
        q, k = n("Split", [qkv, f.const(f"{pre}.qk_split", [heads * dim, kv_heads * dim])], 2, axis=-1)
        v = k
    else:
        q, k, v = n("Split", [qkv, f.const(f"{pre}.qkv_split", [heads * dim, kv_heads * dim, kv_heads * dim])], 3, axis=-1)
    if cfg.v_norm:
        ones = [f.const(f"v_norm.ones.{dim}", np.ones(dim), np_dtype(f.dtype))]  # a gain of 1: the scale-free norm
        v = head_norm(n, v, kv_heads, dim, lambda x: norms.plain(x, ones, f"{pre}.v"), f.const, f"{pre}.v")
    if not cfg.qk_norm:
        return [q, k, v]
    if cfg.qk_norm_full:
        return [norms.plain(q, norms.gamma(i, "q_norm"), f"{pre}.q"), norms.plain(k, norms.gamma(i, "k_norm"), f"{pre}.k"), v]
    if cfg.qk_norm_after_rope and cfg.rope_kind(i):  # Hunyuan: rope here, the norms of the roped heads, no rope in GQA
        q, k = _rope(f, i, q, heads), _rope(f, i, k, kv_heads)
    q_gamma = norms.gamma(i, "q_norm")
    q = head_norm(n, q, heads, dim, lambda x: norms.plain(x, q_gamma, f"{pre}.q"), f.const, f"{pre}.q")
    k_gamma = norms.gamma(i, "k_norm")
    k = head_norm(n, k, kv_heads, dim, lambda x: norms.plain(x, k_gamma, f"{pre}.k"), f.const, f"{pre}.k")
    return [q, k, v]


def _shared_query(f: _Fused, i: int, h: str, norms: _Norms) -> list[str]:
    """KV sharing: GroupQueryAttention's inputs of layer i: its q (q_proj, its per-head norm: Gemma 4's layers) and
    the k / v inputs (before rope) of the layer it shares them with, which its GroupQueryAttention ropes alike (the
    same table: the same type) and writes into this layer's own KV buffer: the same rows."""
    cfg, n = f.model.config.layer(i), f.n
    q = n("MatMul", [h, f.layer_weight(i, "self_attn.qkv.weight_t", "qkv")])[0]
    if cfg.attention_bias:
        q = n("Add", [q, f.layer_weight(i, "self_attn.qkv.bias", "qkv_bias")])[0]
    if cfg.qk_norm:
        gamma = norms.gamma(i, "q_norm")
        q = head_norm(n, q, cfg.num_attention_heads, cfg.head_dim, lambda x: norms.plain(x, gamma, f"layers.{i}.q"), f.const,
                      f"layers.{i}.q")
    return [q, *f.new_rows[cfg.kv_source(i)]]


def _rope(f: _Fused, i: int, x: str, heads: int) -> str:
    """`x` [b, q, heads * head_dim] roped at the pass's `position_ids` by layer i's table: ONNX Runtime's
    RotaryEmbedding on the cos / sin caches GroupQueryAttention reads (whose rotary is then off: `_gqa_attributes`).
    Its rows line up with `position_ids` in every form (before the CPU graph's padding row and the slots' split)."""
    cfg = f.model.config
    attrs = dict(domain=MS_DOMAIN, num_heads=heads, interleaved=int(cfg.rope_interleaved))
    if cfg.rope_dim != cfg.head_dim:
        attrs["rotary_embedding_dim"] = cfg.rope_dim
    return f.n("RotaryEmbedding", [x, "position_ids", *rotary_names(cfg.rope_kind(i))], **attrs)[0]


def _latent_qkv(f: _Fused, i: int, h: str, norms: _Norms, w_uk: str) -> list[str]:
    """Multi-head latent attention's GroupQueryAttention inputs: the query heads [q_pe, q_nope @ W_UK_h], and the
    one KV head [k_pe, c_kv] as key and value (GroupQueryAttention ropes the first rotary_dim dims of both)."""
    em, cfg = f.emitter(), f.model.config
    q, key = latent_inputs(em, cfg, i, h, lambda x, role: norms.plain(x, norms.gamma(i, role), f"layers.{i}.{role}"), f.gates)
    query = absorbed_query(em, cfg, q, w_uk)
    query = f.n("Reshape", [query, f.const("mla.query_flat", [0, 0, cfg.num_attention_heads * cfg.head_dim])])[0]
    return [query, key, key]


def _gqa_attributes(f: _Fused, i: int, biased: bool = False) -> dict:
    """Layer i's GroupQueryAttention attributes (`biased`: the node takes an attention bias, which then masks the
    sliding window itself, by position)."""
    cfg = f.model.config.layer(i)
    attrs = dict(domain=MS_DOMAIN, num_heads=cfg.num_attention_heads, kv_num_heads=cfg.num_key_value_heads,
                 scale=float(cfg.scale),
                 do_rotary=int(bool(_rotary(f, i)[0])), rotary_interleaved=int(cfg.rope_interleaved), local_window_size=-1)
    if cfg.attn_softcap:
        attrs["softcap"] = float(cfg.attn_softcap)
    if f.target == "cuda" and cfg.sliding(i) and not biased:  # chains only: the slot-based window is the positional one
        attrs["local_window_size"] = int(cfg.sliding_window)  # the kernels keep local_window_size + 1 keys, as window_bias
    return attrs


def _rotary(f: _Fused, i: int) -> list[str]:
    """GroupQueryAttention's cos / sin caches of layer i (none: no rope, or roped before it: `_rope`)."""
    kind = f.model.config.rope_kind(i)
    return rotary_names(kind) if kind and not f.model.config.qk_norm_after_rope else ["", ""]


def _sinks(f: _Fused, i: int) -> list[str]:
    """GroupQueryAttention's `head_sink` input (gpt-oss' per-head sink logits), or nothing."""
    return [f.layer_weight(i, "self_attn.sinks", "sinks")] if f.model.config.attn_sinks else []


def _bias(f: _Fused, i: int, slot: int | None, bias: str, positions: str) -> str:
    """Layer i's attention bias: the pass's, or for a sliding layer the windowed one (made once per slot)."""
    if not f.model.config.sliding(i):
        return bias
    key = (slot, True)
    if key not in f.biases:
        f.biases[key] = sliding_bias(f.emitter(), f.model.config, bias, positions)  # a window, or Llama 4's chunks
    return f.biases[key]


def _attention(f: _Fused, i: int, query: list[str], padding: OneRowPadding | None,
               slots: SlotInputs | None) -> tuple[str, list[str]]:
    """Layer i's GroupQueryAttention over its KV buffer (with the CPU graph's padding row, or one per slot)."""
    if slots is not None:
        return _slot_attention(f, i, query, slots)
    present_k, present_v = f"present.{i}.key", f"present.{i}.value"
    if padding is None:  # the CUDA kernel rejects attention_bias
        lengths, extra = ["seqlens_k", "total_sequence_length"], ["position_ids", *[x for s in _sinks(f, i) for x in ("", s)]]
    else:
        query = [padding.rows(x) if x else "" for x in query]
        lengths = [padding.seqlens_k, padding.total_sequence_length]
        extra = [padding.position_ids, _bias(f, i, None, padding.attention_bias, padding.position_ids), *_sinks(f, i)]
    out = f.n("GroupQueryAttention", [*query, f"past_key_values.{i}.key", f"past_key_values.{i}.value", *lengths,
                                      *_rotary(f, i), *extra],
              [f"attn_{i}" if padding is None else f"attn_{i}_padded", present_k, present_v], **_gqa_attributes(f, i))[0]
    if padding is not None:
        out = padding.drop(out, f"attn_{i}")
    return out, [present_k, present_v]


def _slot_attention(f: _Fused, i: int, query: list[str], slots: SlotInputs) -> tuple[str, list[str]]:
    """Each slot's rows through a GroupQueryAttention of their own, over that slot's KV (CPU, and the GPU graph's
    tree form: with the slot's attention bias; the GPU graph: causal)."""
    parts = [slots.split(x) if x else [""] * slots.slots for x in query]
    outs, presents, sinks = [], [], _sinks(f, i)
    biased = f.target == "cpu" or isinstance(slots, GpuSlotInputs) and slots.tree
    for b in range(slots.slots):
        past, present = f"past_key_values.{i}.{b}", f"present.{i}.{b}"
        if f.target == "cpu":
            tail = [_bias(f, i, b, f"attention_bias.{b}", slots.positions[b]), *sinks]
        elif biased:
            tail = [_slot_tree_bias(f, i, b, slots), *sinks]
        else:  # causal from seqlens_k: no attention_bias (the flash kernel on CUDA)
            tail = [x for s in sinks for x in ("", s)]
        out = f.n("GroupQueryAttention", [*(part[b] for part in parts), f"{past}.key", f"{past}.value",
                                          *slots.lengths[b], *_rotary(f, i), slots.positions[b], *tail],
                  [f"attn_{i}_{b}_padded", f"{present}.key", f"{present}.value"], **_gqa_attributes(f, i, biased))[0]
        outs.append(out)
        presents += [f"{present}.key", f"{present}.value"]
    return slots.join(outs, f"attn_{i}"), presents


def _slot_tree_bias(f: _Fused, i: int, b: int, slots: "GpuSlotInputs") -> str:
    """Slot b's attention bias for layer i in the graph dtype (windowed for a sliding layer; made once per slot
    and kind): the float32 input clamped to the dtype's lowest finite value, then cast."""
    key = (b, f.model.config.sliding(i), "elem")
    if key not in f.biases:
        bias = _bias(f, i, b, slots.biases[b], slots.positions[b])
        if f.elem != TensorProto.FLOAT:
            lowest = f.const("tree_bias.lowest", LOWEST[f.elem], np.float32)
            bias = f.n("Cast", [f.n("Max", [bias, lowest])[0]], to=f.elem)[0]
        f.biases[key] = bias
    return f.biases[key]


def _mlp(f: _Fused, i: int, h: str, residual: str = "", norms: _Norms | None = None) -> str:
    """down(act(gate) * up) with gate and up from one MatMul (act: `_act`); or the layer's mixture of experts
    (export/moe_ops.py; Gemma 4's beside the dense MLP: on the `residual` stream, with its `norms`)."""
    n, moe = f.n, f.model.config.moe
    if moe is not None and moe.is_moe(i) and moe.beside_dense:
        return beside_dense(f.emitter(), f.model.config, i, h, residual, lambda t: _dense_mlp(f, i, t),
                            lambda role, t: norms.plain(t, norms.gamma(i, role), f"layers.{i}.{role}"))
    if moe is not None and moe.is_moe(i):
        return moe_block(Emitter(n, f.const, f.weight, f.elem, f.dtype), f.model.config, i, h)
    return _dense_mlp(f, i, h)


def _dense_mlp(f: _Fused, i: int, h: str) -> str:
    """Layer i's dense MLP: down(act(gate) * up), gate and up from one MatMul, or plain down(act(up h)) (Phi-2's fc1 /
    fc2); their biases where the family has them (`mlp_bias`: Phi-2's up / down, RecurrentGemma's gate too)."""
    cfg, n, bias = f.model.config, f.n, f.model.config.mlp_bias
    if not cfg.mlp_gated:
        up = n("MatMul", [h, f.layer_weight(i, "mlp.up.weight_t", "up")])[0]
        act = _act(f, i, n("Add", [up, f.layer_weight(i, "mlp.up.bias", "up_bias")])[0] if bias else up)
    else:
        gu = n("MatMul", [_projected(f, i, "", h), f.layer_weight(i, "mlp.gate_up.weight_t", "gate_up")])[0]
        gu = n("Add", [gu, f.layer_weight(i, "mlp.gate_up.bias", "gate_up_bias")])[0] if bias else gu
        inter = cfg.layer(i).intermediate_size  # its own (KV sharing's double-wide MLP)
        gate, up = n("Split", [gu, f.const(f"layers.{i}.mlp_split", [inter, inter])], 2, axis=-1)
        if cfg.activation_sparsity and cfg.activation_sparsity[i]:  # Gemma 3n's Gaussian top-k
            gate = gaussian_topk(f.emitter(), gate, cfg.activation_sparsity[i])
        act = _projected(f, i, "ffn_sub_norm", n("Mul", [_act(f, i, gate), up])[0])
    out = n("MatMul", [act, f.layer_weight(i, "mlp.down_proj.weight_t", "down")])[0]
    return n("Add", [out, f.layer_weight(i, "mlp.down_proj.bias", "down_bias")])[0] if bias else out


def _projected(f: _Fused, i: int, sub_norm: str, x: str) -> str:
    """A projection's input `x`: its `sub_norm` (BitNet's attn_sub_norm / ffn_sub_norm) when the model has them, then
    through int8 and back when the model quantizes its activations (export/bitnet_ops.py)."""
    cfg, norms = f.model.config, _Norms(f)
    x = norms.plain(x, norms.gamma(i, sub_norm), f"layers.{i}.{sub_norm}") if sub_norm and cfg.sub_norms else x
    return act_quant(f.emitter(), x) if cfg.act_quant else x


def _act(f: _Fused, i: int, x: str) -> str:
    """Layer i's MLP activation (export/activations.py; xIELU's scalars: the `act` role)."""
    kind = f.model.config.mlp_act
    return activation(f.emitter(), kind, x, f.layer_weight(i, "mlp.act.params", "act") if kind == "xielu" else None)

