"""A drafter checkpoint in a layout not understood is one line naming the key or flag not expected (exit code 2);
pickled weights are read with torch.load(weights_only=True) only."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli_here
from test_heads_helpers import published_tensors, shared_target, write_checkpoint


def one_error_line(code: int, err: str, *needles: str) -> None:
    """Exit code 2, no traceback, the last line the error (export's progress lines come before it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines[-1].startswith("error: ") and "Traceback" not in err, (code, err)
    for needle in needles:
        assert needle in lines[-1], err


def _speculators(folder, **changes):
    """Our random EAGLE-3 checkpoint with its config in the speculators layout, then `changes` applied."""
    config, _ = published_tensors("eagle3")
    write_checkpoint(folder, "eagle3")
    layer = {k: config[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                    "num_key_value_heads", "rms_norm_eps", "vocab_size")}
    raw = {"speculators_model_type": "eagle3", "transformer_layer_config": {**layer, "num_hidden_layers": 1},
           "draft_vocab_size": config["draft_vocab_size"], "norm_before_residual": False}
    for key, value in changes.items():
        if key.startswith("layer_"):
            raw["transformer_layer_config"][key[len("layer_"):]] = value
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


BAD = {
    "unknown flag": (dict(norm_everything=True), ["'norm_everything'", "not understood", "norm_before_fc"]),
    "other kind": (dict(speculators_model_type="eagle"), ["speculators_model_type 'eagle'", "'eagle3'"]),
    "layer type": (dict(layer_model_type="gemma2"), ["transformer_layer_config.model_type 'gemma2'", "qwen3"]),
    "layer count": (dict(layer_num_hidden_layers=2), ["transformer_layer_config.num_hidden_layers is 2", "1 draft layers"]),
    "taps": (dict(eagle_aux_hidden_state_layer_ids=[1, 1, 3]), ["eagle_aux_hidden_state_layer_ids [1, 1, 3]", "distinct"]),
    "both norms": (dict(norm_before_fc=True, fc_norm=True), ["norm_before_fc and fc_norm"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_layout_not_understood_is_one_line(case, capsys, tmp_path, tmp_path_factory):
    changes, needles = BAD[case]
    head = _speculators(tmp_path / "head", **changes)
    target = shared_target(tmp_path_factory)
    code, _, err = run_cli_here(capsys, "export", str(target), "--out", str(tmp_path / "art"), "--drafter", f"eagle3:{head}")
    one_error_line(code, err, *needles)
    assert not (tmp_path / "art").exists()


def test_pickled_weights_are_tensors_only(capsys, tmp_path, tmp_path_factory):
    """pytorch_model.bin loads through weights_only=True; a pickle holding anything but tensors is refused."""
    from speccompile.models.head_loaders import load_head
    from speccompile.models.load import load_model

    model = load_model(str(shared_target(tmp_path_factory)))
    config, tensors = published_tensors("eagle3")
    good = tmp_path / "good"
    good.mkdir()
    torch.save(tensors, good / "pytorch_model.bin")
    (good / "config.json").write_text(json.dumps(config))
    head = load_head("eagle3", good, model.config, model.weights)
    assert torch.equal(head.state_dict()["fc.weight"], tensors["fc.weight"])
    assert head.head_config.layout == "eagle3/flat (EAGLE authors' pytorch_model.bin)"
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({**tensors, "note": {"optimizer": [1, 2]}}, bad / "pytorch_model.bin")
    (bad / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli_here(capsys, "export", str(shared_target(tmp_path_factory)), "--out", str(tmp_path / "art"),
                                "--drafter", f"eagle3:{bad}")
    one_error_line(code, err, "pytorch_model.bin", "state dict of tensors")
