"""Per-layer embeddings (Gemma 4's PLE) in the torch reference: a second embedding of every token, one vector of
`per_layer_input_size` values per decoder layer, mixed with a projection of the main embedding; each layer adds a
gated projection of its vector to the residual stream after its MLP (transformers' Gemma4TextModel
get_per_layer_inputs / project_per_layer_inputs and Gemma4TextDecoderLayer's per_layer_input block).

    inputs   (norm(reshape(embeds @ W_proj * hidden ** -0.5)) + reshape(table[ids] * sqrt(P))) * 2 ** -0.5
             [b, q, layers, P]  (embeds: the main embedding, already scaled)
    layer i  x + norm_i(proj_i(act(gate_i(x)) * inputs[:, :, i]))
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .feed_forward import activation
from .trace_ops import static_reshape


def per_layer_modules(config: ModelConfig, norm_of: Callable) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The model-level modules (`model.` names as transformers': embed_tokens_per_layer, per_layer_model_projection,
    per_layer_projection_norm); `norm_of(config, size)`: the family's norm (models.decoder.norm_of)."""
    width = config.num_hidden_layers * config.per_layer_input_size
    return (nn.Embedding(config.per_layer_vocab_size, width), nn.Linear(config.hidden_size, width, bias=False),
            norm_of(config, config.per_layer_input_size))


def per_layer_inputs(model: nn.Module, config: ModelConfig, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Every layer's per-layer input [b, q, layers, P] of the tokens `input_ids` and their scaled embeddings
    `embeds` (`model`: the DecoderModel holding `per_layer_modules`); multipliers rounded to the model dtype."""
    layers, width, dtype = config.num_hidden_layers, config.per_layer_input_size, embeds.dtype
    if config.per_layer_vocab_size < config.vocab_size:  # Gemma 3n: tokens past the table read its row 0
        input_ids = torch.where(input_ids < config.per_layer_vocab_size, input_ids, 0)
    tokens = model.embed_tokens_per_layer(input_ids) * torch.tensor(width ** 0.5, dtype=dtype)
    projected = model.per_layer_model_projection(embeds) * torch.tensor(config.hidden_size ** -0.5, dtype=dtype)
    projected = model.per_layer_projection_norm(static_reshape(projected, 0, -1, layers, width))
    return (projected + static_reshape(tokens, 0, -1, layers, width)) * torch.tensor(2 ** -0.5, dtype=dtype)


def attach_per_layer_block(layer: nn.Module, config: ModelConfig, norm_of: Callable) -> None:
    """Give decoder layer `layer` its per-layer input block under transformers' names (per_layer_input_gate,
    per_layer_projection, post_per_layer_input_norm)."""
    layer.per_layer_input_gate = nn.Linear(config.hidden_size, config.per_layer_input_size, bias=False)
    layer.per_layer_projection = nn.Linear(config.per_layer_input_size, config.hidden_size, bias=False)
    layer.post_per_layer_input_norm = norm_of(config)


def per_layer_block(layer: nn.Module, config: ModelConfig, x: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
    """x + norm(proj(act(gate(x)) * per_layer)): the residual stream after layer `layer`'s block."""
    gated = activation(layer.per_layer_input_gate(x), config.mlp_act) * per_layer
    return x + layer.post_per_layer_input_norm(layer.per_layer_projection(gated))
