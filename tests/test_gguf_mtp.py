"""GLM-4.5's MTP block: a tiny glm4_moe checkpoint with one MTP layer in GLM-4.5's layout (layer L: transformers'
MoE decoder layer + enorm, hnorm, eh_proj, shared_head, embed_tokens; `num_nextn_predict_layers: 1`). From the
safetensors folder, `--drafter mtp`'s graph equals the MTP formula with transformers' layer and greedy MTP == plain;
from llama.cpp's GGUF of it (its converter, f32; skipped without it, as test_gguf_llamacpp.py) the head graph equals
the safetensors one teacher-forced on the same inputs, the target graphs agree, and greedy MTP == plain."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.kvcache import causal_mask
from speccompile.runtime.session import Runner

from conftest import TINY_VOCAB
from test_families import make_family_model
from test_gguf_llamacpp import GGUF_FAMILIES, VOCAB, convert, tokenizers  # noqa: F401 (the fixture)
from test_gguf_llamacpp import pytestmark as needs_converter
from test_mla_drafters import mtp_formula, mtp_graph_logits

GLM_VOCAB = VOCAB + 3  # the "glm" tokenizer: SmolLM2's with GLM's special tokens


def make_glm_with_mtp(folder: Path, vocab: int, tokenizer: Path | None = None):
    """A tiny glm4_moe target of 2 layers whose checkpoint also holds GLM-4.5's MTP layer 2: transformers' own
    (MoE) decoder layer 2 of a 3-layer model, plus random enorm / hnorm / eh_proj / shared_head / embed_tokens.
    Returns the 3-layer transformers model and the MTP-only tensors; `tokenizer`: a folder replacing the character
    tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file

    model = make_family_model(folder, "glm4_moe", families=GGUF_FAMILIES, vocab_size=vocab, num_hidden_layers=3)
    h, p = model.config.hidden_size, "model.layers.2."
    g = torch.Generator().manual_seed(5)
    extra = {p + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g), p + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             p + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
             p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             p + "shared_head.head.weight": 4 * torch.randn(vocab, h, generator=g) / h ** 0.5,
             p + "embed_tokens.weight": torch.randn(vocab, h, generator=g)}
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in {**tensors, **extra}.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    if tokenizer is not None:
        for file in folder.glob("tokenizer*"):
            file.unlink()
        for file in tokenizer.iterdir():
            shutil.copy(file, folder / file.name)
    return model, extra


def _greedy_equals_plain(art: Path) -> int:
    """Greedy MTP == plain on two prompts; the draft steps taken."""
    runner = Runner(art, drafter="mtp", num_draft_tokens=3, adaptive=False, threads=1, lookup_branch=False)
    steps = 0
    for prompt in ([1, 40, 41, 42, 43, 10, 11, 40, 41, 42], [1, 7, 30, 52, 7, 30, 61, 9]):
        spec = runner.generate_ids(prompt, 24)
        assert spec.tokens == runner.generate_ids(prompt, 24, drafter="none").tokens, prompt
        steps += spec.stats.draft_steps
    return steps


def test_glm_mtp_from_safetensors_is_the_mtp_formula(tmp_path):
    """The head's block is the target's own MoE layer (partial rope, q/k norms, biases): its graph, in passes over
    its own cache, within 1e-4 of GLM-4.5's MTP formula with transformers' layer; greedy MTP == plain."""
    import torch

    torch.set_num_threads(1)
    hf, extra = make_glm_with_mtp(tmp_path / "hf", TINY_VOCAB)
    manifest = export_artifact(str(tmp_path / "hf"), tmp_path / "art", ExportOptions(drafter="mtp", max_context=128))
    assert manifest.graphs["target"].num_layers == 2 and manifest.drafter["head"]["layer"]["moe"] is not None
    rng = np.random.default_rng(0)
    ids, features = rng.integers(3, TINY_VOCAB, 12), rng.normal(size=(12, hf.config.hidden_size)).astype(np.float32)
    expected = mtp_formula(hf, extra, ids, features, layer=2)
    error = np.abs(mtp_graph_logits(tmp_path / "art", ids, features) - expected).max(-1) / np.abs(expected).max(-1)
    assert error.max() < 1e-4 and len(set(expected.argmax(-1))) > 3, float(error.max())
    assert _greedy_equals_plain(tmp_path / "art") > 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizers):
    """{"hf": the safetensors folder's artifact, "gguf": that of llama.cpp's GGUF of it}, each with `--drafter mtp`."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("glm_mtp")
    make_glm_with_mtp(root / "hf", GLM_VOCAB, tokenizers["glm"])
    convert(root / "hf", root / "model.gguf")
    arts = {}
    for name, source in (("hf", root / "hf"), ("gguf", root / "model.gguf")):
        manifest = export_artifact(str(source), root / f"art-{name}", ExportOptions(drafter="mtp", max_context=128))
        assert manifest.graphs["target"].num_layers == 2 and manifest.drafter["layout"] == "mtp/deepseek"
        arts[name] = root / f"art-{name}"
    yield arts
    shutil.rmtree(root, ignore_errors=True)


@needs_converter
def test_gguf_mtp_head_equals_the_safetensors_head(exported):
    """Both heads teacher-forced on the same tokens and features, in passes over their own caches: the GGUF's within
    1e-5 of the safetensors'; the two targets agree too (the GGUF's leaves the MTP block out)."""
    rng = np.random.default_rng(0)
    ids, features = rng.integers(3, GLM_VOCAB, 12), rng.normal(size=(12, 64)).astype(np.float32)
    want, got = mtp_graph_logits(exported["hf"], ids, features), mtp_graph_logits(exported["gguf"], ids, features)
    assert want.shape == got.shape == (12, GLM_VOCAB) and len(set(want.argmax(-1))) > 3
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), float(np.abs(got - want).max() / np.abs(want).max())
    seq, logits = rng.integers(3, GLM_VOCAB, 20), []
    for art in exported.values():
        session = open_artifact(art, threads=1).target
        cache = session.new_cache()
        logits.append(session.run(seq, np.arange(20), cache.attention_mask(causal_mask(20)), cache).logits)
    assert np.abs(logits[1] - logits[0]).max() <= 1e-5 * np.abs(logits[0]).max()


@needs_converter
def test_gguf_mtp_greedy_equals_plain(exported):
    assert _greedy_equals_plain(exported["gguf"]) > 0
