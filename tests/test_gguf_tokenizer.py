"""A GGUF's `gpt2` tokenizer rebuilt from its vocabulary and merges (models/gguf_tokenizer.py) where transformers
converts none (a `phi2` GGUF): the exported tokenizer gives the original byte-level BPE's ids, special and added
tokens included, and the exported model matches transformers and decodes exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest

from speccompile.errors import SpecCompileError
from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.models.gguf_tokenizer import PRE_SPLITS
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
    """A `gpt2` tokenizer whose pre-tokenizer is neither GPT-2's regex nor one of `PRE_SPLITS` (here Mistral Nemo's
    "tekken") is refused in one line."""
    assert "tekken" not in PRE_SPLITS
    _write(tmp_path, monkeypatch, pre="tekken")
    with pytest.raises(SpecCompileError, match="tokenizer could not be converted"):
        export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=96))


# llama.cpp's own tokenizer (llama-cpp-python, built as benchmarks/peer_llamacpp.py says): a python that imports it
LLAMACPP_RUNTIME = os.environ.get("SPECCOMPILE_LLAMACPP_RUNTIME_PYTHON", "")
SPLIT_TEXTS = ["Hello world! It's 12345 apples, 3.14159... and 1,000,000.", "你好世界，こんにちは カタカナ 한국어 텍스트",
               "  two  spaces\nand a line\n\n\tindented\ttabs   \n", "def f(x):\n    return x**2  # comment!!!???\n",
               "Café naïve résumé — “quotes” ‘single’ «guillemets»", "URL: https://example.com/a?b=c&d=e#frag",
               "    leading and trailing    ", "Ελληνικά и кириллица", "😀 emoji 🚀 test", "'s 't 're 've 'm 'll 'd"]


@pytest.mark.parametrize("pre", sorted(PRE_SPLITS))
def test_deepseek_splits_are_used_not_gpt2s(tmp_path, monkeypatch, pre):
    """A DeepSeek `pre` (V3 / R1 / Moonlight's "deepseek-v3", V2's "deepseek-llm") or StarCoder's ("starcoder",
    "refact") exports with llama.cpp's regex list for it instead of being refused, and the list changes the pieces:
    GPT-2's regex keeps "12345" in one piece, DeepSeek-V3's cuts digits in threes, StarCoder's one by one, V2's cuts
    "\\n" off on its own."""
    _write(tmp_path, monkeypatch, pre=pre)
    export_artifact(str(tmp_path / "g" / "model.gguf"), tmp_path / "art", ExportOptions(max_context=96))
    from tokenizers import Tokenizer

    split = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json")).pre_tokenizer
    pieces = [p for p, _ in split.pre_tokenize_str("a 12345\nb")]
    gpt2 = [p for p, _ in Tokenizer.from_str(_bpe()._tokenizer.to_str()).pre_tokenizer.pre_tokenize_str("a 12345\nb")]
    assert pieces != gpt2 and "".join(pieces) == "".join(gpt2)
    digits = {"deepseek-v3": ["123", "45"], "starcoder": list("12345"), "refact": list("12345")}
    assert ("Ġ12345" in gpt2) and (digits[pre] == [p for p in pieces if p.isdigit()] if pre in digits else "Ċ" in pieces)


@pytest.mark.skipif(not LLAMACPP_RUNTIME, reason="needs llama.cpp's tokenizer: SPECCOMPILE_LLAMACPP_RUNTIME_PYTHON, a "
                    "python with llama-cpp-python (benchmarks/peer_llamacpp.py says how to build it)")
@pytest.mark.parametrize("pre", sorted(PRE_SPLITS))
def test_deepseek_splits_tokenize_as_llama_cpp(tmp_path, pre):
    """Oracle: a vocabulary-only GGUF with SmolLM2's 49152-token BPE and a DeepSeek `pre`, tokenized by llama.cpp
    itself and by the tokenizer.json written from it: the same ids for every text (scripts, digits, spaces, code)."""
    import json
    import subprocess

    import gguf
    from tokenizers import Tokenizer

    from speccompile.models.gguf_tokenizer import gpt2_tokenizer_files
    from speccompile.models.load import load_model

    load_model("smollm2-135m").write_tokenizer(tmp_path / "bpe")
    model = json.loads((tmp_path / "bpe" / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 128), (writer.add_embedding_length, 64), (writer.add_block_count, 1),
                       (writer.add_feed_forward_length, 64), (writer.add_head_count, 1), (writer.add_head_count_kv, 1),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_tokenizer_model, "gpt2"), (writer.add_tokenizer_pre, pre),
                       (writer.add_token_list, tokens), (writer.add_token_types, [1] * len(tokens)), (writer.add_bos_token_id, 0),
                       (writer.add_token_merges, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]])):
        add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    gpt2_tokenizer_files(gguf.GGUFReader(str(path)), path, tmp_path / "ours")
    ours = Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json"))
    script = ("import json, sys, llama_cpp; llm = llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False); "
              "print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=False) for t in json.load(sys.stdin)]))")
    done = subprocess.run([LLAMACPP_RUNTIME, "-c", script, str(path)], input=json.dumps(SPLIT_TEXTS), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for text, theirs in zip(SPLIT_TEXTS, json.loads(done.stdout)):
        assert ours.encode(text, add_special_tokens=False).ids == theirs, text
