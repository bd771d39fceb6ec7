"""The Constraint interface (runtime/constraints.py) implemented with xgrammar (the library vLLM, SGLang and
TensorRT-LLM use): JSON schemas, any JSON object, regexes, EBNF grammars, choice lists and structural tags
compiled against the artifact's tokenizer, a matcher per generation.

xgrammar is an optional dependency (`pip install 'speccompile[structured]'`); it is imported on first use.
Its Python package imports torch and transformers itself (its wheel depends on them); nothing here uses them:
the vocabulary comes from the artifact's tokenizer.json (the `tokenizers` library) and masks are numpy arrays.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError, UnsupportedError
from ..tokenizer import vocabulary_kind
from .constraints import ConstraintSpec

_STRUCTURED_EXTRA = "pip install 'speccompile[structured]'"
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[14:13:27] /project/cpp/file.cc:94: " before a message


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise UnsupportedError(f"structured outputs need xgrammar ({_STRUCTURED_EXTRA})") from None
    return xgrammar


class GrammarCompiler:
    """xgrammar's compiler for one artifact's tokenizer, with its cache of compiled grammars. `vocab_size`: the
    model's (the width of its logits, which may exceed the tokenizer's); `stop_token_ids`: the ids that end an
    output (the artifact's eos)."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, stop_token_ids: Sequence[int], threads: int = 1):
        from tokenizers import Tokenizer

        xgr = _xgrammar()
        path = Path(tokenizer_dir) / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path))
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
        for token, index in vocab.items():
            encoded[index] = token
        kind, prefix_space = vocabulary_kind(json.loads(path.read_text(encoding="utf-8")))
        info = xgr.TokenizerInfo(encoded[:vocab_size], xgr.VocabType[kind], vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids) or None, add_prefix_space=prefix_space)
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self._lock = threading.Lock()

    def compile(self, spec: ConstraintSpec) -> "CompiledGrammar":
        """The spec compiled (cached by xgrammar); InputError with xgrammar's first line for a bad one."""
        spec.validate()
        try:
            with self._lock:
                return CompiledGrammar(self._compile(spec), self.vocab_size, self._encode)
        except InputError:
            raise
        except Exception as exc:  # xgrammar reports a bad schema / regex / grammar as RuntimeError or its own types
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise InputError(f"{spec.kind}: {_LOG_PREFIX.sub('', first)}", field=spec.kind) from None

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def _compile(self, spec: ConstraintSpec):
        compiler = self._compiler
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.value))
        return compiler.compile_structural_tag(spec.value)


def compiler_for(directory: Path, threads: int = 1) -> GrammarCompiler:
    """The compiler for an artifact directory (no graph is opened): its tokenizer, its model's vocabulary (the
    logits' width) and the eos ids that end an output, as the runtime reads them."""
    from ..manifest import read_manifest
    from ..tokenizer import TextTokenizer

    manifest = read_manifest(directory, verify_files=False)
    tokenizer = TextTokenizer(directory, manifest.tokenizer.get("eos_token_ids"))
    vocab_size = int((manifest.model.get("config") or {}).get("vocab_size") or tokenizer.vocab_size)
    return GrammarCompiler(directory, vocab_size, sorted(set(tokenizer.eos_token_ids)), threads)


class CompiledGrammar:
    """A compiled grammar: `new_state()` gives a generation its matcher."""

    def __init__(self, compiled: Any, vocab_size: int, encode: Callable[[str], list[int]]):
        self._compiled = compiled
        self.vocab_size = vocab_size
        self._encode = encode

    def new_state(self) -> "GrammarState":
        return GrammarState(_xgrammar().GrammarMatcher(self._compiled), self.vocab_size, self._encode)


class GrammarState:
    """xgrammar's matcher behind the Constraint protocol; the mask is unpacked from its bitmask into bools."""

    def __init__(self, matcher: Any, vocab_size: int, encode: Callable[[str], list[int]]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._encode = encode
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def allowed_tokens(self) -> np.ndarray:
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].view(bool)

    def advance(self, tokens: Sequence[int]) -> int:
        for count, token in enumerate(tokens):
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                return count
        return len(tokens)

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def forced_tokens(self) -> list[int]:
        """The text the grammar forces next (xgrammar's jump-forward string), as the tokenizer writes it alone."""
        text = "" if self._matcher.is_terminated() else self._matcher.find_jump_forward_string()
        return self._encode(text) if text else []
