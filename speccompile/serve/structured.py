"""The request fields that constrain an answer: OpenAI's `response_format` (text, json_object, json_schema with
`strict`) and `tools` / `tool_choice`, vLLM's `structured_outputs` (json, regex, choice, grammar, json_object,
structural_tag); and the one ConstraintSpec they ask for (runtime/constraints.py). Shapes are checked here
(400 before any work); schemas, regexes and grammars when the engine compiles them (400 too)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..runtime.constraints import ConstraintSpec
from .api_errors import ParamError
from .tools import ToolFormat


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {...}}."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self

    def spec(self) -> ConstraintSpec | None:
        if self.type == "json_object":
            return ConstraintSpec("json_object")
        if self.type == "json_schema":
            return ConstraintSpec.json_schema(self.json_schema.schema_, strict=bool(self.json_schema.strict))
        return None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs (the extension its OpenAI server accepts; send it in `extra_body`): one of them."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name, value in self._fields().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object, structural_tag (got {len(given)})")
        return self

    def _fields(self) -> dict[str, Any]:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object, "structural_tag": self.structural_tag}

    def spec(self) -> ConstraintSpec:
        if self.json_ is not None:
            return ConstraintSpec("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_), strict=False)
        if self.regex is not None:
            return ConstraintSpec("regex", self.regex)
        if self.choice is not None:
            return ConstraintSpec("choice", tuple(self.choice))
        if self.grammar is not None:
            return ConstraintSpec("grammar", self.grammar)
        if self.json_object:
            return ConstraintSpec("json_object")
        tag = self.structural_tag
        return ConstraintSpec("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """tools, tool_choice and parallel_tool_calls of a chat request."""

    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be distinct")
        return tools

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> "ToolFields":
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ParamError("tool_choice", f"{choice!r} needs tools" if isinstance(choice, str) else "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ParamError("tool_choice", f"names {choice.function.name!r}, which is not among the tools")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the model sees the tools and its answer is read for tool calls (tool_choice is not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def functions(self) -> list[dict[str, Any]]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def tool_spec(self, format: ToolFormat) -> ConstraintSpec | None:
        """The grammar `required` or a named function imposes (None for auto / none)."""
        choice = self.tool_choice
        if not self.calls_tools or choice in (None, "auto"):
            return None
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return format.constraint(self.functions(), only, parallel=self.parallel_tool_calls is not False)
