"""Run the app under uvicorn: logging (text or JSON lines), and Ctrl-C / SIGTERM as a drain that exits 0."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import time
from collections.abc import Iterator

import uvicorn

from ..errors import InputError
from .app import create_app
from .engine import EngineOptions
from .loader import open_engine

log = logging.getLogger("speccompile.serve")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's `fields` (if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextLogFormatter(logging.Formatter):
    """`LEVEL    message key=value ...` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        line = f"{record.levelname + ':':<9} {record.getMessage()}" + (f" {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def log_config(json_logs: bool) -> dict:
    """A logging.config dict for uvicorn's loggers and ours, all on stderr."""
    formatter = JsonLogFormatter if json_logs else TextLogFormatter
    handler = {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
    logger = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": formatter}},
        "handlers": {"default": handler},
        "loggers": {name: logger for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "speccompile.serve")},
    }


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that after SIGINT / SIGTERM and the drain of the in-flight requests it returns.

    uvicorn drains too, but then re-raises the signal (exit status 130, or killed by SIGTERM); a server
    stopped on purpose should exit 0. A second Ctrl-C still forces the exit.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for host:port (port 0 = any free port), or a one-line InputError."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise InputError(f"host {host}: cannot resolve it ({exc.strerror})", "host") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InputError(f"host/port: cannot listen on {host}:{port} ({exc.strerror})", ("host", "port")) from None
    return sock


def serve_http(options: EngineOptions, host: str, port: int, served_model_name: str | None, max_body_bytes: int,
               json_logs: bool) -> None:
    """Load the model, then serve it until Ctrl-C / SIGTERM (which drain the in-flight requests)."""
    config_dict = log_config(json_logs)  # uvicorn applies it
    sock = listen_socket(host, port)
    try:
        engine = open_engine(options)  # before any request: a bad artifact is a one-line error, exit 2
        app = create_app(engine, served_model_name, max_body_bytes)
        bound = sock.getsockname()
        log.info("serving", extra={"fields": {
            "model": served_model_name or engine.info.name, "drafter": engine.info.drafter,
            "url": f"http://{host}:{bound[1]}/v1", "port": bound[1], "max_context": engine.info.max_context,
        }})
        config = uvicorn.Config(app, log_config=config_dict, timeout_keep_alive=5)
        DrainingServer(config).run(sockets=[sock])
    finally:
        sock.close()
