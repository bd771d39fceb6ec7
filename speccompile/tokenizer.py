"""The artifact's tokenizer: text <-> token ids with the `tokenizers` library, chat templates with jinja2.

Shared by the runtime (prompts, output text) and `engines` (calibration texts); torch-free."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .errors import ArtifactError, InputError


class TextTokenizer:
    """The artifact's tokenizer plus its chat template (no transformers at run time)."""

    def __init__(self, directory: Path, eos_token_ids: list[int] | None = None):
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise ArtifactError(f"{directory}: no tokenizer.json in the artifact")
        self._tok = Tokenizer.from_file(str(path))
        self._kind = vocabulary_kind(json.loads(path.read_text(encoding="utf-8")))[0]
        self._added = set(self._tok.get_added_tokens_decoder())
        self.chat_template = self._read_template(Path(directory))
        config = self._read_config(Path(directory))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids = list(eos_token_ids or [])
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos = self._tok.token_to_id(self.eos_token)
            if eos not in self.eos_token_ids:
                self.eos_token_ids.append(eos)

    @staticmethod
    def _read_template(directory: Path) -> str | None:
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        config = TextTokenizer._read_config(directory)
        template = config.get("chat_template")
        return template if isinstance(template, str) else None

    @staticmethod
    def _read_config(directory: Path) -> dict:
        path = directory / "tokenizer_config.json"
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return {}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for, as OpenAI's logprobs report them: a byte-level piece mapped back to
        its bytes, a byte-fallback `<0xNN>` its one byte (so a character split over tokens is rebuilt by joining
        them), an added token or a raw vocabulary's piece its UTF-8 text."""
        piece = self._tok.id_to_token(int(token))
        if piece is None or int(token) in self._added:
            return self.decode([token], skip_special_tokens=False).encode("utf-8")
        if self._kind == "BYTE_LEVEL" and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if self._kind == "BYTE_FALLBACK":
            match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token], skip_special_tokens=False).encode("utf-8")

    def render_chat(self, user_message: str, system: str | None = None) -> str:
        """Apply the chat template to one user turn, with the assistant generation prompt."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_message}]
        return self.render_messages(messages)

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Apply the chat template to a conversation (OpenAI-style message dicts: role, content, and for tool use
        `tool_calls` / `tool_call_id`), with the assistant generation prompt. `tools`: function definitions
        ({"type": "function", "function": {...}}) handed to the template's `tools` variable."""
        if not self.chat_template:
            raise InputError("chat: this model has no chat template (a base model): give the prompt raw "
                             "(--raw on the command line, /v1/completions on a server)", "chat")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson  # as transformers renders templates: plain JSON, no HTML escaping
        return env.from_string(self.chat_template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (else tools must be described another way)."""
        if not self.chat_template:
            return False
        import jinja2
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(self.chat_template))

    def prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        """Token ids of a prompt, through the chat template when `chat`."""
        if not prompt:
            raise InputError("prompt: the prompt is empty", "prompt")
        if chat:
            return self.encode(self.render_chat(prompt), add_special_tokens=False)
        return self.encode(prompt, add_special_tokens=True)


def vocabulary_kind(tokenizer_json: dict[str, Any]) -> tuple[str, bool]:
    """(xgrammar vocabulary type, add_prefix_space) of a `tokenizers` tokenizer.json: byte-level BPE (GPT-2,
    Llama 3, Qwen, SmolLM2), byte-fallback (Llama 2, Mistral: '▁' for spaces, <0xNN> for bytes) or raw."""
    def types(node: Any) -> list[dict]:
        if not isinstance(node, dict):
            return []
        inner = node.get("decoders") or node.get("pretokenizers") or node.get("normalizers") or []
        return [node] + [t for child in inner for t in types(child)]

    decoders = types(tokenizer_json.get("decoder"))
    names = {d.get("type") for d in decoders}
    if "ByteLevel" in names:
        return "BYTE_LEVEL", False
    if "ByteFallback" in names:
        normalizers = types(tokenizer_json.get("normalizer"))
        pre = types(tokenizer_json.get("pre_tokenizer"))
        prepends = any(n.get("type") == "Prepend" and n.get("prepend") == "▁" for n in normalizers) or any(
            p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pre)
        return "BYTE_FALLBACK", prepends
    return "RAW", False


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68 for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_template_error(message: str):
    raise InputError(f"chat template error: {message}")


def _strftime_now(format: str) -> str:
    import time

    return time.strftime(format)


def _tojson(value, indent: int | None = None, separators=None, sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
