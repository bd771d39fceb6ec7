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

import math
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from ..models.rope import rounded_inv_freq
from .graph_builder import INT64_MAX, GraphBuilder, value
from .recipes import EMBED, FINAL_NORM, LM_HEAD, ELEM, DecoderWeights, Recipe, layer_recipe, np_dtype
from .weight_store import WeightStore

OPSET = 21
_FLOAT_MIN = float(-3.4028234663852886e38)  # torch.finfo(torch.float32).min: the mask's "may not attend"


def contract_names(model: DecoderWeights, dtype: str) -> dict[str, Recipe]:
    """Initializer name -> recipe, for every weight of the contract graph (the names the traced graph had)."""
    cfg = model.config
    names = {"model.embed_tokens.weight": Recipe(EMBED, False, dtype), "model.norm.weight": Recipe(FINAL_NORM, False, dtype)}
    if not model.tied:
        names["lm_head.weight_t"] = Recipe(LM_HEAD, True, dtype)
    for i in range(cfg.num_hidden_layers):
        roles = {
            f"model.layers.{i}.input_layernorm.weight": "input_norm",
            f"layers.{i}.self_attn.weight_t": "qkv",
            f"layers.{i}.self_attn.o_proj.weight_t": "o_proj",
            f"model.layers.{i}.post_attention_layernorm.weight": "post_norm",
            f"layers.{i}.mlp.weight_t": "gate_up",
            f"layers.{i}.mlp.down_proj.weight_t": "down",
        }
        if cfg.attention_bias:
            roles[f"layers.{i}.self_attn.bias"] = "qkv_bias"
        if cfg.qk_norm:
            roles[f"model.layers.{i}.self_attn.q_norm.weight"] = "q_norm"
            roles[f"model.layers.{i}.self_attn.k_norm.weight"] = "k_norm"
        names.update({name: layer_recipe(i, role, dtype) for name, role in roles.items()})
    return names


@dataclass
class _Graph:
    """What every part of the graph reads: the node writer, the weights and the shared per-pass tensors."""

    b: GraphBuilder
    store: WeightStore
    model: DecoderWeights
    dtype: str
    recipes: dict[str, Recipe]
    cos: str = ""
    sin: str = ""
    bias: str = ""
    padded_bias: str = ""  # the bias with its last row repeated, made by the first layer that needs it

    @property
    def elem(self) -> int:
        return ELEM[self.dtype]

    def weight(self, name: str) -> str:
        return self.b.initializer(self.store.tensor(name, self.recipes[name]))


def build_contract_graph(model: DecoderWeights, store: WeightStore, dtype: str, layers: int | None = None) -> onnx.ModelProto:
    """The contract graph of `model` in `dtype`, its weights through `store`. `layers`: only the first that many
    decoder layers (a probe of the full graph for the ONNX Runtime load check), the head included."""
    cfg = model.config
    count = cfg.num_hidden_layers if layers is None else layers
    g = _Graph(GraphBuilder(), store, model, dtype, contract_names(model, dtype))
    b = g.b
    x = b.one("/embed_tokens", "Gather", [g.weight("model.embed_tokens.weight"), "input_ids"])
    g.cos, g.sin = _rotary(g)
    g.bias = _attention_bias(g)
    taps, presents = [], []
    for i in range(count):
        if i in model.aux_layers:
            taps.append(x)
        x = _layer(g, i, x)
        presents += [f"present.{i}.key", f"present.{i}.value"]
    if count == cfg.num_hidden_layers and count in model.aux_layers:  # tap L: the final hidden state before the norm
        taps.append(x)
    final = _rms_norm(g, "/norm", x, "model.norm.weight", "hidden_states" if model.hidden_states == "final" else None)
    _lm_head(g, final)
    outputs = _outputs(g, presents, len(taps))
    if model.hidden_states == "eagle3":
        b.one("", "Concat", taps, "aux_hidden_states", axis=-1)
    inputs = [value("input_ids", TensorProto.INT64, ["batch", "q_len"]),
              value("position_ids", TensorProto.INT64, ["batch", "q_len"]),
              value("attention_mask", TensorProto.BOOL, ["batch", "q_len", "total_len"])]
    for i in range(count):
        inputs += [value(f"past_key_values.{i}.{kind}", g.elem, ["batch", cfg.num_key_value_heads, "past_len", cfg.head_dim])
                   for kind in ("key", "value")]
    return b.model("main_graph", inputs, outputs, {"": OPSET})


def _outputs(g: _Graph, presents: list[str], taps: int) -> list[onnx.ValueInfoProto]:
    cfg = g.model.config
    outputs = [value("logits", TensorProto.FLOAT, ["batch", "q_len", cfg.vocab_size])]
    outputs += [value(name, g.elem, ["batch", cfg.num_key_value_heads, "total_len", cfg.head_dim]) for name in presents]
    if g.model.hidden_states == "final":
        outputs.append(value("hidden_states", g.elem, ["batch", "q_len", cfg.hidden_size]))
    elif g.model.hidden_states == "eagle3":
        outputs.append(value("aux_hidden_states", g.elem, ["batch", "q_len", taps * cfg.hidden_size]))
    return outputs


def _rotary(g: _Graph) -> tuple[str, str]:
    """cos/sin [b, 1, q, head_dim] of the positions, in the model dtype (RotaryEmbedding)."""
    b, s = g.b, "/rotary_emb"
    positions = b.one(s, "Cast", ["position_ids"], to=TensorProto.FLOAT)
    positions = b.one(s, "Unsqueeze", [positions, b.const(s, [-1])])
    inv_freq = rounded_inv_freq(g.model.config, np_dtype(g.dtype))
    freqs = b.one(s, "Mul", [positions, b.const(s, inv_freq, inv_freq.dtype)])
    emb = b.one(s, "Concat", [freqs, freqs], axis=-1)
    emb = b.one(s, "Unsqueeze", [emb, b.const(s, [1])])
    cos = b.one(s, "Cast", [b.one(s, "Cos", [emb])], to=g.elem)
    sin = b.one(s, "Cast", [b.one(s, "Sin", [emb])], to=g.elem)
    return cos, sin


def _attention_bias(g: _Graph) -> str:
    """The boolean mask as an additive float32 bias [b, 1, groups*q, T], tiled over the query groups once."""
    b = g.b
    cfg = g.model.config
    bias = b.one("", "Where", ["attention_mask", b.const("", 0.0, "float32"), b.const("", _FLOAT_MIN, "float32")])
    bias = b.one("", "Unsqueeze", [bias, b.const("", [1])])
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    return b.one("", "Tile", [bias, b.const("", [1, 1, groups, 1])]) if groups > 1 else bias


def _rms_norm(g: _Graph, scope: str, x: str, weight: str, output: str | None = None) -> str:
    """RMSNorm in float32, rounded to the model dtype before the gain (models.decoder.RMSNorm)."""
    b = g.b
    wide = b.one(scope, "Cast", [x], to=TensorProto.FLOAT)
    square = b.one(scope, "Pow", [wide, b.const(scope, 2.0, "float32")])
    mean = b.one(scope, "ReduceMean", [square, b.const(scope, [-1])], keepdims=1)
    root = b.one(scope, "Sqrt", [b.one(scope, "Add", [mean, b.const(scope, g.model.config.rms_norm_eps, "float32")])])
    inverse = b.one(scope, "Div", [b.const(scope, 1.0, "float32"), root])
    normed = b.one(scope, "Cast", [b.one(scope, "Mul", [wide, inverse])], to=g.elem)
    return b.one(scope, "Mul", [g.weight(weight), normed], output)


def _layer(g: _Graph, i: int, x: str) -> str:
    """Decoder layer i: attention and MLP blocks with their residual adds; returns the residual stream."""
    b, scope = g.b, f"/layers.{i}"
    attn = _attention(g, i, _rms_norm(g, f"{scope}/input_layernorm", x, f"model.layers.{i}.input_layernorm.weight"))
    x = b.one(scope, "Add", [x, attn])
    h = _rms_norm(g, f"{scope}/post_attention_layernorm", x, f"model.layers.{i}.post_attention_layernorm.weight")
    return b.one(scope, "Add", [x, _mlp(g, i, h)])


def _mlp(g: _Graph, i: int, h: str) -> str:
    """down(silu(gate) * up), gate and up from one MatMul."""
    b, scope = g.b, f"/layers.{i}/mlp"
    inter = g.model.config.intermediate_size
    both = b.one(scope, "MatMul", [h, g.weight(f"layers.{i}.mlp.weight_t")])
    gate, up = b.op(scope, "Split", [both, b.const(scope, [inter, inter])], 2, axis=-1)
    act = b.one(scope, "Mul", [b.one(scope, "Mul", [gate, b.one(scope, "Sigmoid", [gate])]), up])
    return b.one(f"{scope}/down_proj", "MatMul", [act, g.weight(f"layers.{i}.mlp.down_proj.weight_t")])


def _attention(g: _Graph, i: int, h: str) -> str:
    """Grouped-query attention of layer i over past + new keys (models.decoder.Attention); writes present.{i}.*."""
    b, s = g.b, f"/layers.{i}/self_attn"
    cfg = g.model.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = b.one(s, "MatMul", [h, g.weight(f"layers.{i}.self_attn.weight_t")])
    if cfg.attention_bias:
        qkv = b.one(s, "Add", [g.weight(f"layers.{i}.self_attn.bias"), qkv])
    q, k, v = b.op(s, "Split", [qkv, b.const(s, [heads * dim, kv_heads * dim, kv_heads * dim])], 3, axis=-1)
    q = b.one(s, "Reshape", [q, b.const(s, [0, -1, heads, dim])])
    k = b.one(s, "Reshape", [k, b.const(s, [0, -1, kv_heads, dim])])
    v = b.one(s, "Reshape", [v, b.const(s, [0, -1, kv_heads, dim])])
    if cfg.qk_norm:
        q = _rms_norm(g, f"{s}/q_norm", q, f"model.layers.{i}.self_attn.q_norm.weight")
        k = _rms_norm(g, f"{s}/k_norm", k, f"model.layers.{i}.self_attn.k_norm.weight")
    q, k, v = (b.one(s, "Transpose", [t], perm=[0, 2, 1, 3]) for t in (q, k, v))
    q, k = _rope(g, s, q), _rope(g, s, k)
    k_all = b.one(s, "Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
    v_all = b.one(s, "Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
    qg = b.one(s, "Reshape", [q, b.const(s, [0, kv_heads, -1, dim])])
    bias = g.bias
    if heads == kv_heads:  # one query head per KV head: keep >= 2 rows in the attention matmuls (_with_last_row)
        qg = _with_last_row(g, s, qg)
        g.padded_bias = bias = g.padded_bias or _with_last_row(g, s, bias)  # computed once, as the tracer merged it
    scores = b.one(s, "MatMul", [qg, b.one(s, "Transpose", [k_all], perm=[0, 1, 3, 2])])
    scores = b.one(s, "Mul", [b.one(s, "Cast", [scores], to=TensorProto.FLOAT), b.const(s, 1.0 / math.sqrt(dim), "float32")])
    probs = b.one(s, "Softmax", [b.one(s, "Add", [scores, bias])], axis=-1)
    context = b.one(s, "MatMul", [b.one(s, "Cast", [probs], to=g.elem), v_all])
    if heads == kv_heads:
        context = b.one(s, "Slice", [context, b.const(s, [0]), b.const(s, [-1]), b.const(s, [2]), b.const(s, [1])])
    out = b.one(s, "Reshape", [context, b.const(s, [0, heads, -1, dim])])
    out = b.one(s, "Reshape", [b.one(s, "Transpose", [out], perm=[0, 2, 1, 3]), b.const(s, [0, -1, heads * dim])])
    return b.one(f"{s}/o_proj", "MatMul", [out, g.weight(f"layers.{i}.self_attn.o_proj.weight_t")])


def _rope(g: _Graph, scope: str, x: str) -> str:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] (constant slice bounds)."""
    b = g.b
    half = g.model.config.head_dim // 2
    axis, step = b.const(scope, [3]), b.const(scope, [1])
    upper = b.one(scope, "Slice", [x, b.const(scope, [half]), b.const(scope, [INT64_MAX]), axis, step])
    lower = b.one(scope, "Slice", [x, b.const(scope, [0]), b.const(scope, [half]), axis, step])
    rotated = b.one(scope, "Concat", [b.one(scope, "Neg", [upper]), lower], axis=-1)
    return b.one(scope, "Add", [b.one(scope, "Mul", [x, g.cos]), b.one(scope, "Mul", [rotated, g.sin])])


def _with_last_row(g: _Graph, scope: str, x: str) -> str:
    """`x` [b, h, rows, n] with a copy of its last row appended (models.decoder._with_last_row)."""
    b = g.b
    last = b.one(scope, "Slice", [x, b.const(scope, [-1]), b.const(scope, [INT64_MAX]), b.const(scope, [2]), b.const(scope, [1])])
    return b.one(scope, "Concat", [x, last], axis=2)


def _lm_head(g: _Graph, hidden: str) -> str:
    """float32 logits [b, q, vocab]: a MatMul by lm_head.weight_t, or the tied table read by a Gemm (transB)."""
    b = g.b
    cfg = g.model.config
    if g.model.tied:
        rows = b.one("", "Reshape", [hidden, b.const("", [-1, cfg.hidden_size])])
        flat = b.one("", "Gemm", [rows, g.weight("model.embed_tokens.weight")], transB=1)
        lead = b.one("", "Slice", [b.one("", "Shape", [hidden]), b.const("", [0]), b.const("", [2])])
        shape = b.one("", "Concat", [lead, b.const("", [-1])], axis=0)
        logits = b.one("", "Reshape", [flat, shape])
    else:
        logits = b.one("/lm_head", "MatMul", [hidden, g.weight("lm_head.weight_t")])
    return b.one("", "Cast", [logits], "logits", to=TensorProto.FLOAT)
