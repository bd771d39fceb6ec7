"""Tool calling pieces: the parsers (whole and streamed), the tool grammars, tools through a chat template."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import CHARS, SPECIAL, TINY_VOCAB, write_char_tokenizer
from speccompile.runtime.grammar import GrammarCompiler
from speccompile.serve.tool_parsers import (ArgumentsDelta, ContentDelta, JsonInTagsParser, Llama3JsonParser, ToolCallStart,
                                            gather, parse_whole)
from speccompile.serve.tools import FORMATS, detect_format, with_tools_prompt
from speccompile.tokenizer import TextTokenizer

EOS = SPECIAL.index("</s>")
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                                                 "required": ["city"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                                     "required": ["a"], "additionalProperties": False}}

HERMES_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": {"t": "C"}}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')


def streamed(parser, text: str, step: int = 1) -> list:
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    return events + parser.finish()


def test_hermes_whole_answer():
    answer = parse_whole(JsonInTagsParser(), HERMES_ANSWER)
    assert answer.content == "Let me check."  # trailing whitespace before a call is dropped
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [
        ("get_weather", {"city": "Paris", "units": {"t": "C"}}), ("add", {"a": 1})]
    assert len({c.id for c in answer.tool_calls}) == 2


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_streamed_equals_whole_and_arguments_arrive_in_pieces(step):
    events = streamed(JsonInTagsParser(), HERMES_ANSWER, step)
    whole = parse_whole(JsonInTagsParser(), HERMES_ANSWER)
    answer = gather(events)
    assert answer.content == whole.content
    assert [(c.name, c.arguments) for c in answer.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    first_args = [e for e in events if isinstance(e, ArgumentsDelta) and e.index == 0]
    assert len(first_args) > 1 if step == 1 else first_args  # streamed as they grow, not at the end
    starts = [i for i, e in enumerate(events) if isinstance(e, ToolCallStart)]
    assert events.index(first_args[0]) > starts[0]  # the call's start (id, name) comes first
    assert not any(isinstance(e, ContentDelta) and "<" in e.text for e in events)  # tags never leak as content


def test_hermes_plain_content_and_broken_call():
    assert parse_whole(JsonInTagsParser(), "just text, a < b").content == "just text, a < b"
    broken = parse_whole(JsonInTagsParser(), "x <tool_call>not json</tool_call> y")
    assert broken.tool_calls == [] and broken.content == "x <tool_call>not json</tool_call> y"
    arguments_first = parse_whole(JsonInTagsParser(), '<tool_call>{"arguments": {"a": 2}, "name": "add"}</tool_call>')
    assert [(c.name, c.arguments) for c in arguments_first.tool_calls] == [("add", '{"a": 2}')]


def test_llama3_json_calls_and_content():
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for answer in (parse_whole(Llama3JsonParser(), text), gather(streamed(Llama3JsonParser(), text))):
        assert answer.content is None
        assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})]
    assert parse_whole(Llama3JsonParser(), "Hello {there}").content == "Hello {there}"
    assert parse_whole(Llama3JsonParser(), '{"name": "add"}').tool_calls[0].arguments == "{}"


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    folder = tmp_path_factory.mktemp("chartok")
    write_char_tokenizer(folder)
    return GrammarCompiler(folder, TINY_VOCAB, [EOS])


def _accepts(compiler, spec, text: str) -> tuple[bool, np.ndarray]:
    state = compiler.compile(spec).new_state()
    tokens = [len(SPECIAL) + CHARS.index(c) for c in text]
    return state.advance(tokens) == len(tokens), state.allowed_tokens()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tool_grammar_and_parser_agree(compiler, name):
    """What `required` lets the model write is what the format's parser reads back, call for call."""
    fmt = FORMATS[name]
    calls = [("get_weather", '{"city": "Rome"}'), ("add", '{"a": 42}')]
    text = fmt.separator.join(fmt.write(n, a) for n, a in calls)
    ok, after = _accepts(compiler, fmt.constraint([WEATHER, ADD]), text)
    assert ok and after[EOS]
    parsed = parse_whole(fmt.parser(), text)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    named_ok, named_after = _accepts(compiler, fmt.constraint([WEATHER, ADD], only="add"), fmt.write(*calls[1]))
    assert named_ok and np.flatnonzero(named_after).tolist() == [EOS]  # one call of the named function, then the end
    assert not _accepts(compiler, fmt.constraint([WEATHER, ADD], only="add"), fmt.write(*calls[0]))[0]
    assert not _accepts(compiler, fmt.constraint([WEATHER]), fmt.write("get_weather", '{"town": "Rome"}'))[0]


TOOL_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
                 "{% for m in messages %}<{{ m['role'] }}>{% if m.tool_calls %}{% for c in m.tool_calls %}"
                 "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n"
                 "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_tools_and_tool_calls_render_through_the_template(tmp_path):
    write_char_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer = TextTokenizer(tmp_path)
    assert tokenizer.template_takes_tools
    tools = [{"type": "function", "function": WEATHER}]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "get_weather", "arguments": {"city": "<Rome>"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tokenizer.render_messages(messages, tools)
    assert text.startswith("<tools>" + json.dumps(tools[0]) + "</tools>")
    assert 'get_weather{"city": "<Rome>"}' in text  # tojson as transformers renders it: no HTML escaping
    assert text.endswith("<tool>sunny<assistant>")  # (trim_blocks eats the newline after a block tag)


def test_a_template_without_tools_gets_them_in_the_system_message(tmp_path):
    write_char_tokenizer(tmp_path)
    assert not TextTokenizer(tmp_path).template_takes_tools
    fmt = detect_format(None)
    messages = with_tools_prompt([{"role": "user", "content": "hi"}], [{"type": "function", "function": ADD}], fmt)
    assert messages[0]["role"] == "system" and json.dumps(ADD) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert detect_format('... <|python_tag|> ...').name == "llama3_json" and detect_format("<tool_call>").name == "hermes"
