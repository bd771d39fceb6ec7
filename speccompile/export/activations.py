"""The MLP activations as ONNX nodes, for every graph builder (contract, fused CPU / GPU): SiLU (x * Sigmoid x),
exact or tanh GELU, ReLU (OPT), ReLU squared (Relu, then times itself) and xIELU (Apertus: four learned scalars per layer)."""

from __future__ import annotations

from .emitter import Emitter
from .recipes import np_dtype


def activation(em: Emitter, kind: str, x: str, params: str | None = None) -> str:
    """`kind` (ModelConfig.mlp_act) of `x`; `params`: xIELU's [alpha_p, alpha_n, beta, eps] initializer."""
    if kind in ("gelu", "gelu_tanh"):
        return em.one("Gelu", [x], approximate="tanh" if kind == "gelu_tanh" else "none")
    if kind in ("relu", "relu2"):
        r = em.one("Relu", [x])
        return em.one("Mul", [r, r]) if kind == "relu2" else r
    if kind == "xielu":
        return _xielu(em, x, params)
    return em.one("Mul", [x, em.one("Sigmoid", [x])])


def _xielu(em: Emitter, x: str, params: str) -> str:
    """transformers' xIELU: where(x > 0, a_p x^2 + beta x, (expm1(min(x, eps)) - x) a_n + beta x), a_p = softplus(alpha_p),
    a_n = beta + softplus(alpha_n) (expm1 as Exp - 1)."""
    alpha_p, alpha_n, beta, eps = (em.one("Gather", [params, em.const(f"act.xielu.{k}", [k])]) for k in range(4))
    dtype = np_dtype(em.dtype)
    one, zero = em.const("act.one", 1.0, dtype), em.const("act.zero", 0.0, dtype)
    bx = em.one("Mul", [beta, x])
    pos = em.one("Add", [em.one("Mul", [em.one("Mul", [em.one("Softplus", [alpha_p]), x]), x]), bx])
    expm1 = em.one("Sub", [em.one("Exp", [em.one("Min", [x, eps])]), one])
    neg = em.one("Add", [em.one("Mul", [em.one("Sub", [expm1, x]), em.one("Add", [beta, em.one("Softplus", [alpha_n])])]), bx])
    return em.one("Where", [em.one("Greater", [x, zero]), pos, neg])
