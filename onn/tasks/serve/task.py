"""task=serve: an OpenAI-compatible HTTP API and a web page for a trained model (conf/task/serve.yaml).

    task.py      this task: its checks, the app for a job, the run that serves until Ctrl-C
    api.py       the routes, OpenAI's request and error shapes, the key and the body limits
    batching.py  continuous batching: one thread owns the model, one forward per step for every sequence
    server.py    uvicorn, in the foreground (task=serve) or in a thread (tests, task=bench_serve)
    page.html    the web page: chat with streamed tokens, or a file upload for a classifier

The model comes from the modality's `serving` hook, built as task=infer builds it (from `ckpt`, layer-streamed
when the plan streams). FastAPI and uvicorn are imported when the task runs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from onn.config import ONNConfig
from onn.config.task import ServeConfig
from onn.errors import UserError
from onn.modalities.base import Job
from onn.training.checkpoints import check_finite

log = logging.getLogger("onn")
WHOLE = ("port", "slots", "max_waiting", "max_body_bytes", "max_prompt_tokens", "max_tokens", "default_max_tokens",
         "max_stop", "max_upload_bytes", "top_k")  # fmt: skip


def check(config: ONNConfig) -> None:
    """serve.* before the model is built: one sentence per mistake."""
    settings = config.serve
    if settings is None:
        raise UserError("task=serve needs its serve.* settings: choose it with task=serve (conf/task/serve.yaml).")
    for key in WHOLE:
        value = getattr(settings, key)
        least = 0 if key == "port" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least or (key == "port" and value > 65535):
            raise UserError(
                f"serve.{key}={value!r}: give a whole number, "
                f"{least} or more{' (at most 65535)' if key == 'port' else ''}."
            )
    if not isinstance(settings.host, str) or not settings.host:
        raise UserError(f"serve.host={settings.host!r}: give an address to listen on, e.g. 127.0.0.1.")
    if settings.api_key is not None and not (isinstance(settings.api_key, str) and settings.api_key.strip()):
        raise UserError("serve.api_key: give a non-empty string, or null for none.")
    key = api_key(settings)
    if key is not None and not (key.isascii() and key.isprintable()):  # a header's bytes never equal its UTF-8
        raise UserError(
            "serve.api_key (or ONN_API_KEY) holds a character HTTP headers do not carry: give printable ASCII only."
        )


def api_key(settings: ServeConfig) -> str | None:
    """serve.api_key, else the ONN_API_KEY environment variable, else none."""
    return settings.api_key or os.getenv("ONN_API_KEY") or None


def model_name(config: ONNConfig) -> str:
    return config.serve.model_name or config.model.name


def free_address(host: str, port: int) -> None:
    """UserError when host:port cannot be listened on: the port taken (or not allowed), or the host no address of
    this machine (checked with port 0 too)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(infos[0][4])
    except OSError as e:
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise UserError(
                f"serve.host={host} is not an address of this machine ({e.strerror or e}): "
                "use 127.0.0.1, 0.0.0.0 or one of its addresses."
            ) from None
        raise UserError(
            f"serve.host={host} serve.port={port} cannot be listened on ({e.strerror or e}): "
            "choose another serve.port (0: any free one)."
        ) from None


def build_app(job: Job):
    """The app for the job's model (built by its modality, as task=infer builds it)."""
    from onn.tasks.serve.api import create_app

    served = job.modality.serving(job)
    where = f"ckpt {job.ckpt}" if job.ckpt is not None else f"model.source {job.config.model.source}"
    # every served model, a checkpoint's or model.source's: the modalities' serving hooks leave it to this check
    check_finite(served.module if hasattr(served, "classify") else served.model, where, "serve")
    return create_app(served, job.config.serve, model_name(job.config), api_key(job.config.serve))


def run(job: Job) -> dict[str, Any]:
    """Serve until Ctrl-C (or SIGTERM); the run's figures are the requests it answered."""
    from onn.tasks.serve.server import bound_port, make_server

    settings = job.config.serve
    host, key = settings.host, api_key(settings)
    if host not in ("127.0.0.1", "localhost", "::1") and not key:
        log.warning(
            "serve.host=%s opens the server to the network without a key: set serve.api_key (or ONN_API_KEY)",
            host,
        )
    free_address(host, settings.port)  # before the model is built: a taken port costs a second
    app = build_app(job)
    server = make_server(app, host, settings.port)
    name = model_name(job.config)
    kind = app.state.kind

    async def announce() -> None:
        shown = f"[{host}]" if ":" in host else host
        print(
            f"serving {name} ({kind}) on http://{shown}:{bound_port(server)}: the web page at /, the API at /v1"
            f"{' (Bearer key required)' if key else ''}; Ctrl-C stops it",
            flush=True,
        )

    original = server.startup

    async def startup(sockets=None):
        await original(sockets)
        if server.started:
            await announce()

    server.startup = startup
    try:
        server.run()
    except SystemExit:  # uvicorn's answer to an address it cannot bind: said below, in one sentence
        pass
    finally:
        app.state.close()
    if not server.started:
        raise UserError(f"serve.port={settings.port} on {host} could not be opened (in use? see the log above).")
    return figures(app)


def figures(app) -> dict[str, Any]:
    """metrics.json's serve/* figures: requests answered (a client that left midway included) and refused, and the
    tokens generated (counted as they are decoded: a client that left, or a stream Ctrl-C ended, had them too)."""
    stats, scheduler = app.state.stats, app.state.scheduler
    out = {
        "serve/requests": stats.requests,
        "serve/refused": stats.refused,
        "serve/completion_tokens": scheduler.generated if scheduler is not None else 0,
        "serve/kind": app.state.kind,
    }
    if scheduler is not None:
        out.update({"serve/decode_steps": scheduler.steps, "serve/widest_batch": scheduler.widest})
    return out
