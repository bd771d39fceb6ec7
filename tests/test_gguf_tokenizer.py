"""A GGUF's `gpt2` tokenizer rebuilt from its vocabulary and merges (models/gguf_tokenizer.py) where transformers
converts none (a `phi2` GGUF): the exported tokenizer gives the original byte-level BPE's ids, special and added
tokens included, and the exported model matches transformers and decodes exactly."""

from __future__ import annotations

import numpy as np
import pytest

from speccompile.errors import SpecCompileError
from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

import test_families
from conftest import write_gguf
from test_families import _check_graph, make_family_model

TEXTS = ["the cat sat on the mat.", "hello there, hello there!", "  two  spaces\nand a line", "abc    abd<|endoftext|>x",
         "0123 0123 unseen wörds ü"]


def _bpe():
    """A small byte-level BPE trained here (GPT-2's pre-tokenizer), a control token and a user-defined added token."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cat sat on the mat. hello there, hello there! abc abd abc abd 0123 0123"] * 50,
                            vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.add_tokens([AddedToken("    ", normalized=False)])
    return bpe


def _write(tmp_path, monkeypatch, pre: str = "phi-2"):
    import json

    bpe = _bpe()
    model = json.loads(bpe._tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(bpe.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])]
    types = [3 if t == "<|endoftext|>" else 4 if t == "    " else 1 for t in tokens]

    def metadata(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges([" ".join(m) for m in model["merges"]])
        writer.add_token_types(types)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(0)

    monkeypatch.setitem(test_families.FAMILIES, "phi-bpe", dict(model_type="phi", hidden_size=128, head_dim=32, vocab_size=len(tokens),
                                                                bos_token_id=0, eos_token_id=0, pad_token_id=0))
    hf = make_family_model(tmp_path / "hf", "phi-bpe")
    (tmp_path / "g").mkdir()
    write_gguf(tmp_path / "g" / "model.gguf", tmp_path / "hf", arch="phi2", metadata=metadata)
    return bpe, hf


def test_phi2_gguf_exports_with_its_bpe_tokenizer(tmp_path, monkeypatch):
    bpe, hf = _write(tmp_path, monkeypatch)
    export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=96))
    artifact = open_artifact(tmp_path / "art", threads=1)
    tokenizer = artifact.tokenizer
    for text in TEXTS:
        want = bpe.encode(text).ids
        assert tokenizer.encode(text) == want, text
        assert tokenizer.decode(want) == text.replace("<|endoftext|>", "")  # special tokens are not text
    assert tokenizer.encode("<|endoftext|>") == [0] and tokenizer.eos_token_ids == [0]
    seq = [int(t) for t in np.random.default_rng(1).integers(3, 280, 26)]
    _check_graph(artifact.target, hf, seq, 7, "phi2 gguf fused")
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=24).tokens == runner.generate(prompt, chat=False, max_tokens=24, drafter="none").tokens


def test_a_bpe_with_another_split_is_not_guessed(tmp_path, monkeypatch):
    """A `gpt2` tokenizer whose pre-tokenizer is not GPT-2's regex (here Qwen2's) is refused in one line."""
    _write(tmp_path, monkeypatch, pre="qwen2")
    with pytest.raises(SpecCompileError, match="tokenizer could not be converted"):
        export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=96))
