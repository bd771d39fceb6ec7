"""Structured outputs, logprobs and tool calls through the real server (batched, n-gram drafter) and the real
`openai` client: every answer equals the Runner's plain constrained greedy answer, parses and validates."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from conftest import load_benchmark, make_tiny_hf_model
from speccompile.runtime.constraints import ConstraintSpec
from speccompile.runtime.session import Runner

ServerProcess = load_benchmark("server_process").ServerProcess

MODEL = "tiny"
TOOL_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
                 "{% for m in messages %}<{{ m['role'] }}>{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
                 "{{ c.function.name }}{{ c.function.arguments | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}"
                 "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


class Colour(BaseModel):
    name: str = Field(max_length=6)
    shade: Literal["light", "dark"]
    level: int = Field(ge=0, le=9)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """The tiny random llama, its chat template rendering tools."""
    from speccompile.export.pipeline import ExportOptions, export_artifact

    root = tmp_path_factory.mktemp("structured")
    hf = make_tiny_hf_model(root / "hf")
    config = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    export_artifact(str(hf), root / "artifact", ExportOptions(max_context=512))
    return root / "artifact"


@pytest.fixture(scope="module")
def runner(artifact) -> Runner:
    return Runner(artifact, threads=1)


@pytest.fixture(scope="module")
def client(artifact):
    with ServerProcess(artifact, "--served-model-name", MODEL, "--threads", "1", "--max-concurrency", "4") as server:
        yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _plain(runner: Runner, messages, spec: ConstraintSpec | None, tools=None, logprobs=None, max_tokens=60):
    """The Runner's plain (no drafter) greedy answer to a chat, through the same template."""
    ids = runner.artifact.tokenizer.encode(runner.artifact.tokenizer.render_messages(messages, tools), add_special_tokens=False)
    return runner.generate_ids(ids, max_tokens, stop=None, drafter="none", constraint=spec, logprobs=logprobs)


def test_response_format_pydantic_schema_concurrent_equals_plain(client, runner):
    prompts = [[{"role": "user", "content": f"Describe colour {i} {'abc' * i}"}] for i in range(4)]

    def ask(messages):
        return client.chat.completions.parse(model=MODEL, messages=messages, response_format=Colour, temperature=0, max_tokens=60)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    for messages, answer in zip(prompts, answers):
        parsed = answer.choices[0].message.parsed
        assert isinstance(parsed, Colour)
        schema = openai.lib._pydantic.to_strict_json_schema(Colour)
        assert answer.choices[0].message.content == _plain(runner, messages, ConstraintSpec.json_schema(schema)).text
    assert any(a.model_extra["speculative"]["batched"] for a in answers)


@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ({"extra_body": {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}}, lambda text: len(text) == 6 and text[3] == "-"),
    ({"extra_body": {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}}, lambda text: text in ("alpha", "beta", "gamma")),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}}, lambda text: text[0] == "x" and text[1:].isdigit()),
])
def test_other_constraints(client, extra, check):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=40, **extra)
    assert check(answer.choices[0].message.content)


def test_bad_schema_and_regex_are_400_before_any_work(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert error.value.body["param"] == "response_format" and "nonsense" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"structured_outputs": {"regex": "(ab"}})
    assert error.value.body["param"] == "structured_outputs"


def test_chat_logprobs_equal_plain_and_stream_alike(client, runner):
    spec = ConstraintSpec("regex", "[a-z ]{5,20}")
    answer = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=30, logprobs=True, top_logprobs=3,
                                            extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}})
    plain = _plain(runner, ASK, spec, logprobs=3, max_tokens=30)
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content == plain.text and len(content) == len(plain.logprobs)
    for got, want in zip(content, plain.logprobs):
        assert abs(got.logprob - want.logprob) <= 1e-5
        assert len(got.top_logprobs) == 3 and got.top_logprobs[0].logprob >= got.logprob
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=30, logprobs=True,
                                                 top_logprobs=3, stream=True,
                                                 extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs(client, runner):
    answer = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, temperature=0, logprobs=2)
    plain = runner.generate("hello world", chat=False, max_tokens=12, drafter="none", logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == plain.text and len(logprobs.tokens) == 12
    assert max(abs(a - b.logprob) for a, b in zip(logprobs.token_logprobs, plain.logprobs)) <= 1e-5
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_parse_and_validate(client, runner, choice):
    """(One call: a random model given room for more would go on calling until max_tokens.)"""
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                            parallel_tool_calls=False, temperature=0, max_tokens=120)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.tool_calls
    names = {"get_weather": WEATHER, "add": ADD}
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        schema = names[call.function.name]["function"]["parameters"]
        assert set(arguments) == set(schema["required"]) and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["add"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                                 parallel_tool_calls=False, temperature=0, max_tokens=120, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or (delta.function.name if delta.function else None)
            entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tools_and_a_tool_conversation(client, runner):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto",
                                            temperature=0, max_tokens=20)
    as_rendered = [*messages[:1], {**messages[1], "tool_calls": [  # the server hands templates the arguments as an object
        {**messages[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, messages[2]]
    plain = _plain(runner, as_rendered, None, tools=[WEATHER], max_tokens=20)
    assert answer.choices[0].message.tool_calls is None  # a random model writes no <tool_call>
    assert answer.choices[0].message.content == plain.text.rstrip()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_request_may_decode_without_the_drafter(client):
    schema = {"name": "c", "schema": Colour.model_json_schema(), "strict": True}
    body = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=60, response_format={"type": "json_schema", "json_schema": schema})
    fast = client.chat.completions.create(**body)
    plain = client.chat.completions.create(**body, extra_body={"drafter": "none"})
    assert plain.choices[0].message.content == fast.choices[0].message.content
    assert plain.model_extra["speculative"]["draft_steps"] == 0 < fast.model_extra["speculative"]["draft_steps"]
    assert plain.model_extra["speculative"]["drafter"] == "none" != fast.model_extra["speculative"]["drafter"]
