"""`speccompile serve`: an OpenAI-compatible HTTP server over an artifact (uvicorn, or Ray Serve with --ray)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import InputError
from ..runtime.options import SLOT_PASSES
from ..serve.tools import TOOL_FORMATS
from .generate import run_options


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 = every interface).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port (0 = any free port, logged at start).")
@click.option("--served-model-name", default=None, help="The `model` clients ask for [default: the artifact's model name].")
@click.option("--max-concurrency", type=int, default=8, show_default=True,
              help="Requests admitted at once: decoded together (as many as the backend holds at once), the others wait in arrival order.")
@click.option("--batching/--no-batching", default=True, show_default=True,
              help="Decode the admitted requests together: shared passes on the fused CPU graph with a batch axis and on "
                   "ort-cuda with the GPU slot form (export --batch-slots), else one pass per request each round (every "
                   "drafter, each request with its own); --no-batching: one request at a time.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Fused CPU graph: reuse the KV rows of earlier prompts (every shared token of a prefix, kept in 16-token "
                   "blocks, or a repeated prompt); exact by construction (docs/serving.md).")
@click.option("--prefix-cache-mb", type=int, default=512, show_default=True,
              help="Memory bound of the prefix cache (least recently used entries go first).")
@click.option("--slot-passes", type=click.Choice(SLOT_PASSES), default="off", show_default=True,
              help="Fused CPU graph: steps run as one pass of the slotted graph (export --batch-slots; one attention call per "
                   "request, drafts in the shared pass, their rows the bits they get alone): 'drafts' steps in which requests "
                   "draft (plain rows as in a batched pass), 'all' every step (batch invariance: each answer's logits bitwise its logits alone). Loads a "
                   "second copy of the weights.")
@click.option("--engine-nice", type=int, default=0, show_default=True,
              help="Unix nice increment (0-19) of the engine's threads and ONNX Runtime's pools: the HTTP event loop keeps "
                   "the process's priority, so requests are read and first tokens streamed without waiting for the cores "
                   "(on a CPU the engine uses every core; time to first token at load falls, throughput may too).")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests waiting beyond --max-concurrency; more are answered 429.")
@click.option("--max-model-len", type=int, default=None,
              help="Most tokens (prompt + completion) of one request; longer asks get 400. Sizes the batched engine's KV "
                   "pool, allocated at start: --max-concurrency x (this + max verify tokens) rows [default: the artifact's context].")
@click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True, help="Larger request bodies are answered 413.")
@click.option("--tool-call-parser", type=click.Choice(TOOL_FORMATS), default="auto", show_default=True,
              help="How the model writes tool calls: hermes (JSON in <tool_call> tags: Qwen, Hermes), llama3_json "
                   "(Llama 3.1+), or auto (from the chat template).")
@run_options
@click.option("--ray", "use_ray", is_flag=True, help="Deploy on Ray Serve (needs speccompile[ray]): one engine per replica.")
@click.option("--replicas", type=int, default=None, help="--ray: number of replicas [default: 1].")
@click.option("--ray-address", default=None, help="--ray: address of an existing Ray cluster (`ray start --head`) [default: a local one].")
@click.option("--ray-options", default=None,
              help="--ray: JSON object of Ray Serve deployment options, e.g. '{\"autoscaling_config\": {\"min_replicas\": 1, \"max_replicas\": 4}}'.")
@click.option("--json", "json_logs", is_flag=True, help="Log one JSON object per line on stderr.")
def serve(artifact, host, port, served_model_name, max_concurrency, batching, prefix_caching, prefix_cache_mb, slot_passes, engine_nice, max_queue, max_model_len, max_body_bytes, tool_call_parser, options, use_ray, replicas,
          ray_address, ray_options, json_logs):
    """Serve ARTIFACT over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).

    Ctrl-C or SIGTERM stops accepting requests, finishes the in-flight ones and exits 0.
    """
    import logging.config

    from ..serve.engine import EngineOptions
    from ..serve.server import log_config

    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in 0..65535, got {port}")
    if max_body_bytes < 1:
        raise InputError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
    if not use_ray and (replicas is not None or ray_address is not None or ray_options is not None):
        raise InputError("--replicas, --ray-address and --ray-options need --ray")
    options = EngineOptions(artifact=artifact, run=options, max_concurrency=max_concurrency, max_queue=max_queue,
                            batching=batching, prefix_caching=prefix_caching, prefix_cache_mb=prefix_cache_mb,
                            max_model_len=max_model_len, slot_passes=slot_passes, engine_nice=engine_nice,
                            tool_call_parser=tool_call_parser).validate()
    logging.config.dictConfig(log_config(json_logs))
    if use_ray:
        from ..serve.ray_app import parse_deployment_options, serve_on_ray

        serve_on_ray(options, host, port, served_model_name, max_body_bytes, replicas or 1, ray_address,
                     parse_deployment_options(ray_options))
        return
    from ..serve.server import serve_http

    serve_http(options, host, port, served_model_name, max_body_bytes, json_logs)


COMMANDS = [serve]
