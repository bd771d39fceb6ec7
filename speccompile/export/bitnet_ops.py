"""BitNet's per-token 8-bit round trip of a projection's input as ONNX nodes, for every graph builder (contract, fused
CPU / GPU): the ops of models/bitnet.py `act_quant` in float32 (scale = 127 / max(max|x|, 1e-5), Round: half to even
as torch's, Clip to [-128, 127], divided by the scale), cast back to the graph dtype. Row-local: a row's values
depend on that row alone, so a verify pass and a one-row pass quantize a position alike."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .moe_ops import Emitter


def act_quant(em: Emitter, x: str) -> str:
    """`x` [..., width] through int8 per row and back (transformers' BitLinear.activation_quant, then / scale)."""
    f32 = np.float32
    wide = x if em.elem == TensorProto.FLOAT else em.one("Cast", [x], to=TensorProto.FLOAT)
    peak = em.one("ReduceMax", [em.one("Abs", [wide]), em.const("bitnet.last_axis", [-1])], keepdims=1)
    scale = em.one("Div", [em.const("bitnet.qp", 127.0, f32), em.one("Max", [peak, em.const("bitnet.floor", 1e-5, f32)])])
    q = em.one("Clip", [em.one("Round", [em.one("Mul", [wide, scale])]), em.const("bitnet.qn", -128.0, f32), em.const("bitnet.qp", 127.0, f32)])
    out = em.one("Div", [q, scale])
    return out if em.elem == TensorProto.FLOAT else em.one("Cast", [out], to=em.elem)
