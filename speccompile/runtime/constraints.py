"""Constrained decoding's interface: what a generation asks of a grammar, and the mask it applies to the logits.

A `ConstraintSpec` says what the output must be (a JSON schema, any JSON object, a regex, an EBNF grammar, one of
a list of strings, or tool calls); a `ConstraintCompiler` (runtime/grammar.py: xgrammar) turns it into a
`CompiledConstraint` for one artifact's tokenizer once, and that gives each generation a `Constraint`: the
grammar's state over the tokens emitted so far. The decode loop asks the state which tokens may come next,
advances it over the tokens it emits (and, to check a draft, over draft tokens, rolled back afterwards).

Exactness (docs/DESIGN.md, "Constrained decoding"): the target distribution is the logits with every token the
grammar refuses set to -inf, then the request's processing (temperature, top-k, top-p), as plain constrained
decoding does; verification runs against that distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from ..errors import InputError

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice", "structural_tag"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match. `value`: the JSON schema (a JSON string), the regex, the EBNF grammar (its
    rule `root` is the output), the choices (a tuple of strings), or a structural tag (a JSON string, xgrammar's
    format: the tool-call grammar of serve/tools.py); None for `json_object`. `strict` (json_schema): no
    properties beyond the schema's (OpenAI's `strict: true`); otherwise what the schema allows."""

    kind: ConstraintKind
    value: str | tuple[str, ...] | None = None
    strict: bool = True

    def validate(self) -> "ConstraintSpec":
        """Shape checks that need no compiler (InputError naming the kind); the compiler checks the rest."""
        if self.kind not in CONSTRAINT_KINDS:
            raise InputError(f"constraint: unknown kind {self.kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}", field="constraint")
        if self.kind == "json_object":
            return self
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value or not all(isinstance(c, str) and c for c in self.value):
                raise InputError("choice: expected one or more non-empty strings", field="choice")
            return self
        if not isinstance(self.value, str) or not self.value.strip():
            raise InputError(f"{self.kind}: expected a non-empty string", field=self.kind)
        if self.kind in ("json_schema", "structural_tag"):
            try:
                parsed = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise InputError(f"{self.kind}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})", field=self.kind) from None
            if not isinstance(parsed, (dict, bool)) or (self.kind == "structural_tag" and not isinstance(parsed, dict)):
                raise InputError(f"{self.kind}: expected a JSON object", field=self.kind)
        return self

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool, strict: bool = True) -> "ConstraintSpec":
        """From a schema as a dict (or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), strict).validate()

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "ConstraintSpec":
        return cls("choice", tuple(choices)).validate()


class Constraint(Protocol):
    """One generation's grammar state: the tokens emitted so far (and, while a draft is checked, draft tokens)."""

    def allowed_tokens(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (the stop tokens once the output is complete)."""
        ...

    def advance(self, tokens: Sequence[int]) -> int:
        """Accept `tokens` in order; returns how many were accepted: the state stops after the last one the
        grammar allowed (the first it refuses and those after it are not accepted)."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens."""
        ...

    @property
    def terminated(self) -> bool:
        """Whether a stop token ended the output (nothing more may follow)."""
        ...

    def forced_tokens(self) -> list[int]:
        """A guess of the next tokens: the text the grammar allows alone next (a JSON key in a fixed order, a
        closing quote and brace), tokenized; empty when the next text is open. Proposed as free draft tokens."""
        ...


class CompiledConstraint(Protocol):
    """A grammar compiled for one tokenizer: each generation takes a fresh state from it."""

    def new_state(self) -> Constraint:
        ...


class ConstraintCompiler(Protocol):
    """Compiles specs for one artifact's tokenizer (InputError, one line, for a bad schema, regex or grammar)."""

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        ...


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """`logits` [..., V] with every token `allowed` [..., V'] refuses set to -inf (a new array). `allowed` may be
    narrower than the logits (ids past it are refused) or wider (cut to V)."""
    width = logits.shape[-1]
    if allowed.shape[-1] != width:
        padded = np.zeros(allowed.shape[:-1] + (width,), dtype=bool)
        keep = min(width, allowed.shape[-1])
        padded[..., :keep] = allowed[..., :keep]
        allowed = padded
    return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)
