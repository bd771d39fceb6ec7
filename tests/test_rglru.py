"""RecurrentGemma's recurrent block (models/rglru.py) against transformers' RecurrentGemmaRecurrentBlock (fp32, its
non-cuda scan) at every position, from position 0 (the reset) and in chain passes from committed states; the
runtime's zero pending row leaves zero states as they are; its config reader's fields and refusals (rglru_config.py)."""

from __future__ import annotations

import pytest

_CONFIG = dict(hidden_size=64, lru_width=64, num_attention_heads=2, num_hidden_layers=3, intermediate_size=96, conv1d_width=4,
               vocab_size=96, attention_window_size=8)


def _blocks():
    import torch
    import transformers
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

    from speccompile.models.rglru import RgLru
    from speccompile.models.rglru_config import rglru_from_hf

    hf = RecurrentGemmaRecurrentBlock(transformers.RecurrentGemmaConfig(**_CONFIG), 0).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    ours = RgLru(64, rglru_from_hf(_CONFIG, 3, "config.json")["hybrid"]).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_rglru_block_matches_transformers_at_every_position():
    """A prefill of 12 rows from position 0 (transformers resets there), chain passes of 3 + 4 + 1 rows from the
    committed states: within 1e-5 of transformers' whole-sequence forward; one row a pass within 1e-5 of the
    prefill's rows; a zero row with zero flags (the runtime's first pending row) leaves zero states as they are."""
    import torch

    hf, ours = _blocks()
    x = torch.randn(1, 20, 64)
    with torch.no_grad():
        want, _ = hf(x, torch.arange(20)[None], None, use_cache=False)
        conv, state = ours.empty_states(1, torch.float32)
        got, start = [], 0
        for q in (12, 3, 4, 1):
            out, convs, states = ours(x[:, start:start + q], {"positions": torch.arange(start, start + q)[None]}, {}, conv, state)
            got.append(out)
            conv, state, start = convs[:, -1], states[:, -1], start + q
        got = torch.cat(got, dim=1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        conv, state = ours.empty_states(1, torch.float32)
        for t in range(12):  # one row a pass
            out, convs, states = ours(x[:, t:t + 1], {"positions": torch.tensor([[t]])}, {}, conv, state)
            torch.testing.assert_close(out[0, 0], got[0, t], rtol=1e-6, atol=1e-5)
            conv, state = convs[:, -1], states[:, -1]
        zero = ours.empty_states(1, torch.float32)
        _, conv, state = ours.step(torch.zeros(1, 64), torch.zeros(1, 2), *zero)
        assert not conv.any() and not state.any()
        assert ours.step(torch.zeros(1, 64), torch.tensor([[0.0, 1.0]]), *zero)[2].any()  # the conv bias: position 0 is not a no-op


def test_rglru_config_keys_and_refusals():
    """RecurrentGemma's config.json keys as transformers writes them read through the table (config_from_hf): the
    recurrent block's fields, Gemma's norms, the MLP's width and biases, the bf16 embedding scale, soft-capping, the
    local window; what is not built refused in one line."""
    from speccompile.errors import UnsupportedError
    from speccompile.models.config import config_from_hf
    from speccompile.models.rglru_config import rglru_from_hf

    raw = dict(_CONFIG, model_type="recurrent_gemma", num_hidden_layers=5, num_key_value_heads=1, rms_norm_eps=1e-6,
               hidden_activation="gelu_pytorch_tanh", logits_soft_cap=30.0, tie_word_embeddings=True, attention_bias=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
               block_types=["recurrent", "recurrent", "attention"], max_position_embeddings=512)
    cfg = config_from_hf(raw, "config.json")
    hy = cfg.hybrid
    assert (hy.kind, hy.linear, hy.width, hy.num_v_heads, hy.conv_kernel, hy.conv_bias) == ("rglru", [True, True, False, True, True], 64, 2, 4, True)
    assert (hy.row_width(), hy.conv_state_shape(), hy.recurrent_state_shape(), hy.state_kinds()) == (66, (64, 3), (64,), ("conv", "recurrent", "rows"))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.sliding_window, cfg.intermediate_size, cfg.num_key_value_heads) == (32, 16, 8, 48, 1)
    assert cfg.sliding(2) and cfg.final_softcap == 30.0 and cfg.embed_scale == 8.0 and cfg.norm_offset == 1.0 and cfg.mlp_act == "gelu_tanh"
    assert cfg.o_proj_bias and cfg.mlp_bias and cfg.mlp_gated and cfg.tie_word_embeddings
    assert {"lru_y", "lru_a_gate", "gate_up_bias", "down_bias"} <= set(cfg.layer_roles(0)) and "qkv" not in cfg.layer_roles(0)
    assert {"qkv", "o_proj", "o_bias", "gate_up_bias"} <= set(cfg.layer_roles(2)) and "lru_y" not in cfg.layer_roles(2)
    assert rglru_from_hf(dict(_CONFIG, hidden_size=2560, lru_width=2560), 3, "c")["embed_scale"] == 50.5  # sqrt(2560) in bfloat16, as transformers
    for key, value, what in (("hidden_activation", "silu", "hidden_activation 'silu'"), ("attention_bias", True, "attention_bias true"),
                             ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope_type 'linear'"),
                             ("lru_width", 63, "lru_width 63 not a multiple"), ("block_types", ["recurrent", "mlp"], "block_types 'mlp'")):
        with pytest.raises(UnsupportedError, match=what):
            config_from_hf({**raw, key: value}, "config.json")
