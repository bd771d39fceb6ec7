"""GLM-4.5's MTP (nextn) block read from a GGUF written by llama.cpp's converter: a tiny glm4_moe checkpoint with one
MTP layer in GLM-4.5's layout (layer L: a decoder layer + enorm, hnorm, eh_proj, shared_head, embed_tokens;
`num_nextn_predict_layers: 1`) -> the converter (f32) -> `export FILE.gguf --drafter mtp`. The head graph equals the
one exported from the safetensors folder (teacher-forced on the same inputs), which equals the MTP formula with
transformers' layer; the target graphs agree; greedy MTP speculative decoding from the GGUF artifact equals plain. Skips without the converter (test_gguf_llamacpp.py)."""

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

from test_families import make_family_model
from test_mla_drafters import mtp_formula, mtp_graph_logits
from test_gguf_llamacpp import GGUF_FAMILIES, VOCAB, convert, pytestmark, tokenizers  # noqa: F401 (the skip, the fixture)

GLM_VOCAB = VOCAB + 3  # the "glm" tokenizer: SmolLM2's with GLM's special tokens


def make_glm_with_mtp(folder: Path, tokenizer: Path):
    """A tiny glm4_moe target of 2 layers whose checkpoint also holds GLM-4.5's MTP layer 2: transformers' own
    (MoE) decoder layer 2 of a 3-layer model, plus random enorm / hnorm / eh_proj / shared_head / embed_tokens.
    Returns the 3-layer transformers model and the MTP-only tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    model = make_family_model(folder, "glm4_moe", families=GGUF_FAMILIES, vocab_size=GLM_VOCAB, num_hidden_layers=3)
    h, p = model.config.hidden_size, "model.layers.2."
    g = torch.Generator().manual_seed(5)
    extra = {p + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g), p + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             p + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
             p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             p + "shared_head.head.weight": 4 * torch.randn(GLM_VOCAB, h, generator=g) / h ** 0.5,
             p + "embed_tokens.weight": torch.randn(GLM_VOCAB, h, generator=g)}
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in {**tensors, **extra}.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    for file in folder.glob("tokenizer*"):
        file.unlink()
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return model, extra


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizers):
    """(the transformers model, the MTP tensors, {"hf": the safetensors folder's artifact, "gguf": that of llama.cpp's
    GGUF of it}), each exported with `--drafter mtp`."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("glm_mtp")
    hf, extra = make_glm_with_mtp(root / "hf", tokenizers["glm"])
    convert(root / "hf", root / "model.gguf")
    arts = {}
    for name, source in (("hf", root / "hf"), ("gguf", root / "model.gguf")):
        manifest = export_artifact(str(source), root / f"art-{name}", ExportOptions(drafter="mtp", max_context=128))
        assert manifest.graphs["target"].num_layers == 2 and manifest.drafter["layout"] == "mtp/deepseek"
        arts[name] = root / f"art-{name}"
    yield hf, extra, arts
    shutil.rmtree(root, ignore_errors=True)


def test_gguf_mtp_head_equals_the_safetensors_head(exported):
    """Both heads teacher-forced on the same tokens and features: the GGUF's within 1e-5 of the safetensors', that
    within 1e-4 of GLM-4.5's MTP formula with transformers' layer; the two targets agree too."""
    hf, extra, arts = exported
    rng = np.random.default_rng(0)
    ids, features = rng.integers(3, GLM_VOCAB, 12), rng.normal(size=(12, hf.config.hidden_size)).astype(np.float32)
    want, got = mtp_graph_logits(arts["hf"], ids, features), mtp_graph_logits(arts["gguf"], ids, features)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), float(np.abs(got - want).max() / np.abs(want).max())
    expected = mtp_formula(hf, extra, ids, features, layer=2)
    error = np.abs(want - expected).max(-1) / np.abs(expected).max(-1)
    assert error.max() < 1e-4 and len(set(expected.argmax(-1))) > 3, float(error.max())
    seq, logits = rng.integers(3, GLM_VOCAB, 20), []
    for art in arts.values():  # the GGUF's target leaves the MTP block out
        session = open_artifact(art, threads=1).target
        cache = session.new_cache()
        logits.append(session.run(seq, np.arange(20), cache.attention_mask(causal_mask(20)), cache).logits)
    assert np.abs(logits[1] - logits[0]).max() <= 1e-5 * np.abs(logits[0]).max()


def test_gguf_mtp_greedy_equals_plain(exported):
    runner = Runner(exported[2]["gguf"], drafter="mtp", num_draft_tokens=3, adaptive=False, threads=1, lookup_branch=False)
    steps = 0
    for prompt in ("abc abd abc abd abc", "the cat sat on the mat"):
        spec = runner.generate(prompt, chat=False, max_tokens=24)
        assert spec.tokens == runner.generate(prompt, chat=False, max_tokens=24, drafter="none").tokens, prompt
        steps += spec.stats.draft_steps
    assert steps > 0
