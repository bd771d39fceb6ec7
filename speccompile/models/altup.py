"""Gemma 3n's layer in the torch reference (transformers' Gemma3nTextModel / Gemma3nTextDecoderLayer): AltUp's
parallel residual streams, LAuReL's low-rank residual and the Gaussian top-k of the MLP gate.

    streams    s_0 = embeds; s_k = rescale(embeds @ W_k) (k = 1 .. n-1)            [n, b, q, hidden]
               rescale(p) = p * rms(embeds) / sqrt(max(mean(p ** 2), 1e-5))  (rms: mean(x ** 2) ** 0.5)
    layer i    m = tanh(router(router_norm(s_0) / hidden))                             the stream weights [b, q, n]
               pred_j = s_j + sum_k C(m)[j, k] s_k                                     predict (C: prediction_coefs)
               h = input_norm(pred_0); lau = h + laurel_norm(h @ L @ R)
               x = ((pred_0 + post_attn_norm(attn(h))) + lau) / sqrt(2)
               out = x + post_mlp_norm(mlp(post_norm(x)))
               s'_j = pred_j + (out - pred_0) * (corr(m') + 1)[j]                        correct (m' from out)
               s'_j += ple_norm(proj(act(gate(s'_0 * scale)) * per_layer_i))  for j >= 1
    final      mean(s_0, rescale(s_1 @ U_1), ...), each rescaled to s_0's rms; then the final norm
    top-k      gate -> relu(gate - (mean(gate) + std(gate) * Phi^-1(sparsity))) per row (the first layers' MLP;
               models/feed_forward.py `gaussian_topk`)

Everything is per row (a token's streams, norms, means), so a position computes the same values in any pass.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .feed_forward import activation


class AltUp(nn.Module):
    """A layer's AltUp coefficients under transformers' names (`altup.*`)."""

    def __init__(self, config: ModelConfig, norm_of: Callable):
        super().__init__()
        n, hidden = config.altup_inputs, config.hidden_size
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(hidden, n, bias=False)
        self.router_norm = norm_of(config)
        self.n, self.hidden = n, hidden

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * torch.tensor(1.0 / self.hidden, dtype=x.dtype))
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        modalities = self.modalities(streams[0])
        coefs = self.prediction_coefs(modalities)
        coefs = coefs.reshape(*coefs.shape[:-1], self.n, self.n).transpose(-1, -2)  # [b, q, k, j] = C[j, k]
        return torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2) + streams

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0
        return (activated - predictions[0]).unsqueeze(0) * coefs.permute(2, 0, 1).unsqueeze(-1) + predictions


class Laurel(nn.Module):
    """LAuReL under transformers' names (`laurel.*`): h + norm(h @ left @ right)."""

    def __init__(self, config: ModelConfig, norm_of: Callable):
        super().__init__()
        self.linear_left = nn.Linear(config.hidden_size, config.laurel_rank, bias=False)
        self.linear_right = nn.Linear(config.laurel_rank, config.hidden_size, bias=False)
        self.post_laurel_norm = norm_of(config)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.post_laurel_norm(self.linear_right(self.linear_left(h)))


def attach_altup(layer: nn.Module, config: ModelConfig, norm_of: Callable) -> None:
    """Give decoder layer `layer` its AltUp and LAuReL modules."""
    layer.altup = AltUp(config, norm_of)
    layer.laurel = Laurel(config, norm_of)


def altup_projections(config: ModelConfig) -> tuple[nn.ModuleList, nn.ModuleList]:
    """The model-level projections into and out of the streams (`model.altup_projections` / `altup_unembed_projections`)."""
    hidden = config.hidden_size
    return tuple(nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(config.altup_inputs - 1)) for _ in "io")


def soft_token_embeds(model: nn.Module, config: ModelConfig, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The scaled embeddings `x` with the wrapper's image / audio tokens (ids >= soft_token_offset) taken from
    `model.soft_token_embeds` (models/soft_tokens.py)."""
    soft = input_ids >= config.soft_token_offset
    rows = model.soft_token_embeds((input_ids - config.soft_token_offset).clamp(min=0))
    return torch.where(soft.unsqueeze(-1), rows.to(x.dtype), x)


def _rescaled(p: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    magnitude = torch.sqrt(torch.mean(p ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return p * target / magnitude


def altup_streams(projections: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """The streams [n, b, q, hidden] of the scaled embeddings `x`."""
    target = torch.mean(x ** 2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([x, *(_rescaled(proj(x), target) for proj in projections)])


def altup_merge(unembed: nn.ModuleList, streams: torch.Tensor) -> torch.Tensor:
    """The streams' mean, each stream past the first projected back and rescaled to the first's rms."""
    target = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([streams[0], *(_rescaled(proj(streams[k + 1]), target) for k, proj in enumerate(unembed))]).mean(0)


def altup_layer(layer: nn.Module, config: ModelConfig, streams: torch.Tensor, attend: Callable, per_layer: torch.Tensor):
    """Decoder layer `layer` (a models.decoder.DecoderLayer with `attach_altup`'s modules) on the streams;
    `attend(h) -> (out, k_all, v_all)`: its attention on the normed active stream. Returns (streams, k_all, v_all)."""
    predictions = layer.altup.predict(streams)
    active = predictions[0]
    h = layer.input_layernorm(active)
    attn, k_all, v_all = attend(h)
    x = (active + layer.post_attn_norm(attn) + layer.laurel(h)) / math.sqrt(2)
    x = x + layer.post_mlp_norm(layer.mlp(layer.post_attention_layernorm(x)))
    corrected = layer.altup.correct(predictions, x)
    first = corrected[0] * layer.altup.correct_output_scale
    gated = activation(layer.per_layer_input_gate(first), config.mlp_act) * per_layer
    added = layer.post_per_layer_input_norm(layer.per_layer_projection(gated))
    return torch.cat([corrected[:1], corrected[1:] + added]), k_all, v_all
