"""Tool calling: how a model writes its tool calls (its format), the grammar that makes it write them
(`tool_choice` "required" or a named function), and how tools reach a chat template that has no `tools` variable.

A format pairs the parser of serve/tool_parsers.py with the text around one call's arguments, so the grammar
and the parser agree by construction: `required` / a named function compile to an xgrammar structural tag of
`begin(name) + <the function's parameters schema> + end` per call, calls joined by `separator`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..runtime.constraints import ConstraintSpec
from .tool_parsers import PARSERS, ToolCallParser

TOOL_FORMATS = ("auto", *PARSERS)
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes a tool call: `prefix` + `"{name}"` + `middle` + arguments JSON + `end`."""

    name: str
    prefix: str
    middle: str
    end: str
    separator: str

    def parser(self) -> ToolCallParser:
        return PARSERS[self.name]()

    def begin(self, function: str) -> str:
        return f"{self.prefix}{json.dumps(function)}{self.middle}"

    def write(self, function: str, arguments: str) -> str:
        """One call as the model writes it (what the grammar allows for it)."""
        return self.begin(function) + arguments + self.end

    def constraint(self, functions: list[dict[str, Any]], only: str | None = None, parallel: bool = True) -> ConstraintSpec:
        """The grammar of an answer that is tool calls only: one or more (one when `only` names the function or
        not `parallel`), each a function of `functions` with arguments valid for its parameters schema."""
        chosen = [f for f in functions if only is None or f["name"] == only]
        tags = [{"type": "tag", "begin": self.begin(f["name"]),
                 "content": {"type": "json_schema", "json_schema": f.get("parameters") or _ANY_OBJECT},
                 "end": self.end} for f in chosen]
        tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                                                    "at_least_one": True, "stop_after_first": only is not None or not parallel}}
        return ConstraintSpec("structural_tag", json.dumps(tag)).validate()


FORMATS = {
    "hermes": ToolFormat("hermes", '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n"),
    "llama3_json": ToolFormat("llama3_json", '{"name": ', ', "parameters": ', "}", "; "),
}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches: Llama 3.1+'s JSON when it mentions `<|python_tag|>` or names the
    arguments `parameters`, else JSON in `<tool_call>` tags (Qwen, Hermes, and the fallback prompt below)."""
    template = chat_template or ""
    if "<tool_call>" not in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def tools_system_prompt(tools: list[dict[str, Any]], format: ToolFormat) -> str:
    """For a chat template without a `tools` variable: a system message describing the tools and how to call one."""
    listing = "\n".join(json.dumps(tool) for tool in tools)
    example = format.write("<function name>", "<arguments as a JSON object>")
    return (f"You can call these tools (JSON function definitions):\n{listing}\n"
            f"To call one, answer with exactly:\n{example}")


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]], format: ToolFormat) -> list[dict[str, Any]]:
    """`messages` with the tools described in the system message (one is added first if there is none)."""
    prompt = tools_system_prompt(tools, format)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
