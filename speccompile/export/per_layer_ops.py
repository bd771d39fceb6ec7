"""Per-layer embeddings (Gemma 4's PLE) as ONNX nodes, for every graph builder (contract, fused CPU / GPU): what
models/per_layer.py computes, operator for operator.

    inputs   (norm(Reshape(embeds @ W_proj * hidden ** -0.5)) + Reshape(table[input_ids] * sqrt(P))) * 2 ** -0.5
             [b, q, layers, P], once per pass (the multipliers in the model dtype)
    layer i  x + norm_i((act(x @ gate_i) * inputs[:, :, i]) @ proj_i), after the MLP's residual add

Every node reads its own row only (Gathers, per-row MatMuls and norms), so a row computes the same bits in any pass.
The table is a Gather of [per_layer_vocab, layers * P], like the main embedding.
"""

from __future__ import annotations

from typing import Callable

from ..models.config import ModelConfig
from .activations import activation
from .moe_ops import Emitter
from .recipes import np_dtype, per_layer_recipes

TABLE, PROJECTION, NORM = "model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight_t", \
    "model.per_layer_projection_norm.weight"  # the graphs' initializer names (recipes.per_layer_recipes)


def per_layer_inputs(em: Emitter, cfg: ModelConfig, embeds: str, norm: Callable[[str, str], str]) -> str:
    """Every layer's per-layer input [b, q, layers, P] of `input_ids` and their scaled embeddings `embeds`;
    `norm(x, gain)`: the builder's norm of x with the gain initializer `gain` (per_layer_projection_norm)."""
    recipes, dtype = per_layer_recipes(cfg, em.dtype), np_dtype(em.dtype)
    layers, width = cfg.num_hidden_layers, cfg.per_layer_input_size
    shape = em.const("ple.shape", [0, 0, layers, width])
    ids = "input_ids"
    if cfg.per_layer_vocab_size < cfg.vocab_size:  # Gemma 3n: tokens past the table read its row 0
        ids = em.one("Where", [em.one("Less", [ids, em.const("ple.vocab", cfg.per_layer_vocab_size)]), ids, em.const("ple.row0", 0)])
    tokens = em.one("Gather", [em.weight(TABLE, recipes[TABLE]), ids])
    tokens = em.one("Mul", [tokens, em.const("ple.token_scale", width ** 0.5, dtype)])
    projected = em.one("MatMul", [embeds, em.weight(PROJECTION, recipes[PROJECTION])])
    projected = em.one("Mul", [projected, em.const("ple.projection_scale", cfg.hidden_size ** -0.5, dtype)])
    projected = norm(em.one("Reshape", [projected, shape]), NORM)
    total = em.one("Add", [projected, em.one("Reshape", [tokens, shape])])
    return em.one("Mul", [total, em.const("ple.input_scale", 2 ** -0.5, dtype)])


def per_layer_block(em: Emitter, cfg: ModelConfig, i: int, x: str, inputs: str, weight: Callable[[str], str],
                    norm: Callable[[str], str]) -> str:
    """Layer i's block on the residual stream `x` (`inputs`: `per_layer_inputs`' output; `weight(role)`: layer i's
    initializer of ple_gate / ple_proj; `norm(h)`: its ple_norm of h)."""
    mine = em.one("Gather", [inputs, em.const(f"ple.layer.{i}", i)], axis=2)  # [b, q, P]
    gated = em.one("Mul", [activation(em, cfg.mlp_act, em.one("MatMul", [x, weight("ple_gate")])), mine])
    return em.one("Add", [x, norm(em.one("MatMul", [gated, weight("ple_proj")]))])
