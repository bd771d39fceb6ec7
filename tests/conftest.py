"""Shared fixtures: tiny random Hugging Face models (with a char-level tokenizer) and their exports."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHARS = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}<>=+-*/_|\n")
SPECIAL = ["<unk>", "<s>", "</s>"]
TINY_VOCAB = 96
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def write_char_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A character-level `tokenizers` tokenizer (tokenizer.json) + tokenizer_config.json with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )


def make_tiny_hf_model(folder: Path, arch: str = "llama", seed: int = 0, layers: int = 2, **overrides) -> Path:
    """Save a tiny random model of `arch` (llama|mistral|qwen2|qwen3) as a Hugging Face folder."""
    import torch
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = classes[arch](**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights make tiny random models less uniform (more peaked logits)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_char_tokenizer(folder)
    return folder


def _permute_for_gguf(w, n_head: int):
    """llama.cpp's row order of q / k projections (the loader undoes it)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, folder: Path, quant: str | None = None, table_quant: str | None = None, arch: str = "llama",
               metadata=None):
    """Write the Hugging Face model in `folder` as a GGUF file of llama.cpp architecture `arch` (block names: its
    family's `Family.gguf`): 2-D weights in the gguf quantization type `quant` ("Q8_0", "Q4_1", ...; None: F32;
    a mapping {name fragment: type, "*": type}: a mixed file),
    the token embedding in `table_quant` (default `quant`); `metadata(writer)` adds more keys (a tokenizer).
    Returns the model as loaded from `folder`."""
    import gguf
    import numpy as np

    from speccompile.models.architectures import family
    from speccompile.models.load import _GGUF_NAMES, load_model

    loaded = load_model(str(folder))
    cfg = loaded.config
    fam = family(cfg.architecture)
    _GGUF_BLOCK_NAMES = fam.gguf
    writer = new_gguf_writer(path, arch, cfg)
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.norm == "layer":
        writer.add_layer_norm_eps(cfg.rms_norm_eps)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.rope_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if metadata is not None:
        metadata(writer)
    reverse = {v: k for k, v in _GGUF_NAMES.items()}
    block_reverse = {v: k for k, v in _GGUF_BLOCK_NAMES.items()}
    for name, tensor in loaded.weights.items():
        stored = np.array(tensor, dtype=np.float32)
        if name in reverse:
            gname = reverse[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{block_reverse['.'.join(parts[3:-1])]}.{parts[-1]}"
        if gname.endswith("attn_q.weight") and fam.gguf_llama_order:
            stored = _permute_for_gguf(stored, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight") and fam.gguf_llama_order:
            stored = _permute_for_gguf(stored, cfg.num_key_value_heads)
        kind = (table_quant or _quant_for(quant, "*")) if gname.startswith("token_embd") else _quant_for(quant, gname)
        if kind and stored.ndim == 2:
            qtype = gguf.GGMLQuantizationType[kind]
            q = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gname, stored)
    finish_gguf(writer)
    return loaded


def _quant_for(quant: str | dict | None, gname: str) -> str | None:
    """The gguf type of tensor `gname`: `quant` itself, or (a mapping, a mixed file like "Q4_K_M") the type of the
    first name fragment in `gname`, else of "*"."""
    if not isinstance(quant, dict):
        return quant
    return next((kind for fragment, kind in quant.items() if fragment != "*" and fragment in gname), quant.get("*"))


def new_gguf_writer(path, arch: str, cfg):
    """A GGUFWriter for `arch` holding a ModelConfig's shape: blocks, context, widths and head counts."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    return writer


def finish_gguf(writer) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_as_gguf(root: Path, folder: Path, drafter: str | None = None, dtype: str = "fp32", **quant) -> Path:
    """Write the model in `folder` as `root`/model.gguf (`write_gguf` types, the tokenizer files beside it) and
    export it (in `dtype`) to `root`/exported."""
    from speccompile.export.pipeline import ExportOptions, export_artifact

    root.mkdir(parents=True, exist_ok=True)
    write_gguf(root / "model.gguf", folder, **quant)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, root / name)
    export_artifact(str(root / "model.gguf"), root / "exported", ExportOptions(max_context=256, drafter=drafter, dtype=dtype))
    return root / "exported"


@pytest.fixture(scope="session", autouse=True)
def verified_files_cache(tmp_path_factory):
    """manifest.VerifiedFiles keeps its digests in a folder of the test session, not the user's cache
    (subprocesses inherit the variable)."""
    before = os.environ.get("SPECCOMPILE_CACHE_DIR")
    os.environ["SPECCOMPILE_CACHE_DIR"] = str(tmp_path_factory.mktemp("speccompile-cache"))
    yield
    if before is None:
        os.environ.pop("SPECCOMPILE_CACHE_DIR", None)
    else:
        os.environ["SPECCOMPILE_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "draft", seed=1, layers=1)


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_model_dir) -> Path:
    from speccompile.export.pipeline import ExportOptions, export_artifact

    out = tmp_path_factory.mktemp("art") / "exported"
    export_artifact(str(tiny_model_dir), out, ExportOptions(max_context=256))
    return out


@pytest.fixture(scope="session")
def tiny_artifact_with_draft(tmp_path_factory, tiny_model_dir, tiny_draft_dir) -> Path:
    from speccompile.export.pipeline import ExportOptions, export_artifact

    out = tmp_path_factory.mktemp("art") / "exported_draft"
    export_artifact(str(tiny_model_dir), out, ExportOptions(max_context=256, drafter=f"draft-model:{tiny_draft_dir}"))
    return out


@pytest.fixture(scope="session")
def head_artifacts(tmp_path_factory) -> dict:
    """Artifacts of the tiny head target (test_heads_helpers) with a random EAGLE-3 head and Medusa heads (exported
    once per session)."""
    from test_heads_helpers import shared_target, write_checkpoint

    from speccompile.export.pipeline import ExportOptions, export_artifact

    target = shared_target(tmp_path_factory)
    root = tmp_path_factory.mktemp("batch_heads")
    artifacts = {}
    for kind in ("eagle3", "medusa"):
        ckpt = write_checkpoint(root / f"{kind}_ckpt", kind)
        export_artifact(str(target), root / kind, ExportOptions(drafter=f"{kind}:{ckpt}", max_context=256))
        artifacts[kind] = root / kind
    return artifacts


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the speccompile CLI in a subprocess (so exit codes and stderr are the real ones)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "speccompile.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=600,
    )


def run_cli_here(capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process (faster than a subprocess); (exit code, stdout, stderr)."""
    from speccompile.cli import main

    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_refused_for_disk_space(capsys, monkeypatch, out: Path, command: str, *args: str, free: int = 1 << 20) -> None:
    """`speccompile COMMAND ... --out OUT` with only `free` bytes free: one error line (exit 2, no traceback) saying
    what it would write, and nothing left behind (no OUT, no temporary folder beside it)."""
    from speccompile.export import output_size

    usage = shutil.disk_usage(out.parent)
    monkeypatch.setattr(output_size.shutil, "disk_usage", lambda _: usage._replace(free=free))
    code, _, err = run_cli_here(capsys, command, *args, "--out", str(out))
    errors = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2 and errors == [err.strip().splitlines()[-1]] and "Traceback" not in err, err
    assert errors[0].startswith(f"error: --out {out}: not enough disk space: the {command} writes about"), err
    assert not out.exists() and not any(p.name.startswith("." + out.name) for p in out.parent.iterdir())


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not a package; the folder is on sys.path while it
    loads, as when it runs, for the scripts that import one beside them)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module
