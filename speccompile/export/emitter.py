"""How a graph builder writes nodes (`Emitter`), shared by every op module (export/moe_ops.py, export/activations.py, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .recipes import Recipe


@dataclass
class Emitter:
    """How a builder writes nodes: `op(op_type, inputs, outputs, **attrs) -> outputs`, `const(key, values, dtype)`
    (an int64 / float constant; builders may reuse one per key), `weight(name, recipe) -> initializer name`."""

    op: Callable[..., list[str]]
    const: Callable[..., str]
    weight: Callable[[str, Recipe], str]
    elem: int
    dtype: str

    def one(self, op: str, inputs: list[str], **attrs) -> str:
        return self.op(op, inputs, 1, **attrs)[0]
