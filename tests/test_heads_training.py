"""`speccompile train-draft`: a few CPU steps on a tiny target, resume, and the loaders read the result."""

from __future__ import annotations

import json

from click.testing import CliRunner

from test_heads_helpers import _CACHE, shared_target, training_text


def _target_and_data(tmp_path_factory):
    """The shared tiny target and its self-distillation text (made once per test session)."""
    target = shared_target(tmp_path_factory)
    if "data" not in _CACHE:
        _CACHE["data"] = training_text(tmp_path_factory.mktemp("train_data"), target)
    return target, _CACHE["data"]


def test_train_draft_cli_resume_and_reload(tmp_path, tmp_path_factory):
    import torch

    from speccompile.cli import cli
    from speccompile.models.head_loaders import load_head
    from speccompile.models.load import load_model

    torch.set_num_threads(1)
    target, data = _target_and_data(tmp_path_factory)
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
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang counts layer outputs
    assert list((out / ".cache").glob("features-*.safetensors"))  # resume reused the target features
    model = load_model(str(target))
    head = load_head("eagle3", out, model.config, model.weights)
    assert head.head_config.draft_vocab_size <= model.config.vocab_size


def test_resume_on_other_data_keeps_the_checkpoint_draft_vocabulary(tmp_path, tmp_path_factory):
    """Continuing a run on new text must map labels into the checkpoint's draft vocabulary, not a new one."""
    import numpy as np
    import torch

    from speccompile.cli import cli
    from speccompile.models.load import load_model
    from speccompile.training.data import collect_texts, load_or_compute_features, target_tokenizer, tokenize_chunks
    from speccompile.training.trainer import HeadTrainer, TrainOptions

    torch.set_num_threads(1)
    target, data = _target_and_data(tmp_path_factory)
    out = tmp_path / "head"
    first = CliRunner().invoke(cli, ["train-draft", str(target), "--method", "eagle3", "--data", str(data), "--out", str(out),
                                     "--seq-len", "32", "--batch", "4", "--steps", "3", "--draft-vocab", "16", "--threads", "1"])
    assert first.exit_code == 0, first.output
    other = tmp_path / "other.txt"
    other.write_text(" ".join(str(i) for i in range(400)))  # digits: a different most-predicted set
    options = TrainOptions(method="eagle3", steps=4, batch=4, seq_len=32, draft_vocab=16, resume=True).validate()
    model = load_model(str(target))
    chunks = tokenize_chunks(collect_texts([other]), target_tokenizer(model), 32, options.max_tokens, model.config.bos_token_id)
    trainer = HeadTrainer(model, options, load_or_compute_features(model, chunks, options, tmp_path / "feats", lambda _: None))
    fresh_vocab = np.flatnonzero(trainer.t2d_index >= 0)
    trainer.load(out)
    vocab = trainer.head.draft_to_target().numpy()
    assert not np.array_equal(fresh_vocab, vocab)  # the new text alone would pick other tokens
    assert np.array_equal(trainer.t2d_index[vocab], np.arange(len(vocab)))
    assert (trainer.t2d_index >= 0).sum() == len(vocab)
    trainer.train_step()  # and training goes on with it


def test_more_data_reuses_the_features_of_chunks_already_computed(tmp_path, tmp_path_factory):
    """A run on grown data computes target features only for the new chunks; the reused rows are the ones
    a fresh computation gives."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    from speccompile.models.decoder import build_decoder
    from speccompile.models.load import load_model
    from speccompile.training.data import compute_features
    from speccompile.training.trainer import TrainOptions, train_draft

    torch.set_num_threads(1)
    target, data = _target_and_data(tmp_path_factory)
    more = tmp_path / "more.txt"
    more.write_text(" ".join(str(i) for i in range(300)))
    out = tmp_path / "head"
    options = dict(method="eagle3", batch=4, seq_len=32, draft_vocab=16, max_tokens=100_000, threads=1)
    train_draft(str(target), [data], out, TrainOptions(steps=2, **options))
    said: list[str] = []
    train_draft(str(target), [data, more], out, TrainOptions(steps=3, resume=True, **options), progress=said.append)
    reuse = [m for m in said if m.startswith("reusing target features of")]
    assert len(reuse) == 1, said
    reused, total = map(int, reuse[0].split()[4].split("/"))
    assert 0 < reused < total
    assert sum(m.startswith("target features") for m in said) > 0  # the new chunks were computed
    grown = max((out / ".cache").glob("features-*.safetensors"), key=lambda p: p.stat().st_mtime)
    feats = load_file(str(grown))
    assert feats["tokens"].shape[0] == total
    model = load_model(str(target))
    fresh = compute_features(build_decoder(model.config, model.weights, "eagle3"), feats["tokens"], 8, lambda _: None)
    np.testing.assert_allclose(feats["hidden"].astype(np.float32), fresh["hidden"].astype(np.float32), atol=2e-2)
    assert (feats["top_idx"][..., 0] == fresh["top_idx"][..., 0]).mean() > 0.99
