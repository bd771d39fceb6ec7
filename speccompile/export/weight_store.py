"""The initializers of the graphs built from one model: each written once, streamed, or found where it is.

A `WeightStore` turns a `Recipe` (export/recipes.py) into an external TensorProto. When an earlier graph
already stored the recipe (`shared`: the contract graph's weights, found by recipe), the new initializer
points at those bytes; otherwise the recipe is converted a slice at a time and appended to the store's own
`WeightsWriter` (weights_file.py), whose sha256 is computed on the way. Tensors the builders compute
(rotary tables) are stored the same way under a key of their own, so the fused graph and its slotted form
share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Mapping

import numpy as np
import onnx

from ..models.weights import WeightSource
from ..weights_file import StoredBytes, WeightsWriter, external_location, external_tensor, load_graph, tensor_type_of
from .recipes import ELEM, Recipe, TransposeScratch, recipe_nbytes, recipe_pieces, recipe_shape, single_threaded_torch


@dataclass(frozen=True)
class StoredTensor:
    """Where an initializer's bytes are, and what they are."""

    stored: StoredBytes
    data_type: int
    dims: tuple[int, ...]

    def proto(self, name: str) -> onnx.TensorProto:
        return external_tensor(name, self.data_type, self.dims, self.stored)


class WeightStore:
    """Initializers by recipe: shared bytes when `shared` has them, else written (once) to `writer`."""

    def __init__(self, source: WeightSource, writer: WeightsWriter | None,
                 shared: Mapping[Hashable, StoredTensor] | None = None):
        self.source = source
        self.writer = writer
        self.shared = dict(shared or {})
        self.written: dict[Hashable, StoredTensor] = {}
        self._scratch = TransposeScratch()

    def tensor(self, name: str, recipe: Recipe) -> onnx.TensorProto:
        """Initializer `name` holding `recipe`."""
        found = self.shared.get(recipe) or self.written.get(recipe)
        if found is None:
            dims = recipe_shape(self.source, recipe)
            length = recipe_nbytes(self.source, recipe)
            with single_threaded_torch():
                pieces = recipe_pieces(self.source, recipe, self._scratch)
                proto = self._writer(name).add_chunks(name, ELEM[recipe.dtype], dims, pieces, length)
            found = self.written[recipe] = StoredTensor(self._writer(name).stored(name), proto.data_type, tuple(dims))
        return found.proto(name)

    def computed(self, name: str, key: Hashable, make: Callable[[], np.ndarray]) -> onnx.TensorProto:
        """Initializer `name` holding `make()`, computed and written the first time `key` is asked for."""
        found = self.shared.get(key) or self.written.get(key)
        if found is None:
            array = np.ascontiguousarray(make())
            self._writer(name).add(name, array)
            found = self.written[key] = StoredTensor(self._writer(name).stored(name), tensor_type_of(array), array.shape)
        return found.proto(name)

    def _writer(self, name: str) -> WeightsWriter:
        if self.writer is None:
            raise ValueError(f"{name}: not among the shared weights and this store writes none")
        return self.writer


def stored_by_recipe(graph_path: Path, recipes: Mapping[str, Hashable]) -> dict[Hashable, StoredTensor]:
    """recipe -> where graph `graph_path` stores it, for its external initializers named in `recipes`
    (initializer name -> recipe): how a later graph finds the contract graph's weights."""
    found = {}
    for init in load_graph(graph_path).graph.initializer:
        where = external_location(init)
        if init.name in recipes and where is not None:
            found[recipes[init.name]] = StoredTensor(where, init.data_type, tuple(int(d) for d in init.dims))
    return found
