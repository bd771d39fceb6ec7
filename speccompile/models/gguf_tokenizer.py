"""A GGUF's `gpt2` tokenizer (llama.cpp's byte-level BPE: the vocabulary, its merges and the token types) written as
a `tokenizers` tokenizer.json, for architectures whose GGUF tokenizer transformers does not convert (Phi-2,
DeepSeek-V2/V3, StarCoder 1).

The tokenizer is GPT-2's: byte-level pre-tokenization with GPT-2's split regex (llama.cpp's `tokenizer.ggml.pre`
"gpt-2", "phi-2" or "default"), BPE over the merges in order, byte-level decoding. Control tokens become special
added tokens and user-defined ones plain added tokens, matched on the raw text, each at its id in the file.

DeepSeek's files ("deepseek-v3": V3, R1, Kimi's Moonlight; "deepseek-llm": V2) name other splits: llama.cpp
applies a list of regexes in turn, each splitting the pieces the one before left (matches and the text between
them both kept), then the byte-level mapping without GPT-2's regex. StarCoder's ("starcoder", "refact") cuts every
digit off first, then GPT-2's regex. `PRE_SPLITS` holds those lists as llama.cpp's
llama-vocab.cpp gives them; `tokenizers` runs them as a Sequence of isolated Splits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError

GPT2_SPLITS = ("gpt-2", "phi-2", "default", "smollm")  # `tokenizer.ggml.pre` values split with GPT-2's regex
# ("smollm" splits digits first, but its vocabulary has no token of two digits: the same tokens)
_DEEPSEEK_LLM_LETTERS = (  # llama.cpp's letter class of the deepseek-llm split (cased letters of many scripts)
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
    "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"  # llama.cpp's (the text between kept)
PRE_SPLITS: dict[str, tuple[str, ...]] = {  # `tokenizer.ggml.pre` -> the regexes llama.cpp splits with, in turn
    "starcoder": (r"\p{N}", _GPT2_REGEX), "refact": (r"\p{N}", _GPT2_REGEX),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "deepseek-llm": (
        "[\r\n]",
        f"\\s?[{_DEEPSEEK_LLM_LETTERS}]+",
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    ),
}
# Llama 3's split (llama.cpp's form of its tokenizer.json regex), for the `pre` values llama.cpp reads as Llama 3's: a
# whole piece that is a token is that token (`ignore_merges`), and a BOS is added unless the file says otherwise
_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2")
PRE_SPLITS.update({pre: (_LLAMA3_REGEX,) for pre in LLAMA3_PRES})
# Qwen 2 / 3's split (digits one by one) and Qwen3.5's (marks joined to letters), as llama.cpp writes them
_QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS.update({"qwen2": (_QWEN2_REGEX,), "deepseek-r1-qwen": (_QWEN2_REGEX,), "qwen35": (_QWEN35_REGEX,)})
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

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or (pre not in GPT2_SPLITS and pre not in PRE_SPLITS):
        return None
    tokens = list(_field(reader, "tokenizer.ggml.tokens", []))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    if not tokens or len(vocab) != len(tokens):
        raise InputError(f"{source}: the GGUF vocabulary has {len(tokens) - len(vocab)} repeated tokens (a BPE needs one id per token)")
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in LLAMA3_PRES))
    tok.pre_tokenizer = _pre_tokenizer(PRE_SPLITS.get(pre))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for role in ("bos", "eos"):
        index = _field(reader, f"tokenizer.ggml.{role}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            config[f"{role}_token"] = tokens[int(index)]
    bos = config.get("bos_token")
    if _field(reader, "tokenizer.ggml.add_bos_token", pre in LLAMA3_PRES) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ["tokenizer.json", "tokenizer_config.json"]


def _pre_tokenizer(splits: tuple[str, ...] | None):
    """GPT-2's byte-level pre-tokenizer (`splits` None), or llama.cpp's regex list then the byte-level mapping."""
    from tokenizers import Regex, pre_tokenizers

    if splits is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
