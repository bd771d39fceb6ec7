"""Quantization units: the weights that calibration activations tie together, quantized as soon as their
activations have been calibrated, then written out and forgotten (a streaming build holds one unit at a time).

The methods (engines/methods.py) change weights per activation: AWQ scales the weights of every MatMul reading the
activation and folds 1/s into the tensor that produced it (an RMSNorm weight, or the up projection's columns of the
fused gate/up MatMul, upstream in the same layer); GPTQ, clipping and the low-rank split then work on each weight
with its activation's rows. A unit is a connected set of activations and initializers under "reads" and "folds
into", so its weights reach their final values with nothing outside it: the gated MLP is one unit (gate/up, down and
the post-attention norm), the attention's q/k/v with its input norm another, o_proj a third. Weights on a source grid
and embedding tables the methods do not fit are units without activations. Everything is found from the graph's
structure; no weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from .method_graph import fold_target
from .methods import quantized_groups
from .qdq_targets import QuantOptions, quantized_tables


@dataclass
class Unit:
    """Activations whose calibration the unit needs (all of them, complete, before it runs) and the initializers it
    loads: the MatMul weights reading them, the tensors their input scales fold into, an embedding table."""

    acts: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)


class _Sets:
    """Union-find over names."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def plan_units(model: onnx.ModelProto, options: QuantOptions, extra: list[str], calibrated: set[str]) -> list[Unit]:
    """The units of the methods' MatMuls and tables (`options`: the build's, source grids excluded), plus one unit
    per initializer of `extra` (weights on a source grid), in graph order. A unit lists only the activations of
    `calibrated` (the others have no statistics to wait for)."""
    inits = {i.name: i for i in model.graph.initializer}
    sets = _Sets()
    order: list[str] = []
    for act, readers in quantized_groups(model, options).items():
        order.append(f"act:{act}")
        for _node, weight in readers:
            sets.union(f"act:{act}", f"init:{weight}")
        target = fold_target(model, act, [node for node, _w in readers], int(inits[readers[0][1]].dims[0]))
        if target is not None:
            sets.union(f"act:{act}", f"init:{target.initializer}")
    for table in quantized_tables(model, options):
        order.append(f"init:{table.name}")
        if table.head is not None and not options.table_weight_only:  # the tied lm_head's rows fit the table
            sets.union(f"act:{table.head_input}", f"init:{table.name}")
    order += [f"init:{name}" for name in extra]
    units: dict[str, Unit] = {}
    for key in order:
        units.setdefault(sets.find(key), Unit())
    for key in dict.fromkeys([*order, *sets.parent]):
        unit = units[sets.find(key)]
        kind, name = key.split(":", 1)
        if kind == "init" and name not in unit.weights:
            unit.weights.append(name)
        elif kind == "act" and name in calibrated and name not in unit.acts:
            unit.acts.append(name)
    return list(units.values())
