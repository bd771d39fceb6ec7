"""The contract graph's head (export/contract_graph.py): the final hidden state through lm_head to float32
logits (the family's logit multiplier and soft-capping), and the graph's output values."""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import TensorProto

from .graph_builder import GraphBuilder, value
from .linear_ops import state_values
from .recipes import DecoderWeights


def outputs(model: DecoderWeights, elem: int, presents: list[str], taps: int) -> list[onnx.ValueInfoProto]:
    """logits, the presents (each its layer's shape, in `elem`) and the hidden-state outputs, as graph output values."""
    cfg = model.config
    outputs = [value("logits", TensorProto.FLOAT, ["batch", "q_len", cfg.vocab_size])]
    for name in presents:
        layer = int(name.split(".")[1])
        if name.startswith("present_state."):  # a recurrent layer's (or parallel mixer's) states (export/linear_ops.py)
            outputs += [v for v in state_values(cfg, layer, elem, past=False) if v.name == name]
        else:
            outputs.append(value(name, elem, ["batch", cfg.layer(layer).num_key_value_heads, "total_len", cfg.layer(layer).head_dim]))
    if model.hidden_states == "final":
        outputs.append(value("hidden_states", elem, ["batch", "q_len", cfg.hidden_size]))
    elif model.hidden_states == "eagle3":
        outputs.append(value("aux_hidden_states", elem, ["batch", "q_len", taps * cfg.hidden_size]))
    return outputs


def softcap(b: GraphBuilder, scope: str, x: str, cap: float) -> str:
    """cap * tanh(x / cap) (Gemma 2's attention and final logit soft-capping), in float32."""
    return b.one(scope, "Mul", [b.one(scope, "Tanh", [b.one(scope, "Div", [x, b.const(scope, cap, "float32")])]),
                                b.const(scope, cap, "float32")])


def lm_head(b: GraphBuilder, model: DecoderWeights, weight: Callable[[str], str], hidden: str) -> str:
    """float32 logits [b, q, vocab]: a MatMul by lm_head.weight_t, or the tied table read by a Gemm (transB);
    then the family's logit multiplier and soft-capping (`weight(name)`: the graph's initializer `name`)."""
    cfg = model.config
    if model.tied:
        rows = b.one("", "Reshape", [hidden, b.const("", [-1, cfg.hidden_size])])
        flat = b.one("", "Gemm", [rows, weight("model.embed_tokens.weight")], transB=1)
        lead = b.one("", "Slice", [b.one("", "Shape", [hidden]), b.const("", [0]), b.const("", [2])])
        shape = b.one("", "Concat", [lead, b.const("", [-1])], axis=0)
        logits = b.one("", "Reshape", [flat, shape])
    else:
        logits = b.one("/lm_head", "MatMul", [hidden, weight("lm_head.weight_t")])
    if cfg.lm_head_bias:
        logits = b.one("/lm_head", "Add", [logits, weight("lm_head.bias")])
    if not (cfg.logit_scale != 1.0 or cfg.final_softcap):
        return b.one("", "Cast", [logits], "logits", to=TensorProto.FLOAT)
    logits = b.one("", "Cast", [logits], to=TensorProto.FLOAT)
    if cfg.logit_scale != 1.0:
        logits = b.one("", "Mul", [logits, b.const("", cfg.logit_scale, "float32")])
    if cfg.final_softcap:
        logits = softcap(b, "", logits, cfg.final_softcap)
    return b.one("", "Identity", [logits], "logits")
