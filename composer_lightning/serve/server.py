"""Run an ASGI app with uvicorn on a background thread, owned by the caller.

The caller keeps its signals (uvicorn installs no handlers here) and stops the server with
`stop`, which lets in-flight requests finish before it returns.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the caller owns SIGINT/SIGTERM


class BackgroundServer:
    """uvicorn serving `app` on `host:port` in a daemon thread.

    Args:
        app: the ASGI app (`make_app`).
        host: the interface; 127.0.0.1 keeps it local.
        port: the port; 0 picks a free one (bound here, so `url` is known before `start`).
        graceful_s: how long `stop` waits for in-flight requests before closing them.
        log_level: uvicorn's log level.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        graceful_s: float = 30.0,
        log_level: str = "warning",
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535] (0: a free one), got {port!r}")
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level=log_level,
            timeout_graceful_shutdown=max(1, round(graceful_s)),
            lifespan="on",
        )
        self._server = _Uvicorn(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def url(self) -> str:
        """The server's address, e.g. `http://127.0.0.1:8000`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving; returns `url` once requests are accepted."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._socket.close()
                raise RuntimeError(f"uvicorn did not start on {self.url} within {timeout_s} s")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop accepting, let in-flight requests finish, then return."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
