"""MiniMax-01 lightning attention (models/lightning.py): the per-token recurrence against transformers'
MiniMaxLightningAttention, its block-wise prefill over several blocks (the last one partial) and its cached path, at
every position; the runtime's zero first pending row leaves zero states zero."""

from __future__ import annotations

import pytest
import torch

from speccompile.models.lightning import Lightning
from speccompile.models.linear_config import HybridConfig

minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")

HEADS, HEAD_DIM, HIDDEN, LAYERS = 2, 8, 32, 4


def _pair(layer: int) -> tuple[torch.nn.Module, Lightning]:
    """transformers' layer `layer` of LAYERS (block_size 4) with random weights, and the reference with the same."""
    from transformers import MiniMaxConfig
    config = MiniMaxConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, num_hidden_layers=LAYERS,
                           block_size=4, layer_types=["linear_attention"] * LAYERS)
    torch.manual_seed(layer)
    theirs = minimax.MiniMaxLightningAttention(config, layer).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = Lightning(HIDDEN, HybridConfig(linear=[True] * LAYERS, kind="lightning", num_v_heads=HEADS, k_dim=HEAD_DIM,
                                          v_dim=HEAD_DIM), layer).eval()
    assert not ours.load_state_dict(theirs.state_dict(), strict=False).missing_keys
    return theirs, ours


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_recurrence_matches_blockwise_prefill_at_every_position(layer: int) -> None:
    theirs, ours = _pair(layer)
    x = torch.randn(2, 11, HIDDEN)  # blocks of 4, 4, 3
    with torch.no_grad():
        want, kv = theirs(x, None, None)
        state, placeholder = ours.empty_states(2, torch.float32)
        got, states, _ = ours(x, {}, {}, state, placeholder)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    assert torch.allclose(states[:, -1], kv, atol=1e-5, rtol=1e-4)
    for t in range(1, 11):  # each prefix alone: the output at every position and the state after it
        with torch.no_grad():
            prefix, kv_t = theirs(x[:, :t], None, None)
        assert torch.allclose(got[:, :t], prefix, atol=1e-5, rtol=1e-4)
        assert torch.allclose(states[:, t - 1], kv_t, atol=1e-5, rtol=1e-4)


def test_passes_from_the_cache_match_transformers_cached_path() -> None:
    theirs, ours = _pair(1)
    x = torch.randn(1, 9, HIDDEN)
    cache = minimax.MiniMaxCache()
    with torch.no_grad():
        want = torch.cat([theirs(x[:, a:b], None, None, cache=cache)[0] for a, b in ((0, 5), (5, 6), (6, 9))], dim=1)
        state, placeholder = ours.empty_states(1, torch.float32)
        outs = []
        for a, b in ((0, 2), (2, 7), (7, 9)):
            out, states, _ = ours(x[:, a:b], {}, {}, state, placeholder)
            outs.append(out)
            state = states[:, -1]
    assert torch.allclose(torch.cat(outs, dim=1), want, atol=1e-5, rtol=1e-4)


def test_zero_row_leaves_zero_states() -> None:
    _, ours = _pair(0)
    zero = torch.zeros(1, HEADS, HEAD_DIM)
    out, state = ours.step(zero, zero, zero, torch.zeros(1, HEADS, HEAD_DIM, HEAD_DIM))
    assert not state.any() and not out.any()
    assert HybridConfig(kind="lightning", num_v_heads=HEADS, v_dim=HEAD_DIM).state_kinds() == ("recurrent", "rows")
