"""Open a server's model: the runtime's Runner and the engine that serves it (runtime/batch.py on every backend)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .batched_engine import BatchedEngine
from .engine import Engine, EngineOptions, log, niced


def open_runner(options: EngineOptions):
    """The runtime's Runner for a server: its event loop and (with slot passes) a second graph take turns with
    the target's passes on the same cores, so ONNX Runtime's threads busy-wait only within a run
    (`RunOptions.shared_cores`)."""
    import dataclasses

    from ..runtime.session import Runner

    return Runner(options.artifact, dataclasses.replace(options.run, shared_cores=True))


def open_engine(options: EngineOptions, replica: str | None = None) -> Engine:
    """Load the artifact and return the engine that serves it (not started): the batch decoder's loop, with shared
    passes when the artifact's graph allows it and `options.batching`, else one pass per request.

    With `engine_nice` the engine is built on a thread of its own at that nice increment, so the thread pools
    of its ONNX Runtime sessions inherit it (as does the worker thread, which raises its own when it starts):
    the engine then yields the cores to the event loop, whose requests are parsed and streamed without waiting
    for a pass (docs/serving.md)."""
    if not options.validate().engine_nice:
        return _open_engine(options, replica)
    built: list = []
    thread = threading.Thread(target=niced(options.engine_nice, lambda: built.append(_capture(_open_engine, options, replica))),
                              name="speccompile-engine-loader")
    thread.start()
    thread.join()
    if isinstance(built[0], Exception):
        raise built[0]
    return built[0]


def _capture(function: Callable, *args):
    """function(*args), or the exception it raised (to be raised again on the calling thread)."""
    try:
        return function(*args)
    except Exception as exc:
        return exc


def _open_engine(options: EngineOptions, replica: str | None) -> Engine:
    runner = open_runner(options)
    problem = runner.batch_problem() if options.batching else "batching is off"
    if problem is not None:
        log.info("requests share no pass: one pass per request each round", extra={"fields": {"reason": problem}})
    return BatchedEngine(options, runner, replica)
