"""`report RUN_DIR --serve`: the report on 127.0.0.1 while the run goes on.

The page is written again when one of the run's files changed (their names, sizes and
modification times: the "stamp"), at most once per request; the page holds the stamp it was
written at, asks `/stamp` every `refresh_s` seconds and reloads when the two differ, keeping its
search and filters. Only the
loopback interface is bound: the report shows prompts and replies, which are not for the
network.
"""

from __future__ import annotations

import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from composer_lightning.report.page import render
from composer_lightning.report.read import read_run


def stamp(run_dir: str) -> str:
    """What changes when a step lands: every file's name, size and modification time in the run
    directory (and `turns.sqlite` beside it)."""
    entries = []
    parent = os.path.dirname(os.path.abspath(run_dir))
    paths = [os.path.join(run_dir, n) for n in sorted(os.listdir(run_dir))]
    paths += [os.path.join(parent, n) for n in ("turns.sqlite", "turns.sqlite-wal")]
    for path in paths:
        if os.path.isfile(path) and not path.endswith((".html", ".tmp")):
            info = os.stat(path)
            entries.append(f"{os.path.basename(path)}:{info.st_size}:{info.st_mtime_ns}")
    return hashlib.sha1("\n".join(entries).encode()).hexdigest()[:16]


class ReportServer:
    """Serve the report of `run_dir` on 127.0.0.1.

    Args:
        run_dir: the run directory.
        port: the port; 0: a free one (`url` says which).
        refresh_s: how often the page asks whether the run changed.
        options: `read_run`'s limits and `render`'s `plain_js`.
    """

    def __init__(self, run_dir: str, port: int = 0, refresh_s: float = 5.0, **options: Any):
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s!r}")
        self.run_dir, self.refresh_s = run_dir, float(refresh_s)
        self.plain_js = bool(options.pop("plain_js", False))
        self.options = options
        self._lock = threading.Lock()
        self._page: tuple[str, bytes] | None = None  # (stamp, page)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def page(self) -> bytes:
        """The page of the run as it is now (written again only when the stamp changed)."""
        with self._lock:
            now = stamp(self.run_dir)
            if self._page is None or self._page[0] != now:
                data = read_run(self.run_dir, **self.options)
                html = render(data, plain_js=self.plain_js, refresh_s=self.refresh_s, stamp=now)
                self._page = (now, html.encode("utf-8"))
            return self._page[1]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                if path in ("/", "/report.html"):
                    body, kind = server.page(), "text/html; charset=utf-8"
                elif path == "/stamp":
                    body, kind = stamp(server.run_dir).encode(), "text/plain"
                elif path == "/favicon.ico":  # a browser asks: nothing, rather than an error
                    self.send_response(204)
                    self.end_headers()
                    return
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # one line per poll would bury the run's own output

        return Handler

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
