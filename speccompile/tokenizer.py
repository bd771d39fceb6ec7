"""The artifact's tokenizer: text <-> token ids with the `tokenizers` library, chat templates with jinja2.

Shared by the runtime (prompts, output text) and `engines` (calibration texts); torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ArtifactError, InputError


class TextTokenizer:
    """The artifact's tokenizer plus its chat template (no transformers at run time)."""

    def __init__(self, directory: Path, eos_token_ids: list[int] | None = None):
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise ArtifactError(f"{directory}: no tokenizer.json in the artifact")
        self._tok = Tokenizer.from_file(str(path))
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

    def render_chat(self, user_message: str, system: str | None = None) -> str:
        """Apply the chat template to one user turn, with the assistant generation prompt."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_message}]
        return self.render_messages(messages)

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Apply the chat template to a conversation (OpenAI-style message dicts: role, content, and for tool use
        `tool_calls` / `tool_call_id`), with the assistant generation prompt. `tools`: function definitions
        ({"type": "function", "function": {...}}) handed to the template's `tools` variable."""
        if not self.chat_template:
            raise InputError("chat: this model has no chat template (give the prompt raw)", "chat")
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
