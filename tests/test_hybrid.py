"""Hybrid linear attention (Qwen3-Next, Qwen3.5 text and MoE: gated delta nets beside gated full attention) against
transformers' fp32 eager forward on tiny random checkpoints: the torch reference at every position of a prefill, of
chain passes continuing from the committed states, and one row a pass."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_VOCAB
from test_families import _close, _hf_logits, make_family_model

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_LINEAR = dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
HYBRID = {  # layers 0-2 gated delta nets (value heads twice the key heads), layer 3 gated full attention
    "qwen3_next": dict(_LINEAR, **_MOE, decoder_sparse_step=2),  # MoE on layers 1 and 3 (a shared expert), dense 0 and 2
    "qwen3_5_text": dict(_LINEAR),
    "qwen3_5_moe_text": dict(_LINEAR, **_MOE),
}


def _reference(folder):
    from speccompile.models.decoder import build_decoder
    from speccompile.models.load import load_model

    loaded = load_model(str(folder))
    return build_decoder(loaded.config, loaded.weights)


def _pass(decoder, ids: list[int], start: int, past: list) -> tuple[np.ndarray, list]:
    """One pass of rows `ids` at positions start..; the cache after all its rows (a chain: every row accepted)."""
    import torch

    from speccompile.models.decoder import causal_mask

    q = len(ids)
    mask = causal_mask(q, start)
    with torch.no_grad():
        out = decoder(torch.tensor([ids]), torch.arange(start, start + q)[None], mask, *past)
    presents, committed = list(out[1:]), []
    for i in range(decoder.config.num_hidden_layers):
        pair = presents[2 * i:2 * i + 2]
        committed += [t[:, -1] for t in pair] if decoder.config.linear(i) else pair
    return out[0][0].numpy(), committed


@pytest.mark.parametrize("name", list(HYBRID))
def test_torch_reference_matches_transformers(tmp_path, name):
    hf = make_family_model(tmp_path / "hf", name, families=HYBRID)
    decoder = _reference(tmp_path / "hf")
    assert [decoder.config.linear(i) for i in range(4)] == [True, True, True, False]
    seq = [int(t) for t in np.random.default_rng(1).integers(3, TINY_VOCAB, 26)]
    full = _hf_logits(hf, seq)
    logits, _ = _pass(decoder, seq, 0, decoder.empty_past())
    _close(logits, full, f"{name} prefill")
    rows, past = _pass(decoder, seq[:20], 0, decoder.empty_past())
    chained = [rows]
    for start in (20, 23):  # chain passes from the committed states
        rows, past = _pass(decoder, seq[start:start + 3], start, past)
        chained.append(rows)
    _close(np.concatenate(chained), full, f"{name} chain passes")
    one, past = [], decoder.empty_past()  # plain decoding, one row a pass
    for t, token in enumerate(seq[:8]):
        rows, past = _pass(decoder, [token], t, past)
        one.append(rows)
    _close(np.concatenate(one), full[:8], f"{name} one row a pass")


def test_export_refuses_in_one_line(tmp_path):
    """Until its graphs are built, exporting a hybrid checkpoint is refused in one line, exit 2, nothing written."""
    from conftest import run_cli

    make_family_model(tmp_path / "hf", "qwen3_5_text", families=HYBRID)
    done = run_cli("export", str(tmp_path / "hf"), "--out", str(tmp_path / "art"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "hybrid linear attention" in errors[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "art").exists()
