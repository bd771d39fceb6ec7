"""`speccompile train-draft`: a few CPU steps on a tiny target, resume, and the loaders read the result."""

from __future__ import annotations

import json

from click.testing import CliRunner

from test_heads_helpers import _CACHE, shared_target, training_text


def test_train_draft_cli_resume_and_reload(tmp_path, tmp_path_factory):
    import torch

    from speccompile.cli import cli
    from speccompile.models.heads import load_head
    from speccompile.models.load import load_model

    torch.set_num_threads(1)
    target = shared_target(tmp_path_factory)
    data = _CACHE.get("data") or training_text(tmp_path_factory.mktemp("train_data"), target)
    _CACHE["data"] = data
    out = tmp_path / "head"
    args = ["train-draft", str(target), "--method", "eagle3", "--data", str(data), "--out", str(out),
            "--seq-len", "32", "--batch", "4", "--save-every", "5", "--threads", "1"]
    first = CliRunner().invoke(cli, args + ["--steps", "5"])
    assert first.exit_code == 0, first.output
    assert "trained eagle3 head" in first.output
    assert (out / "model.safetensors").is_file() and (out / "trainer_state.pt").is_file()
    again = CliRunner().invoke(cli, args + ["--steps", "8"])
    assert again.exit_code != 0 and "--resume" in str(again.exception or again.output)
    resumed = CliRunner().invoke(cli, args + ["--steps", "8", "--resume", "--json"])
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads(resumed.output[resumed.output.index("{"):])
    assert summary["steps"] == 8 and summary["train_tokens"] > 0
    assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] == 8
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert list((out / ".cache").glob("features-*.safetensors"))  # resume reused the target features
    model = load_model(str(target))
    head = load_head("eagle3", out, model.config, model.weights)
    assert head.head_config.draft_vocab_size <= model.config.vocab_size
