"""What each graph initializer is made of: checkpoint tensors, side by side, maybe transposed, in a dtype.

A `Recipe` names the checkpoint tensors (Hugging Face names) an initializer is built from: several are
stacked along their first axis (q/k/v, gate/up: one larger MatMul), a MatMul weight is transposed to
[in, out], and the result is converted to the graph's dtype. Every graph of an artifact asks for its
weights by recipe, so two graphs that need the same bytes (the contract graph and the fused CPU / GPU
graphs) find them by recipe, without comparing bytes. `recipe_chunks` produces the bytes a slice at a time:
a pass over a model's recipes holds one weight (and its transposed copy), never the model.

`DecoderWeights` is what a decoder graph is built from: architecture, weight source and hidden-state taps.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
from onnx import TensorProto

from ..models.config import ModelConfig, eagle3_tap_layers
from ..models.weights import WeightSource

DTYPES = ("fp32", "fp16", "bf16")
ELEM = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
CHUNK_BYTES = 32 << 20  # converted bytes per piece handed to the writer


def np_dtype(dtype: str):
    """numpy dtype of an export dtype name (ml_dtypes' bfloat16 for bf16)."""
    if dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16}[dtype])


@dataclass(frozen=True)
class Recipe:
    """An initializer made of checkpoint tensors `sources` stacked on axis 0, transposed or not, in `dtype`."""

    sources: tuple[str, ...]
    transpose: bool
    dtype: str


@dataclass
class DecoderWeights:
    """A decoder to build a graph of: its architecture, its weights and which hidden states the graph returns."""

    config: ModelConfig
    source: WeightSource
    hidden_states: str = "none"
    aux_layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.aux_layers:
            self.aux_layers = eagle3_tap_layers(self.config.num_hidden_layers)

    @property
    def tied(self) -> bool:
        return self.config.tie_word_embeddings

    def first_layer(self) -> "DecoderWeights":
        """This decoder as its probe sees it: a one-layer graph whose EAGLE-3 tap (if any) is layer 0's input."""
        return DecoderWeights(self.config, self.source, self.hidden_states, (0,))


# --------------------------------------------------------------------------------- the checkpoint's names

def layer_sources(i: int) -> dict[str, tuple[str, ...]]:
    """The Hugging Face tensors of decoder layer `i`, by role."""
    p = f"model.layers.{i}."
    return {
        "input_norm": (p + "input_layernorm.weight",),
        "qkv": tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
        "qkv_bias": tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"),
        "q_norm": (p + "self_attn.q_norm.weight",),
        "k_norm": (p + "self_attn.k_norm.weight",),
        "o_proj": (p + "self_attn.o_proj.weight",),
        "post_norm": (p + "post_attention_layernorm.weight",),
        "gate_up": (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        "down": (p + "mlp.down_proj.weight",),
    }


EMBED = ("model.embed_tokens.weight",)
FINAL_NORM = ("model.norm.weight",)
LM_HEAD = ("lm_head.weight",)
TRANSPOSED = {"qkv", "o_proj", "gate_up", "down"}  # roles stored as MatMul weights [in, out]


def layer_recipe(i: int, role: str, dtype: str) -> Recipe:
    return Recipe(layer_sources(i)[role], role in TRANSPOSED, dtype)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a decoder of `config` reads, with its shape."""
    c = config
    h, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.kv_dim, c.intermediate_size
    shapes = {EMBED[0]: (c.vocab_size, h), FINAL_NORM[0]: (h,)}
    if not c.tie_word_embeddings:
        shapes[LM_HEAD[0]] = (c.vocab_size, h)
    per_role = {"input_norm": [(h,)], "qkv": [(q, h), (kv, h), (kv, h)], "o_proj": [(h, q)], "post_norm": [(h,)],
                "gate_up": [(inter, h), (inter, h)], "down": [(h, inter)]}
    if c.attention_bias:
        per_role["qkv_bias"] = [(q,), (kv,), (kv,)]
    if c.qk_norm:
        per_role.update(q_norm=[(c.head_dim,)], k_norm=[(c.head_dim,)])
    for i in range(c.num_hidden_layers):
        names = layer_sources(i)
        for role, role_shapes in per_role.items():
            shapes.update(zip(names[role], role_shapes))
    return shapes


def check_weights(config: ModelConfig, source: WeightSource) -> None:
    """InputError unless `source` holds exactly the tensors a decoder of `config` reads, in their shapes."""
    from ..errors import InputError
    from ..models.weights import describe_key_mismatch

    expected = expected_shapes(config)
    names = source.names()
    missing = [n for n in expected if n not in source]
    unexpected = [n for n in names if n not in expected]
    if missing or unexpected:
        raise InputError(f"weights do not match the {config.architecture} architecture "
                         f"({describe_key_mismatch(missing, unexpected)})")
    wrong = [f"{n} {source.shape(n)} (expected {expected[n]})" for n in names if source.shape(n) != expected[n]]
    if wrong:
        raise InputError(f"weights do not match the config's shapes: {', '.join(wrong[:4])}")


# ----------------------------------------------------------------------------------------- the bytes

def recipe_shape(source: WeightSource, recipe: Recipe) -> tuple[int, ...]:
    """The initializer's shape (checked: stacked tensors must agree on their other axes)."""
    shapes = [source.shape(name) for name in recipe.sources]
    rest = {s[1:] for s in shapes}
    if len(rest) != 1:
        raise ValueError(f"{', '.join(recipe.sources)}: shapes {shapes} cannot be stacked")
    stacked = (sum(s[0] for s in shapes), *shapes[0][1:])
    return tuple(reversed(stacked)) if recipe.transpose else stacked


def recipe_nbytes(source: WeightSource, recipe: Recipe) -> int:
    return int(np.prod(recipe_shape(source, recipe), dtype=np.int64)) * np_dtype(recipe.dtype).itemsize


def recipe_chunks(source: WeightSource, recipe: Recipe, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The initializer's values in C order, as consecutive pieces of about `chunk_bytes` (converted bytes).

    A transposed recipe is transposed whole in the checkpoint's dtype (one contiguous copy: torch's blocked
    transpose is ~3x faster than converting column slices), then converted a slice of rows at a time; the
    checkpoint's memory map is released before the first piece is converted."""
    out = np_dtype(recipe.dtype)
    if not recipe.transpose:
        for name in recipe.sources:
            array = source.read(name)
            flat = array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)
            yield from _row_pieces(flat, out, chunk_bytes)
            del array, flat
        return
    matrix = _transposed(source, recipe.sources)
    yield from _row_pieces(matrix, out, chunk_bytes)


def _row_pieces(matrix, out: np.dtype, chunk_bytes: int) -> Iterator[np.ndarray]:
    """`matrix` (numpy or torch, 2-D) converted to `out` a block of rows at a time."""
    rows = len(matrix)
    width = int(np.prod(matrix.shape[1:], dtype=np.int64)) if len(matrix.shape) > 1 else 1
    step = max(1, chunk_bytes // max(1, width * out.itemsize))
    for start in range(0, rows, step):
        yield convert(matrix[start:start + step], out)


def _transposed(source: WeightSource, names: tuple[str, ...]):
    """The tensors `names` stacked on axis 0 and transposed, as a contiguous torch tensor of their dtype."""
    import torch

    with single_threaded_torch():
        parts = [to_torch(source.read(name)) for name in names]
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        del parts
        return stacked.t().contiguous()


def convert(block, out: np.dtype) -> np.ndarray:
    """A numpy or torch block as a C-order numpy array of dtype `out`, rounded to nearest even (a view of the
    block when it already is one).

    numpy converts to and from float32 fastest; torch converts bfloat16 <-> float16 fastest (ml_dtypes goes
    element by element); both round alike (tests/test_export_builder.py checks it bitwise)."""
    array = block if isinstance(block, np.ndarray) else from_torch(block)
    if array.dtype == out:
        return np.ascontiguousarray(array)
    if array.dtype == np.float32 or out == np.float32:
        return np.ascontiguousarray(array.astype(out))
    with single_threaded_torch():
        return from_torch(to_torch(array).to(_TORCH_TYPES[out.name]).contiguous())


_TORCH_TYPES: dict = {}


def to_torch(array: np.ndarray):
    """A torch view of a numpy array (ml_dtypes bfloat16 as torch.bfloat16); read-only maps included."""
    import torch

    if not _TORCH_TYPES:
        _TORCH_TYPES.update(float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a read-only memory map is not writable: it is not written
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def from_torch(tensor) -> np.ndarray:
    """A numpy view of a CPU torch tensor (bfloat16 as ml_dtypes' bfloat16)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np_dtype("bf16"))
    return tensor.numpy()


@contextlib.contextmanager
def single_threaded_torch():
    """torch on one thread: its copy kernels run faster so on this class of machine, and the weights writer's
    thread hashes and writes on the other core meanwhile."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
