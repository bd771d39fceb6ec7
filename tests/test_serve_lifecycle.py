"""One request lifecycle for every backend: the serving engine (serve/batched_engine.py) in process, over the fused
CPU graph (shared passes), the contract graph and the GPU verify graph on the CPU EP (one pass per request):
concurrent answers equal each request alone, cancellation frees the slot, a failing pass fails its requests and the
worker goes on, shutdown drains, and the metrics count each outcome."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from speccompile.runtime import Runner
from speccompile.runtime.generate import Generation
from speccompile.runtime.options import RunOptions
from speccompile.serve.batched_engine import BatchedEngine
from speccompile.serve.engine import EngineOptions
from speccompile.serve.requests import GenerationFailed, GenerationRequest
from test_batch_passes import gpu_form_artifact, gpu_session_runner  # noqa: F401 (a fixture)
from test_gpu_slots import gpu_runner, slot_artifact  # noqa: F401 (a fixture)

MODES = ["fused", "contract", "gpu-form", "gpu-slots"]
PROMPTS = ["abc abc abc abc", "hello world", "The quick brown fox", "x"]


@pytest.fixture()
def artifacts(gpu_form_artifact, slot_artifact) -> dict:
    return {"gpu_form": gpu_form_artifact, "slots": slot_artifact}


def _runner(mode: str, artifacts: dict) -> Runner:
    if mode == "gpu-form":  # the GPU graph without its slotted form: one request at a time
        return gpu_session_runner(artifacts["gpu_form"], drafter="ngram")
    if mode == "gpu-slots":
        return gpu_runner(artifacts["slots"], drafter="ngram")
    return Runner(artifacts["gpu_form"][0], RunOptions(drafter="ngram", threads=1, contract_graph=mode == "contract"))


def _engine(mode: str, artifacts: dict, **options) -> tuple[BatchedEngine, Runner]:
    runner = _runner(mode, artifacts)
    engine = BatchedEngine(EngineOptions(runner.artifact.directory, runner.options, **options), runner)
    engine.start()
    return engine, runner


def _ids(runner: Runner, text: str) -> tuple[int, ...]:
    return tuple(runner.artifact.tokenizer.prompt_ids(text, chat=False))


def _outcomes(engine: BatchedEngine) -> dict[str, float]:
    return {outcome: engine.metrics.generations.labels(outcome)._value.get() for outcome in ("finished", "cancelled", "failed")}


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_requests_equal_each_alone(mode, artifacts):
    engine, runner = _engine(mode, artifacts, max_concurrency=4)
    try:
        prompts = [_ids(runner, p) for p in PROMPTS]
        expected = [runner.generate_ids(list(ids), 24).text for ids in prompts]

        async def ask_all():
            handles = [engine.submit(GenerationRequest(ids, 24)) for ids in prompts]
            return await asyncio.gather(*(h.result() for h in handles))

        answers = asyncio.run(ask_all())
    finally:
        engine.shutdown(60)
    assert [a.text for a in answers] == expected
    assert all(a.speculative["batched"] == (mode in ("fused", "gpu-slots")) for a in answers)
    runs = {"fused": ("fused", "off"), "gpu-slots": ("gpu-slots", "all")}.get(mode, ("one-per-request", "off"))
    assert all((a.speculative["batch_mode"], a.speculative["slot_passes"]) == runs for a in answers)
    assert engine._decoder.slots == (1 if mode == "gpu-form" else 4)
    assert _outcomes(engine)["finished"] == len(prompts)


@pytest.mark.parametrize("mode", MODES)
def test_cancelling_frees_the_slot(mode, artifacts, monkeypatch):
    """A cancelled request stops at its next step; the next request then decodes at once, as alone."""
    slow = Generation.complete_step
    monkeypatch.setattr(Generation, "complete_step", lambda self, plan, out: (time.sleep(0.02), slow(self, plan, out)))
    engine, runner = _engine(mode, artifacts, max_concurrency=1, max_queue=1)
    try:
        async def scenario():
            long = engine.submit(GenerationRequest(_ids(runner, PROMPTS[2]), 200))
            async for _ in long.events():
                break
            long.cancel()
            started = time.perf_counter()
            quick = await engine.submit(GenerationRequest(_ids(runner, "hi"), 4)).result()
            return quick, time.perf_counter() - started

        quick, waited = asyncio.run(scenario())
    finally:
        engine.shutdown(60)
    assert quick.text == runner.generate_ids(list(_ids(runner, "hi")), 4).text
    assert waited < 2.0  # not the long request's ~200 slow steps
    assert _outcomes(engine) == {"finished": 1, "cancelled": 1, "failed": 0}
    assert engine.running == 0 and engine.waiting == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_step_fails_its_requests_and_the_worker_goes_on(mode, artifacts, monkeypatch):
    boom: list[int] = []
    complete = Generation.complete_step

    def failing(self, plan, out):
        if self.prompt_ids == boom and len(self.tokens) > len(self.prompt_ids) + 2:
            raise RuntimeError("device lost")
        return complete(self, plan, out)

    monkeypatch.setattr(Generation, "complete_step", failing)
    engine, runner = _engine(mode, artifacts, max_concurrency=2)
    boom.extend(_ids(runner, "boom boom"))
    try:
        async def scenario():
            failed = engine.submit(GenerationRequest(tuple(boom), 20))
            with pytest.raises(GenerationFailed) as raised:
                await failed.result()
            after = await engine.submit(GenerationRequest(_ids(runner, PROMPTS[0]), 12)).result()
            return raised.value, after

        error, after = asyncio.run(scenario())
    finally:
        engine.shutdown(60)
    assert not error.client_error and "device lost" in str(error)
    assert after.text == runner.generate_ids(list(_ids(runner, PROMPTS[0])), 12).text
    assert _outcomes(engine) == {"finished": 1, "cancelled": 0, "failed": 1}


@pytest.mark.parametrize("mode", MODES)
def test_a_bad_request_is_the_clients_error_and_shutdown_drains(mode, artifacts):
    engine, runner = _engine(mode, artifacts, max_concurrency=2)
    context = runner.artifact.max_context

    async def scenario():
        too_long = engine.submit(GenerationRequest(tuple([5] * context), 4))
        running = [engine.submit(GenerationRequest(_ids(runner, p), 16)) for p in PROMPTS[:3]]
        with pytest.raises(GenerationFailed) as raised:
            await too_long.result()
        with ThreadPoolExecutor(1) as pool:  # shutdown while they decode: each still finishes
            stopping = asyncio.get_running_loop().run_in_executor(pool, engine.shutdown, 60)
            answers = await asyncio.gather(*(h.result() for h in running))
            await stopping
        return raised.value, answers

    error, answers = asyncio.run(scenario())
    assert error.client_error
    assert [a.text for a in answers] == [runner.generate_ids(list(_ids(runner, p)), 16).text for p in PROMPTS[:3]]
    assert _outcomes(engine) == {"finished": 3, "cancelled": 0, "failed": 1}
