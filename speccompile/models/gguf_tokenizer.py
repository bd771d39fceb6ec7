"""A GGUF's `gpt2` tokenizer (llama.cpp's byte-level BPE: the vocabulary, its merges and the token types) written as
a `tokenizers` tokenizer.json, for architectures whose GGUF tokenizer transformers does not convert (Phi-2).

The tokenizer is GPT-2's: byte-level pre-tokenization with GPT-2's split regex (llama.cpp's `tokenizer.ggml.pre`
"gpt-2", "phi-2" or "default"), BPE over the merges in order, byte-level decoding. Control tokens become special
added tokens and user-defined ones plain added tokens, matched on the raw text, each at its id in the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError

GPT2_SPLITS = ("gpt-2", "phi-2", "default", "smollm")  # `tokenizer.ggml.pre` values split with GPT-2's regex
# ("smollm" splits digits first, but its vocabulary has no token of two digits: the same tokens)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tokenizer_model(reader) -> str | None:
    """The GGUF's `tokenizer.ggml.model` (gpt2, llama, ...), or None."""
    return _field(reader, "tokenizer.ggml.model")


def gpt2_tokenizer_files(reader, source: Path, out_dir: Path) -> list[str] | None:
    """tokenizer.json and tokenizer_config.json in `out_dir` from the GGUF `reader`'s metadata, or None when its
    tokenizer is not GPT-2's byte-level BPE; InputError for a vocabulary that is not one token per id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2" or _field(reader, "tokenizer.ggml.pre", "default") not in GPT2_SPLITS:
        return None
    tokens = list(_field(reader, "tokenizer.ggml.tokens", []))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    if not tokens or len(vocab) != len(tokens):
        raise InputError(f"{source}: the GGUF vocabulary has {len(tokens) - len(vocab)} repeated tokens (a BPE needs one id per token)")
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for role in ("bos", "eos"):
        index = _field(reader, f"tokenizer.ggml.{role}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            config[f"{role}_token"] = tokens[int(index)]
    bos = config.get("bos_token")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ["tokenizer.json", "tokenizer_config.json"]
