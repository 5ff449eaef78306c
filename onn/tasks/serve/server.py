"""uvicorn around the app: in the foreground for task=serve (Ctrl-C ends it cleanly), or in a thread for
tests and the benchmark."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose Ctrl-C or SIGTERM only stops serving: the run then ends as `ok`, with its
        figures (uvicorn would raise the signal again on the way out)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            """The model stops first: each request in flight gets its error (a 503, a stream's error event and
            [DONE]) within uvicorn's grace period, which would otherwise cancel it with a bare 500 or a cut stream."""
            self.config.app.state.stop()
            super().handle_exit(sig, frame)

    return Server


def make_server(app: Any, host: str, port: int):
    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5, lifespan="off"
    )
    return _server_class()(config)


def bound_port(server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


class Running:
    """The app served on host:port (0: a free port) in a background thread until `stop()`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.server = make_server(app, host, port)
        self.thread = threading.Thread(target=self.server.run, name="onn-serve-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = bound_port(self.server)
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # as task=serve stops
        self.thread.join(timeout=30)
        self.app.state.close()

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
