"""One exception family. The CLI turns any `SpecCompileError` into a one-line message and exit code 2.

Library messages speak in API terms: an error about one argument names it as the API does
(`RunOptions.num_draft_tokens` -> "num_draft_tokens must be >= 0, got -1") and records it in `field`; a front end
names its own spelling instead (`naming`: the CLI's flags, "--num-draft-tokens must be >= 0, got -1")."""

from __future__ import annotations

import re
from typing import Iterable, Mapping


class SpecCompileError(Exception):
    """Base class of every error speccompile reports to a user (bad input, unsupported model, ...)."""

    exit_code = 2

    def __init__(self, message: str, field: str | tuple[str, ...] | None = None):
        super().__init__(message)
        # the API names of the arguments the message is about (the message names each once, as a word)
        self.fields: tuple[str, ...] = (field,) if isinstance(field, str) else tuple(field or ())

    @property
    def field(self) -> str | None:
        """The (first) argument the message is about."""
        return self.fields[0] if self.fields else None

    def naming(self, names: Mapping[str, str]) -> str:
        """The message with each of its fields spelled as `names` says (a front end's: the CLI's flags)."""
        message = str(self)
        for field in self.fields:
            if field in names:
                message = re.sub(rf"(?<![\w-]){re.escape(field)}(?![\w-])", lambda _: names[field], message, count=1)
        return message


class InputError(SpecCompileError):
    """A file, flag or value given by the user is missing, malformed or out of range."""


class UnsupportedError(SpecCompileError):
    """The model, drafter, precision or hardware is not supported."""


class ArtifactError(SpecCompileError):
    """An artifact directory is inconsistent: schema version, sha256, missing graph or limits."""


class HardwareError(SpecCompileError):
    """The GPU, TensorRT version or engine does not match what the artifact needs."""


def check_at_least(name: str, value: float | None, least: float) -> None:
    """An InputError about argument `name` ("NAME must be >= LEAST, got VALUE") unless `value` >= `least`."""
    if value is None or value < least:
        raise InputError(f"{name} must be >= {least}, got {value}", name)


def check_one_of(name: str, value: object, choices: Iterable[object]) -> None:
    """An InputError about argument `name` ("NAME must be one of A, B, got VALUE") unless `value` is a choice."""
    choices = tuple(choices)
    if value not in choices:
        raise InputError(f"{name} must be one of {', '.join(map(str, choices))}, got {value}", name)


def with_article(word: object) -> str:
    """`word` after "a" or "an" as it is read aloud: "an int4", "an fp8" / "an NVFP4" / "an mtp" (spelled out
    letter by letter), "an 8-token", "a bf16", "a medusa"."""
    text = str(word)
    number = re.match(r"\d+", text)
    if number:
        digits = number.group()
        vowel = digits.startswith("8") or (len(digits) % 3 == 2 and digits[:2] in ("11", "18"))
    else:
        lower = text.lower()
        spelled = any(c.isdigit() for c in text) or text.isupper() or (len(text) <= 4 and not set(lower) & set("aeiou"))
        vowel = lower[:1] in set("aeiou") or (spelled and lower[:1] in set("fhlmnrsx"))
    return f"{'an' if vowel else 'a'} {text}"
