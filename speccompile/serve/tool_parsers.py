"""Tool calls in a model's output text, parsed as the text streams in: content deltas, each call's start (its name)
and its arguments as they grow, the deltas OpenAI streams. The same parser reads a whole answer (feed it all,
then `finish`), so a streamed answer and a whole one are parsed alike.

Formats: `hermes` (Qwen 2.5/3, Hermes, and most chat templates with tools: `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`, content around them) and `llama3_json` (Llama 3.1+: the whole answer is one or
more `{"name": ..., "parameters": {...}}` objects separated by `;`). A new format implements `ToolCallParser`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ParserEvent = ContentDelta | ToolCallStart | ArgumentsDelta


class ToolCallParser(Protocol):
    """Reads one answer's text in deltas."""

    def feed(self, text: str) -> list[ParserEvent]:
        """Events for what `text` (the next delta) makes certain; text that may still turn out to be part of a
        tool call is held back."""
        ...

    def finish(self) -> list[ParserEvent]:
        """Events for what was held back, at the end of the answer."""
        ...


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the arguments object's JSON text, as the model wrote it


@dataclass
class ParsedAnswer:
    """A whole answer's events gathered: its content (None when only whitespace) and its tool calls in order."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def gather(events: list[ParserEvent]) -> ParsedAnswer:
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = ToolCall(event.id, event.name)
        else:
            calls[event.index].arguments += event.text
    text = "".join(content)
    return ParsedAnswer(text if text.strip() else None, [calls[i] for i in sorted(calls)])


def parse_whole(parser: ToolCallParser, text: str) -> ParsedAnswer:
    return gather(parser.feed(text) + parser.finish())


# ----------------------------------------------------------------------------------------------
# One call's JSON object, scanned as it grows
# ----------------------------------------------------------------------------------------------


class MalformedCall(ValueError):
    """The text in a tool-call position is not a JSON object of the expected shape."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at text[i] ('"'), or None if it has not ended yet."""
    escaped = False
    for j in range(i + 1, len(text)):
        if escaped:
            escaped = False
        elif text[j] == "\\":
            escaped = True
        elif text[j] == '"':
            return j + 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at text[i], or None if it may not have ended yet."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += c in "{["
            depth -= c in "}]"
            if depth == 0:
                return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None  # a number may go on


def scan_object(text: str) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the JSON object `text` starts with, as far as it goes: (key, value start, value end or
    None) each, and the index after the closing brace (None while open). MalformedCall if it is not one."""
    i = _skip_ws(text, 0)
    if i >= len(text):
        return [], None
    if text[i] != "{":
        raise MalformedCall(f"expected a JSON object, got {text[i:i + 20]!r}")
    i += 1
    members: list[tuple[str, int, int | None]] = []
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] == "," and members:
            i = _skip_ws(text, i + 1)
            if i >= len(text):
                return members, None
        if text[i] != '"':
            raise MalformedCall(f"expected a key at {text[i:i + 20]!r}")
        key_end = _string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise MalformedCall(f"expected ':' after {key!r}")
        start = _skip_ws(text, i + 1)
        end = _value_end(text, start) if start < len(text) else None
        members.append((key, start, end))
        if end is None:
            return members, None
        i = end


class CallScanner:
    """One tool call's JSON object as it arrives: its start once the name is known (when the name comes first),
    its arguments while an object's text grows (a string-valued `arguments` once whole)."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.started = False
        self._sent = 0  # characters of the arguments sent

    def feed(self, text: str) -> tuple[list[ParserEvent], int | None]:
        """Events for the call after `text`; the second value is where the object ended in `self.text` (None:
        still open)."""
        self.text += text
        members, end = scan_object(self.text)
        found = {key: (start, stop) for key, start, stop in members}
        name_at = next((i for i, m in enumerate(members) if m[0] == "name"), None)
        args_at = next((i for i, m in enumerate(members) if m[0] in ARGUMENT_KEYS), None)
        events: list[ParserEvent] = []
        name_known = name_at is not None and members[name_at][2] is not None
        if not self.started and name_known and (end is not None or args_at is None or args_at > name_at):
            start, stop = found["name"]
            name = json.loads(self.text[start:stop])
            if not isinstance(name, str) or not name:
                raise MalformedCall("a tool call's name must be a non-empty string")
            events.append(ToolCallStart(self.index, f"call_{uuid.uuid4().hex[:24]}", name))
            self.started = True
        if self.started:
            events += self._arguments(members[args_at] if args_at is not None else None, end is not None)
        elif end is not None:
            raise MalformedCall("a tool call without a name")
        return events, end

    def _arguments(self, member: tuple[str, int, int | None] | None, closed: bool) -> list[ParserEvent]:
        if member is None:
            if closed and self._sent == 0:
                self._sent = 2
                return [ArgumentsDelta(self.index, "{}")]
            return []
        _, start, stop = member
        if start >= len(self.text):
            return []
        if self.text[start] not in "{[":  # a string (JSON text inside) or a scalar: sent whole
            if stop is None or self._sent:
                return []
            value = json.loads(self.text[start:stop])
            text = value if isinstance(value, str) else json.dumps(value)
            self._sent = len(text)
            return [ArgumentsDelta(self.index, text)]
        available = self.text[start: stop if stop is not None else len(self.text)]
        new, self._sent = available[self._sent:], len(available)
        return [ArgumentsDelta(self.index, new)] if new else []


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Content:
    """Content deltas with trailing whitespace held until something else follows (dropped at the end), so an
    answer streamed in any pieces gives the same content."""

    def __init__(self):
        self._blank = ""

    def send(self, text: str) -> list[ParserEvent]:
        text = self._blank + text
        kept = text.rstrip()
        self._blank = text[len(kept):]
        return [ContentDelta(kept)] if kept else []


class JsonInTagsParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls among content (Qwen, Hermes)."""

    def __init__(self, begin: str = "<tool_call>", end: str = "</tool_call>"):
        self.begin, self.end = begin, end
        self._pending = ""
        self._call: CallScanner | None = None
        self._raw = False  # the open region is not a tool call: its text is content
        self._calls = 0
        self._content = _Content()

    def feed(self, text: str) -> list[ParserEvent]:
        self._pending += text
        events: list[ParserEvent] = []
        while self._pending:
            tag = self.end if self._call is not None else self.begin
            at = self._pending.find(tag)
            cut = at if at >= 0 else len(self._pending) - _held_prefix(self._pending, tag)
            piece, self._pending = self._pending[:cut], self._pending[cut:]
            events += self._take(piece)
            if at < 0:
                break
            self._pending = self._pending[len(tag):]
            if self._call is None:
                self._call = CallScanner(self._calls)
            else:
                events += self._close_call()
        return events

    def _take(self, text: str) -> list[ParserEvent]:
        if self._call is None or self._raw:
            return self._content.send(text)
        try:
            return self._call.feed(text)[0] if text else []
        except MalformedCall:
            if self._call.started:  # what follows a call's arguments in its region is dropped
                return []
            self._raw = True
            return self._content.send(self.begin + self._call.text)

    def _close_call(self) -> list[ParserEvent]:
        events = self._content.send(self.end) if self._raw else []
        self._calls += not self._raw
        self._call, self._raw = None, False
        return events

    def finish(self) -> list[ParserEvent]:
        events = self._take(self._pending)
        self._pending = ""
        return events


class Llama3JsonParser:
    """Llama 3.1+ JSON tool calls: an answer starting with `{` is `{"name": ..., "parameters": {...}}` objects
    separated by `;`; any other answer is content."""

    def __init__(self):
        self._mode: str | None = None  # None until the first non-blank character; then "calls" or "content"
        self._pending = ""
        self._call: CallScanner | None = None
        self._calls = 0

    def feed(self, text: str) -> list[ParserEvent]:
        if self._mode == "content":
            return [ContentDelta(text)] if text else []
        self._pending += text
        if self._mode is None:
            stripped = self._pending.lstrip()
            if not stripped:
                return []
            self._mode = "calls" if stripped[0] == "{" else "content"
            if self._mode == "content":
                text, self._pending = self._pending, ""
                return [ContentDelta(text)]
        return self._calls_from_pending()

    def _calls_from_pending(self) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while self._pending:
            if self._call is None:
                rest = self._pending.lstrip(" \t\r\n;")
                if not rest:
                    break
                self._call, self._pending = CallScanner(self._calls), rest
            try:
                new, end = self._call.feed(self._pending)
            except MalformedCall:
                if self._call.started:  # the rest after a broken call is dropped
                    self._pending = ""
                    break
                self._mode, text, self._pending = "content", self._call.text, ""
                return events + [ContentDelta(text)]
            events += new
            if end is None:
                self._pending = ""
                break
            self._pending = self._call.text[end:]
            self._call = None
            self._calls += 1
        return events

    def finish(self) -> list[ParserEvent]:
        if self._mode is None and self._pending.strip():
            return [ContentDelta(self._pending)]
        return []


PARSERS = {"hermes": JsonInTagsParser, "llama3_json": Llama3JsonParser}
