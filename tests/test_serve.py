"""`speccompile serve`: the real server in a child process on a loopback port, driven by the real `openai` client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import CHAT_TEMPLATE, load_benchmark, make_tiny_hf_model, run_cli
from speccompile.runtime.sampling import SamplingParams
from speccompile.runtime.session import Runner

ServerProcess = load_benchmark("server_process").ServerProcess

MODEL = "tiny"
CONTEXT = 4096
LONG_PROMPT = "The quick brown fox"  # greedy output of the tiny model never ends before the context (checked below)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """A tiny random llama with a 4096-token context: its greedy answers run for seconds, long enough to interrupt."""
    from speccompile.export.pipeline import ExportOptions, export_artifact

    root = tmp_path_factory.mktemp("serve")
    hf = make_tiny_hf_model(root / "hf", max_position_embeddings=CONTEXT)
    out = root / "artifact"
    export_artifact(str(hf), out, ExportOptions(max_context=CONTEXT))
    return out


@pytest.fixture(scope="module")
def runner(artifact) -> Runner:
    return Runner(artifact, threads=1)


@pytest.fixture(scope="module")
def server(artifact):
    """One server for the module; one request decoded plus one waiting, so a third is refused (429)."""
    process = ServerProcess(artifact, "--served-model-name", MODEL, "--threads", "1", "--max-concurrency", "1",
                            "--max-queue", "1")
    yield process
    assert process.stop() == 0


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["fused", "contract"])
def lifecycle_server(request, artifact, server):
    """The module's server (fused graph: shared passes), and one on the contract graph (one pass per request):
    one request lifecycle, so disconnects and the queue limit behave alike on both."""
    if request.param == "fused":
        yield server
        return
    process = ServerProcess(artifact, "--served-model-name", MODEL, "--threads", "1", "--max-concurrency", "1",
                            "--max-queue", "1", "--contract-graph")
    yield process
    assert process.stop() == 0


@pytest.fixture()
def lifecycle_client(lifecycle_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=lifecycle_server.url, api_key="unused", max_retries=0, timeout=120)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.base + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def _chat_prompt_ids(runner: Runner, messages: list[dict[str, str]]) -> list[int]:
    """The conftest chat template applied by hand (not through the code under test)."""
    assert "<{{ m['role'] }}>" in CHAT_TEMPLATE
    text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
    return runner.artifact.tokenizer.encode(text, add_special_tokens=False)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(server.base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_greedy_equals_runner(client, runner):
    expected = runner.generate("hello world", chat=False, max_tokens=40)
    response = client.completions.create(model=MODEL, prompt="hello world", max_tokens=40, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(runner.artifact.tokenizer.prompt_ids("hello world", chat=False))
    assert response.usage.completion_tokens == 40
    stats = response.model_extra["speculative"]
    assert stats["drafter"] == "ngram" and 1 <= stats["target_passes"] <= 40
    assert stats["generated_tokens"] == 40 and "acceptance_per_position" in stats


def test_token_id_prompt(client, runner):
    ids = runner.artifact.tokenizer.prompt_ids("abc", chat=False)
    expected = runner.generate_ids(ids, max_tokens=12)
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert response.choices[0].text == expected.text


def test_chat_system_and_multi_turn_greedy_equals_runner(client, runner):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Again?"},
    ]
    expected = runner.generate_ids(_chat_prompt_ids(runner, messages), max_tokens=30)
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(_chat_prompt_ids(runner, messages))


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["speculative"]["generated_tokens"] == 50
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 50
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_wire_format(server, runner):
    expected = runner.generate("hello world", chat=False, max_tokens=20)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_sampling_with_seed_equals_runner(client, runner):
    expected = runner.generate("abc", chat=False, max_tokens=30, sampling=SamplingParams(0.8, 20, 0.9, 3))
    kwargs = dict(model=MODEL, prompt="abc", max_tokens=30, temperature=0.8, top_p=0.9, seed=3, extra_body={"top_k": 20})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert first.choices[0].text == expected.text == again.choices[0].text


def test_stop_string(client, runner):
    full = runner.generate("hello world", chat=False, max_tokens=40).text
    stop = full[10:13]
    response = client.completions.create(model=MODEL, prompt="hello world", max_tokens=40, temperature=0, stop=[stop])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def _post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kwargs)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize("path, body, status, param", [
    ("/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("/chat/completions", b"[1, 2]", 400, None),
    ("/chat/completions", b'{"model": "tiny", "messages": [], "temperature": NaN}', 400, None),
    ("/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("/chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature"),
    ("/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/chat/completions", {**CHAT, "top_k": -3}, 400, "top_k"),
    ("/chat/completions", {**CHAT, "seed": -1}, 400, "seed"),
    ("/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/chat/completions", {**CHAT, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/chat/completions", {**CHAT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ("/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ("/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),  # without tools
    ("/chat/completions", {**CHAT, "stop": ""}, 400, "stop"),
    ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     400, "messages.0.content"),
    ("/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),  # no tool_call_id
    ("/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("/completions", {**COMPLETION, "prompt": ["a", ""]}, 400, "prompt"),
    ("/completions", {**COMPLETION, "prompt": [5, 100000]}, 400, "prompt"),
    ("/completions", {**COMPLETION, "echo": "maybe"}, 400, "echo"),
    ("/completions", {**COMPLETION, "logprobs": 6}, 400, "logprobs"),
    ("/completions", {**COMPLETION, "best_of": 3}, 400, "best_of"),
    ("/completions", {**COMPLETION, "max_tokens": CONTEXT}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_prompt_over_context_is_refused_before_any_work(server):
    before = _metrics(server)
    response = _post(server, "/completions", {**COMPLETION, "prompt": "x" * (CONTEXT + 10)})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    after = _metrics(server)
    for outcome in ("finished", "cancelled", "failed"):
        key = f"speccompile_generations_total{{outcome={outcome}}}"
        assert after.get(key, 0) == before.get(key, 0)


def test_oversize_body_is_413(server):
    response = _post(server, "/completions", {**COMPLETION, "prompt": "a" * (2 << 20)})
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]


def test_unknown_route_and_method(server):
    missing = httpx.get(server.url + "/engines")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(server.url + "/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, presence_penalty=3)


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="hello world", max_tokens=20, temperature=0)
    values = _metrics(server)
    assert values["speccompile_http_requests_total{endpoint=/v1/completions,status=200}"] >= 1
    assert values["speccompile_generated_tokens_total{}"] >= 20
    assert values["speccompile_target_passes_total{}"] >= 1
    assert values["speccompile_queue_depth{}"] == 0
    assert 0 <= values["speccompile_acceptance_rate{position=1}"] <= 1
    assert values["speccompile_draft_tokens_total{position=1}"] >= values["speccompile_accepted_draft_tokens_total{position=1}"]
    assert "speccompile_tokens_per_second{}" in values
    assert values["speccompile_time_to_first_token_seconds_count{}"] >= 1


def _wait_idle(server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(server.base + "/health").json()
        if health["running"] == 0 and health["queue_depth"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine is still busy: {health}")


def test_long_greedy_answer_does_not_end_early(runner):
    """Precondition of the disconnect tests: the long request would keep the worker busy for seconds."""
    result = runner.generate(LONG_PROMPT, chat=False, max_tokens=300)
    assert result.finish_reason == "length"


def test_disconnect_mid_stream_frees_the_worker(lifecycle_server, lifecycle_client):
    server, client = lifecycle_server, lifecycle_client
    before = _metrics(server)
    stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=CONTEXT - 100, temperature=0, stream=True)
    next(iter(stream))  # the generation is running
    stream.close()
    started = time.monotonic()
    quick = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    elapsed = time.monotonic() - started
    assert quick.model_extra["speculative"]["queue_s"] < 2.0, elapsed
    after = _metrics(server)
    cancelled = "speccompile_generations_total{outcome=cancelled}"
    assert after[cancelled] == before.get(cancelled, 0) + 1
    # only the quick request finished: the long one stopped instead of running to its ~4000 tokens
    tokens = "speccompile_generated_tokens_total{}"
    assert after[tokens] - before[tokens] == quick.usage.completion_tokens


def test_full_queue_is_429_and_cancelled_waiters_leave(lifecycle_server, lifecycle_client):
    server, client = lifecycle_server, lifecycle_client
    long = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=CONTEXT - 100, temperature=0, stream=True)
    running = client.completions.create(**long)
    next(iter(running))
    waiting = client.completions.create(**long)  # admitted: waits behind the running one
    assert httpx.get(server.base + "/health").json()["queue_depth"] == 1
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    waiting.close()
    running.close()
    _wait_idle(server)
    # greedy: an unseeded sampled answer met end-of-sequence within 2 tokens about once in 150 runs (issue 47)
    answer = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"


def test_sigterm_drains_in_flight_and_exits_zero(artifact):
    process = ServerProcess(artifact, "--threads", "1")
    try:
        client = openai.OpenAI(base_url=process.url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=150, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)
        process.process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 150
        assert process.process.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(process.base + "/health")
    finally:
        process.stop(signal.SIGKILL)


@pytest.mark.parametrize("args, message", [
    (["--max-queue", "-1"], "--max-queue"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--replicas", "2"], "--ray"),
    (["--port", "70000"], "--port"),
    (["--max-model-len", "1"], "--max-model-len"),
    (["--max-model-len", str(CONTEXT + 1)], "--max-model-len"),
    (["--prefix-cache-mb", "0"], "--prefix-cache-mb"),
    (["--slot-passes", "all", "--max-concurrency", "9"], "--batch-slots"),  # the slotted graph has 8 slots
    (["--slot-passes", "never"], "--slot-passes"),
    (["--engine-nice", "20"], "--engine-nice"),
])
def test_cli_rejects_bad_options(artifact, args, message):
    result = run_cli("serve", str(artifact), *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_rejects_missing_artifact(tmp_path):
    result = run_cli("serve", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_rejects_busy_port(artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_cli("serve", str(artifact), "--port", str(taken.getsockname()[1]))
    assert result.returncode == 2 and "cannot listen" in result.stderr and "Traceback" not in result.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_two_replicas_serve_concurrent_requests(artifact, runner):
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e .[ray])")
    port = _free_port()
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    try:
        process = ServerProcess(artifact, "--ray", "--replicas", "2", "--port", str(port), "--threads", "1",
                                "--served-model-name", MODEL, startup_timeout=600, env={"RAY_TMPDIR": ray_tmp})
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
            prompts = ["hello world", "abc", "The quick", "xyz", "fox", "hi there"]
            expected = {p: runner.generate(p, chat=False, max_tokens=60).text for p in prompts}
            replicas: set[str] = set()
            lock = threading.Lock()

            def ask(prompt: str) -> None:
                raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0)
                completion = raw.parse()
                assert completion.choices[0].text == expected[prompt]
                assert completion.model_extra["speculative"]["replica"] == raw.headers["x-speccompile-replica"]
                with lock:
                    replicas.add(raw.headers["x-speccompile-replica"])

            for _ in range(5):  # Ray routes by load: concurrent rounds until both replicas answered
                with ThreadPoolExecutor(len(prompts)) as pool:
                    list(pool.map(ask, prompts))
                if len(replicas) == 2:
                    break
            assert len(replicas) == 2, replicas
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=10, temperature=0, stream=True)
            assert sum(1 for c in stream if c.choices and c.choices[0].finish_reason) == 1
        finally:
            assert process.stop() == 0
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.parametrize("mode", [[], ["--slot-passes", "drafts"], ["--slot-passes", "all"]])
def test_concurrent_greedy_requests_are_batched_and_equal_runner(artifact, runner, mode):
    """Four requests at once on the batched engine: each answer equals the Runner's alone, streaming or not
    (by default and with every step a slot pass)."""
    prompts = ["hello world", "abc abc abc abc", "The quick brown fox", "x"]
    expected = [runner.generate(p, chat=False, max_tokens=48).text for p in prompts]
    with ServerProcess(artifact, "--served-model-name", MODEL, "--threads", "1", "--max-concurrency", "4", *mode) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

        def ask(i: int) -> tuple[str, dict]:
            kwargs = dict(model=MODEL, prompt=prompts[i], max_tokens=48, temperature=0)
            if i % 2:
                chunks = list(client.completions.create(**kwargs, stream=True))
                return "".join(c.choices[0].text for c in chunks), chunks[-1].model_extra["speculative"]
            response = client.completions.create(**kwargs)
            return response.choices[0].text, response.model_extra["speculative"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, range(len(prompts))))
        passes = _metrics(server)
    assert [text for text, _ in answers] == expected
    if mode[-1:] == ["all"]:  # every step of two or more requests a slot pass
        assert passes["speccompile_batch_passes_total{kind=slot}"] > 0
    if not mode:
        assert passes["speccompile_batch_passes_total{kind=slot}"] == 0 < passes["speccompile_batch_passes_total{kind=batched}"]
    assert all(stats["batched"] for _, stats in answers)


def test_max_model_len_bounds_requests_and_the_kv_pool(artifact, runner):
    """--max-model-len: reported by /v1/models, longer asks are 400 before any work, shorter ones answer as alone."""
    with ServerProcess(artifact, "--served-model-name", MODEL, "--threads", "1", "--max-model-len", "40") as server:
        models = httpx.get(server.url + "/models").json()["data"]
        assert models[0]["max_model_len"] == 40
        ids = runner.artifact.tokenizer.prompt_ids("hello world", chat=False)
        too_long = _post(server, "/completions", {"model": MODEL, "prompt": "hello world", "max_tokens": 41 - len(ids)})
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(model=MODEL, prompt="hello world", max_tokens=40 - len(ids), temperature=0)
    assert response.choices[0].text == runner.generate("hello world", chat=False, max_tokens=40 - len(ids)).text


def test_no_batching_flag_serves_one_request_at_a_time(artifact, runner):
    expected = runner.generate("abc", chat=False, max_tokens=8).text
    with ServerProcess(artifact, "--served-model-name", MODEL, "--threads", "1", "--no-batching") as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
    assert response.choices[0].text == expected and response.model_extra["speculative"]["batched"] is False


def test_a_cached_prompt_streams_its_first_token_before_it_joins(artifact, runner):
    """In process, one slot: while a long request holds it, a repeated prompt (its logits in the prefix cache)
    gets its first token's text at submission, still queued; once it joins, its answer is the Runner's alone
    and its deltas add up to it (the first one is not sent twice)."""
    import asyncio

    from speccompile.runtime.options import RunOptions
    from speccompile.serve.engine import EngineOptions
    from speccompile.serve.loader import open_engine
    from speccompile.serve.requests import Finished, GenerationRequest, TextDelta

    tokenizer = runner.artifact.tokenizer
    ids = tuple(tokenizer.prompt_ids("hello world", chat=False))
    expected = runner.generate_ids(list(ids), 24).text

    async def scenario() -> tuple[str, list[str], Finished, int]:
        engine = open_engine(EngineOptions(artifact, RunOptions(threads=1), max_concurrency=1, max_queue=2))
        engine.start()
        try:
            first = await engine.submit(GenerationRequest(ids, 24)).result()  # prefilled: now in the cache
            long = engine.submit(GenerationRequest(tuple(tokenizer.prompt_ids(LONG_PROMPT, chat=False)), 3000))
            async for _ in long.events():  # it holds the slot
                break
            repeat = engine.submit(GenerationRequest(ids, 24))
            events = repeat.events()
            opening = await asyncio.wait_for(events.__anext__(), 30)
            queued = engine.waiting
            long.cancel()
            deltas, finished = [opening.text], None
            async for event in events:
                if isinstance(event, TextDelta):
                    deltas.append(event.text)
                else:
                    finished = event
            return first.text, deltas, finished, queued
        finally:
            engine.shutdown(60)

    first_text, deltas, finished, queued = asyncio.run(scenario())
    assert queued == 1  # the repeat had not joined when its first text arrived
    assert first_text == finished.text == "".join(deltas) == expected
    assert finished.cached_tokens == len(ids) and finished.speculative["time_to_first_token_s"] < finished.speculative["queue_s"]


def _thread_nice() -> dict[int, int]:
    """Linux: the nice value of every thread of this process, by thread id."""
    values = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        values[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return values


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread priorities from Linux /proc")
def test_engine_nice_lowers_the_engine_threads_only(artifact, runner):
    """--engine-nice 3: the worker thread and ONNX Runtime's pool threads run 3 nice steps lower, the thread that
    opened the engine (the event loop's) keeps its priority; answers are unchanged."""
    import asyncio

    from speccompile.runtime.options import RunOptions
    from speccompile.serve.engine import EngineOptions
    from speccompile.serve.loader import open_engine
    from speccompile.serve.requests import GenerationRequest

    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(_thread_nice())
    ids = tuple(runner.artifact.tokenizer.prompt_ids("hello world", chat=False))
    engine = open_engine(EngineOptions(artifact, RunOptions(threads=2), max_concurrency=2, engine_nice=3))
    engine.start()
    try:
        niced = {tid for tid, nice in _thread_nice().items() if nice == base + 3}
        assert engine._worker.native_id in niced and niced - before - {engine._worker.native_id}  # + ONNX Runtime's pools
        assert _thread_nice()[threading.get_native_id()] == base

        async def ask() -> str:
            return (await engine.submit(GenerationRequest(ids, 12)).result()).text

        assert asyncio.run(ask()) == runner.generate_ids(list(ids), 12).text
    finally:
        engine.shutdown(60)
