"""What each graph initializer is made of: checkpoint tensors, side by side, maybe transposed, in a dtype.

A `Recipe` names the checkpoint tensors (Hugging Face names) an initializer is built from: several are
stacked along their first axis (q/k/v, gate/up: one larger MatMul), a MatMul weight is transposed to
[in, out], and the result is converted to the graph's dtype. Every graph of an artifact asks for its
weights by recipe, so two graphs that need the same bytes (the contract graph and the fused CPU / GPU
graphs) find them by recipe, without comparing bytes. `recipe_pieces` produces the bytes a slice at a time:
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

from ..models.architectures import family
from ..models.weight_names import BESIDE_ROLES, NORM_ROLES
from ..models.config import ModelConfig, eagle3_tap_layers
from ..models.kda_config import KDA_MATMULS, kda_shapes
from ..models.soft_tokens import SOFT_TABLE
from ..models.weights import WeightSource
from ..weights_file import Piece

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
    offset: float = 0.0  # added to the values in float32 (Gemma's norm gains: 1 + weight)


@dataclass
class DecoderWeights:
    """A decoder to build a graph of: its architecture, its weights and which hidden states the graph returns."""

    config: ModelConfig
    source: WeightSource
    hidden_states: str = "none"
    aux_layers: tuple[int, ...] = field(default=())
    max_context: int | None = None  # the positions its graphs take lie below it (None: unbounded; longrope's long set)

    def __post_init__(self) -> None:
        if not self.aux_layers:
            self.aux_layers = eagle3_tap_layers(self.config.num_hidden_layers)

    @property
    def tied(self) -> bool:
        return self.config.tie_word_embeddings

    def first_layer(self) -> "DecoderWeights":
        """This decoder as its probe sees it: a one-layer graph whose EAGLE-3 tap (if any) is layer 0's input."""
        return DecoderWeights(self.config, self.source, self.hidden_states, (0,), self.max_context)


# --------------------------------------------------------------------------------- the checkpoint's names

def layer_sources(config: ModelConfig, i: int) -> dict[str, tuple[str, ...]]:
    """The Hugging Face tensors of decoder layer `i`, by role (models/architectures.py)."""
    p = f"model.layers.{i}."
    sources = {role: tuple(p + n for n in names) for role, names in family(config.architecture).layer_names().items()}
    if config.kv_source(i) is not None:  # KV sharing: q_proj alone (the keys / values are another layer's)
        sources["qkv"], sources["qkv_bias"] = sources["qkv"][:1], sources["qkv_bias"][:1]
    elif config.values_are_keys(i):  # no v_proj: q | k rows (the graphs take the keys as values)
        sources["qkv"], sources["qkv_bias"] = sources["qkv"][:2], sources["qkv_bias"][:2]
    return sources


EMBED = ("model.embed_tokens.weight",)
POSITIONS = ("model.embed_positions.weight",)  # learned absolute positions (GPT-2's wpe) [rows, hidden]
FINAL_NORM = ("model.norm.weight",)
FINAL_NORM_BIAS = ("model.norm.bias",)
LM_HEAD = ("lm_head.weight",)
LM_HEAD_BIAS = ("lm_head.bias",)
TRANSPOSED = {"qkv", "o_proj", "gate_up", "up", "down", "q_kv_a", "q_kv", "q_b", "ple_gate", "ple_proj", "laurel_left", "laurel_right",
              "altup_router", "altup_predict", "altup_correct", "lin_qkvz", "lin_ba", "lin_out", "conv_in", "conv_out",
              "ssm_in", "ssm_out", "ssm_x", "ssm_dt", "mla_gate", *KDA_MATMULS, "lru_y", "lru_x", "lru_out",
              "lightning_qkv", "lightning_gate", "lightning_out"}  # MatMul weights [in, out]
NORMS = {"input_norm", "post_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm", "ple_norm",
         "attn_sub_norm", "ffn_sub_norm", "altup_router_norm", "laurel_norm",
         *BESIDE_ROLES}
# the per-layer embeddings (Gemma 4's PLE): table [vocab, layers * P], projection [layers * P, hidden], norm [P]
PLE_TABLE, PLE_PROJECTION, PLE_NORM = ("model.embed_tokens_per_layer.weight",), ("model.per_layer_model_projection.weight",), \
    ("model.per_layer_projection_norm.weight",)


def layer_roles(config: ModelConfig, layer: int = 0) -> list[str]:
    """The roles layer `layer` of `config` has weights for (a MoE layer's experts: export/moe_ops.py)."""
    return config.layer_roles(layer)


def layer_recipe(config: ModelConfig, i: int, role: str, dtype: str) -> Recipe:
    offset = config.norm_offset if role in NORMS else 0.0
    return Recipe(layer_sources(config, i)[role], role in TRANSPOSED, dtype, offset)


def final_norm_recipe(config: ModelConfig, dtype: str) -> Recipe:
    return Recipe(FINAL_NORM, False, dtype, config.norm_offset)


def top_bias_recipes(config: ModelConfig, dtype: str) -> dict[str, Recipe]:
    """The final norm's and lm_head's biases, if the model has them, by graph initializer name."""
    biases = {"model.norm.bias": Recipe(FINAL_NORM_BIAS, False, dtype)} if config.norm_bias else {}
    return {**biases, **({"lm_head.bias": Recipe(LM_HEAD_BIAS, False, dtype)} if config.lm_head_bias else {})}


def position_recipes(config: ModelConfig, dtype: str) -> dict[str, Recipe]:
    """The learned position table (GPT-2's wpe), by graph initializer name ({}: rope instead)."""
    return {POSITIONS[0]: Recipe(POSITIONS, False, dtype)} if config.position_embeddings else {}


def per_layer_recipes(config: ModelConfig, dtype: str) -> dict[str, Recipe]:
    """The per-layer embeddings' model-level weights (Gemma 4's PLE), by graph initializer name ({}: none)."""
    if not config.per_layer_input_size:
        return {}
    return {"model.embed_tokens_per_layer.weight": Recipe(PLE_TABLE, False, dtype),
            "model.per_layer_model_projection.weight_t": Recipe(PLE_PROJECTION, True, dtype),
            "model.per_layer_projection_norm.weight": Recipe(PLE_NORM, False, dtype, config.norm_offset)}


def altup_recipes(config: ModelConfig, dtype: str) -> dict[str, Recipe]:
    """Gemma 3n's projections into / out of the AltUp streams and its wrapper's image / audio token table
    (models/soft_tokens.py), by graph initializer name ({}: no AltUp)."""
    recipes = {f"model.{kind}.{k}.weight_t": Recipe((f"model.{kind}.{k}.weight",), True, dtype)
               for kind in ("altup_projections", "altup_unembed_projections") for k in range(config.altup_inputs - 1)}
    return {**recipes, **({SOFT_TABLE: Recipe((SOFT_TABLE,), False, dtype)} if config.soft_token_offset else {})}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a decoder of `config` reads, with its shape."""
    c = config
    shapes = {EMBED[0]: (c.vocab_size, c.hidden_size), FINAL_NORM[0]: (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes[LM_HEAD[0]] = (c.vocab_size, c.hidden_size)
    shapes.update({FINAL_NORM_BIAS[0]: (c.hidden_size,)} if c.norm_bias else {})
    shapes.update({LM_HEAD_BIAS[0]: (c.vocab_size,)} if c.lm_head_bias else {})
    shapes.update({POSITIONS[0]: (c.position_embeddings, c.hidden_size)} if c.position_embeddings else {})
    width = c.num_hidden_layers * c.per_layer_input_size
    shapes.update({PLE_TABLE[0]: (c.per_layer_vocab_size, width), PLE_PROJECTION[0]: (width, c.hidden_size),
                   PLE_NORM[0]: (c.per_layer_input_size,)} if width else {})
    shapes.update({r.sources[0]: (c.hidden_size, c.hidden_size) for r in altup_recipes(c, "fp32").values()})
    shapes.update({SOFT_TABLE: (c.vocab_size - c.soft_token_offset, c.hidden_size)} if c.soft_token_offset else {})
    for i in range(c.num_hidden_layers):
        shapes.update(_layer_shapes(c, i))
    return shapes


def _layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of decoder layer i, with its shape (its own head_dim / kv heads)."""
    c = config.layer(i)
    h, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.kv_dim, c.intermediate_size
    qk = [(q,), (kv,)] if c.qk_norm_full else [(c.head_dim,), (c.head_dim,)]
    per_role = {"input_norm": [(h,)], "qkv": [(q, h), (kv, h), (kv, h)], "o_proj": [(h, q)], "post_norm": [(h,)],
                "post_attn_norm": [(h,)], "post_mlp_norm": [(h,)], "gate_up": [(inter, h), (inter, h)],
                "down": [(h, inter)], "qkv_bias": [(q,), (kv,), (kv,)], "q_norm": qk[:1], "k_norm": qk[1:], "q_norm_bias": qk[:1], "k_norm_bias": qk[1:],
                "o_bias": [(h,)], "sinks": [(c.num_attention_heads,)], "up": [(inter, h)], "up_bias": [(inter,)], "gate_up_bias": [(inter,), (inter,)],
                "down_bias": [(h,)], "act": [(1,)] * 4, "layer_scalar": [(1,)], **{f"{n}_bias": [(h,)] for n in NORM_ROLES},
                "ple_gate": [(c.per_layer_input_size, h)], "ple_proj": [(h, c.per_layer_input_size)], "ple_norm": [(h,)],
                **{role: [(h,)] for role in BESIDE_ROLES}, "attn_sub_norm": [(q,)], "ffn_sub_norm": [(inter,)], **_altup_shapes(c)}
    if c.attn_output_gate:  # gated attention: q_proj gives q and the gate
        per_role["qkv"] = [(q + c.num_attention_heads * c.gate_dim, h), (kv, h), (kv, h)]
    if c.hybrid is not None:
        per_role.update(_linear_shapes(c))
    if c.mla:
        per_role.update(_mla_shapes(c))
        per_role["o_proj"] = [(h, c.num_attention_heads * c.v_head_dim)]
    fused = {"qkv": [(q + 2 * kv, h)], "gate_up": [(2 * inter, h)], "qkv_bias": [(q + 2 * kv,)]}
    if c.hybrid is not None:  # Qwen3-Next's in_proj_qkvz / in_proj_ba
        fused.update(lin_qkvz=[(c.hybrid.conv_dim + c.hybrid.value_dim, h)], lin_ba=[(2 * c.hybrid.num_v_heads, h)])
    shapes: dict[str, tuple[int, ...]] = {}
    names = layer_sources(config, i)
    shared = c.kv_source(i) is not None  # KV sharing: q_proj alone (its shape first among qkv's)
    for role in layer_roles(config, i):
        fused_role = len(names[role]) == 1 and role in fused and not (shared and role.startswith("qkv"))
        role_shapes = fused[role] if fused_role else per_role[role]
        shapes.update(zip(names[role], role_shapes))
    if c.moe is not None and c.moe.is_moe(i):
        shapes.update(c.moe.shapes(i, h))
    return shapes


def _linear_shapes(c: ModelConfig) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of a recurrent layer's roles (models/linear_config.py LINEAR_NAMES, SHORT_CONV_NAMES, MAMBA2_NAMES,
    MAMBA1_NAMES, models/kda_config.py KDA_NAMES)."""
    hy, h = c.hybrid, c.hidden_size
    if hy.kda:
        return kda_shapes(hy, h)
    if hy.lightning:  # MiniMax-01 (models/lightning.py)
        w = hy.value_dim
        return {"lightning_qkv": [(3 * w, h)], "lightning_gate": [(w, h)], "lightning_norm": [(w,)], "lightning_out": [(h, w)]}
    if hy.rglru:  # RecurrentGemma (models/rglru_config.py)
        w, block = [(hy.width,)], (hy.num_v_heads, hy.width // hy.num_v_heads)
        return {"lru_y": [(hy.width, h)], "lru_x": [(hy.width, h)], "lru_out": [(h, hy.width)], "lru_y_bias": w, "lru_x_bias": w,
                "lru_out_bias": [(h,)], "lru_conv": [(hy.width, 1, hy.conv_kernel)], "lru_conv_bias": w, "lru_a": w,
                "lru_in_gate": [(*block, block[1])], "lru_in_gate_bias": [block], "lru_a_gate": [(*block, block[1])], "lru_a_gate_bias": [block]}
    if hy.mamba1:
        inner, n, r = [(hy.width,)], [(hy.k_dim,)], hy.dt_rank
        return {"ssm_in": [(2 * hy.width, h)], "ssm_conv": [(hy.width, 1, hy.conv_kernel)], "ssm_conv_bias": inner,
                "ssm_x": [(r + 2 * hy.k_dim, hy.width)], "ssm_dt_norm": [(r,)], "ssm_b_norm": n, "ssm_c_norm": n, "ssm_dt": [(hy.width, r)],
                "ssm_dt_proj_bias": inner, "ssm_a_log": [(hy.width, hy.k_dim)], "ssm_d": inner, "ssm_out": [(h, hy.width)]}
    if hy.mamba2:
        heads = [(hy.num_v_heads,)]
        return {"ssm_in": [(hy.value_dim + hy.conv_dim + hy.num_v_heads, h)], "ssm_conv": [(hy.conv_dim, 1, hy.conv_kernel)],
                "ssm_conv_bias": [(hy.conv_dim,)], "ssm_a_log": heads, "ssm_dt_bias": heads, "ssm_d": heads,
                "ssm_norm": [(hy.value_dim,)], "ssm_out": [(h, hy.value_dim)]}
    if hy.short_conv:
        return {"conv_in": [(3 * hy.width, h)], "conv_kernel": [(hy.width, 1, hy.conv_kernel)], "conv_out": [(h, hy.width)]}
    return {"lin_qkvz": [(hy.conv_dim, h), (hy.value_dim, h)], "lin_ba": [(hy.num_v_heads, h)] * 2,
            "lin_conv": [(hy.conv_dim, 1, hy.conv_kernel)], "lin_a_log": [(hy.num_v_heads,)], "lin_dt_bias": [(hy.num_v_heads,)],
            "lin_norm": [(hy.v_dim,)], "lin_out": [(h, hy.value_dim)]}


def _altup_shapes(c: ModelConfig) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of Gemma 3n's AltUp / LAuReL roles (models/architectures.py ALTUP_NAMES)."""
    n, h, r = c.altup_inputs, c.hidden_size, c.laurel_rank
    return {"altup_scale": [(h,)], "altup_correct": [(n, n)], "altup_predict": [(n * n, n)], "altup_router": [(n, h)],
            "altup_router_norm": [(h,)], "laurel_left": [(r, h)], "laurel_right": [(h, r)], "laurel_norm": [(h,)]}


def _mla_shapes(c: ModelConfig) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of the latent attention roles (models/architectures.py MLA_NAMES)."""
    q_out, latent = c.num_attention_heads * (c.qk_nope_head_dim + c.rope_dim), c.kv_lora_rank + c.rope_dim
    return {"q_kv_a": [(c.q_lora_rank, c.hidden_size), (latent, c.hidden_size)], "q_kv": [(q_out, c.hidden_size), (latent, c.hidden_size)],
            "q_a_norm": [(c.q_lora_rank,)], "q_b": [(q_out, c.q_lora_rank)], "kv_a_norm": [(c.kv_lora_rank,)],
            "kv_b": [(c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)], "mla_gate": [(c.num_attention_heads, c.hidden_size)]}


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


def recipe_pieces(source: WeightSource, recipe: Recipe, scratch: "TransposeScratch",
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[Piece]:
    """The initializer's values in C order as consecutive `Piece`s of about `chunk_bytes` (converted bytes), each
    converted into a buffer the weights writer lends.

    A transposed recipe's tensors are transposed whole in the checkpoint's dtype into `scratch` (torch's blocked
    transpose is ~3x faster than converting column slices; the stacked tensors side by side as column blocks,
    never concatenated), then converted a block of rows at a time."""
    out = np_dtype(recipe.dtype)
    if not recipe.transpose:
        for name in recipe.sources:
            array = source.read(name)
            if recipe.offset:
                array = array.astype(np.float32) + np.float32(recipe.offset)
            yield from _row_pieces([array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)], out, chunk_bytes)
        return
    yield from _row_pieces(scratch.transposed([source.read(name) for name in recipe.sources]), out, chunk_bytes)


def _row_pieces(parts: list[np.ndarray], out: np.dtype, chunk_bytes: int) -> Iterator[Piece]:
    """Rows of the column blocks `parts` side by side, converted to `out`, a block of rows per piece."""
    rows, width = len(parts[0]), sum(p.shape[1] for p in parts)
    step = max(1, chunk_bytes // max(1, width * out.itemsize))
    for start in range(0, rows, step):
        stop = min(rows, start + step)

        def fill(buffer: np.ndarray, start: int = start, stop: int = stop) -> None:
            target = buffer.view(out).reshape(stop - start, width)
            column = 0
            for part in parts:
                convert_into(target[:, column:column + part.shape[1]], part[start:stop])
                column += part.shape[1]

        yield Piece((stop - start) * width * out.itemsize, fill)


class TransposeScratch:
    """One reusable buffer for the transposed tensors of a recipe (its size: the largest transposed recipe)."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)

    def transposed(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Each 2-D array transposed into the buffer (views, valid until the next call)."""
        total = sum(a.nbytes for a in arrays)
        if len(self._buffer) < total:
            self._buffer = np.empty(0, np.uint8)  # the old buffer goes before the new one comes
            self._buffer = np.empty(total, np.uint8)
        views, offset = [], 0
        for array in arrays:
            rows, cols = array.shape
            view = self._buffer[offset:offset + array.nbytes].view(array.dtype).reshape(cols, rows)
            to_torch(view).copy_(to_torch(array).t())
            views.append(view)
            offset += array.nbytes
        return views


def convert_into(target: np.ndarray, block: np.ndarray) -> None:
    """Write `block` into `target` (same shape) in `target`'s dtype, rounding to nearest even: torch's copy
    kernels (one thread), about twice as fast as numpy's casts into an existing buffer, and bitwise the same
    (tests/test_streaming_export.py)."""
    if block.dtype == target.dtype:
        np.copyto(target, block)
    else:
        to_torch(target).copy_(to_torch(block))


def to_torch(array: np.ndarray):
    """A torch view of a numpy array (ml_dtypes bfloat16 as torch.bfloat16); read-only maps included."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a read-only memory map is not writable: it is not written
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


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
