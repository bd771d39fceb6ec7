"""`speccompile serve --ray`: the same FastAPI app as a Ray Serve deployment, one engine per replica."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path

from ..errors import InputError, check_at_least
from .engine import EngineOptions

log = logging.getLogger("speccompile.serve")
DEPLOYMENT_NAME = "speccompile"


def parse_deployment_options(text: str | None) -> dict:
    """ray_options: a JSON object of Ray Serve deployment options (autoscaling_config, ray_actor_options, ...)."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"ray_options: not valid JSON ({exc})", "ray_options") from None
    if not isinstance(options, dict):
        raise InputError("ray_options: expected a JSON object of Ray Serve deployment options", "ray_options")
    return options


def build_deployment(options: EngineOptions, served_model_name: str | None, max_body_bytes: int, replicas: int,
                     deployment_options: dict):
    """A bound Ray Serve application: `replicas` copies of the app, each loading its own engine at start."""
    from ray import serve

    from .app import create_app
    from .loader import open_engine

    def build_app():  # runs inside each replica
        replica = serve.get_replica_context().replica_tag
        return create_app(open_engine(options, replica=replica), served_model_name, max_body_bytes)

    @serve.ingress(build_app)
    class SpeccompileServer:
        """One replica: an engine over the artifact behind the OpenAI-compatible app."""

    settings = {"ray_actor_options": {"num_cpus": options.run.threads or 1}, **deployment_options}
    if "autoscaling_config" not in settings:
        settings.setdefault("num_replicas", replicas)
    settings.setdefault("max_ongoing_requests", options.max_concurrency + options.max_queue)
    return serve.deployment(SpeccompileServer, name=DEPLOYMENT_NAME, **settings).bind()


def serve_on_ray(options: EngineOptions, host: str, port: int, served_model_name: str | None, max_body_bytes: int,
                 replicas: int, address: str | None, deployment_options: dict) -> None:
    """Deploy on a Ray cluster (`address`, or a local one) and serve until Ctrl-C / SIGTERM, then shut down."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise InputError("Ray Serve is not installed (pip install 'speccompile[ray]')") from None
    check_at_least("replicas", replicas, 1)
    if port == 0:
        raise InputError("port 0: Ray Serve's proxy needs a fixed port", "port")
    if not options.artifact.is_dir():
        raise InputError(f"{options.artifact}: not an artifact directory")
    options = _absolute(options)
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_deployment(options, served_model_name, max_body_bytes, replicas, deployment_options),
                  name=DEPLOYMENT_NAME, route_prefix="/")
        log.info("serving", extra={"fields": {"url": f"http://{host}:{port}/v1", "port": port, "ray": True,
                                              "replicas": deployment_options.get("num_replicas", replicas)}})
        _wait_for_stop()
        serve.shutdown()  # replicas finish their in-flight requests first
    finally:
        ray.shutdown()


def _absolute(options: EngineOptions) -> EngineOptions:
    """Replicas run in other processes (other machines): give them absolute paths."""
    from dataclasses import replace

    corpus = Path(options.run.ngram_corpus).resolve() if options.run.ngram_corpus else None
    return replace(options, artifact=options.artifact.resolve(), run=replace(options.run, ngram_corpus=corpus))


def _wait_for_stop() -> None:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
