"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for page tests.

Chromium starts with a fresh profile and the flags that keep it off the network
(`--disable-background-networking` and the rest: without them it keeps trying to reach Google's
hosts), on a DevTools port it picks itself (read back from `DevToolsActivePort` in the profile).
One page is driven through its WebSocket (`websockets`' synchronous client): navigate, evaluate,
screenshot, and every console error, uncaught exception and error log entry collected.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
)


def chromium_path() -> str | None:
    """Debian's Chromium, where installed (`.ci/run` installs it)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One headless Chromium with one page.

    Args:
        width, height: the window's size in CSS pixels.
        timeout_s: how long Chromium may take to start.
    """

    def __init__(self, width: int = 1400, height: int = 1000, timeout_s: float = 60.0):
        from websockets.sync.client import connect

        executable = chromium_path()
        if executable is None:
            raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self.log = open(os.path.join(self.profile, "stderr.log"), "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                executable,
                *FLAGS,
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        port = self._port(timeout_s)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        self.socket = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self._id = 0
        self.errors: list[str] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        # the page's viewport exactly (the window's includes what headless keeps for its frame)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _port(self, timeout_s: float) -> int:
        path = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}")
            if os.path.exists(path):
                first = open(path).read().split("\n")[0].strip()
                if first:
                    return int(first)
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port in {timeout_s} s")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a DevTools method and return its result (events seen meanwhile are kept)."""
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=120))
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description", "")) for a in params.get("args", [])]
            self.errors.append("console: " + " ".join(map(str, args)))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
            )

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, ready: str, timeout_s: float = 120.0) -> Any:
        """Navigate to `url` and wait until the expression `ready` is truthy; returns its value.

        Raises:
            TimeoutError: `ready` stayed falsy for `timeout_s`.
        """
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(ready)
            if value:
                return value
            time.sleep(0.25)
        raise TimeoutError(f"{url}: {ready!r} still falsy after {timeout_s} s")

    def wait_until(self, expression: str, done: Any, timeout_s: float = 60.0) -> Any:
        """Wait, without navigating, until `done(value of expression)` holds (the page may
        reload itself meanwhile); returns that value.

        Raises:
            TimeoutError: it never held within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # the page was between two documents
                value = None
            if done(value):
                return value
            time.sleep(0.25)
        raise TimeoutError(f"{expression!r} did not get there in {timeout_s} s")

    def screenshot(self, height: int | None = None) -> bytes:
        """A PNG of the page's top (the window, or the first `height` CSS pixels)."""
        params: dict[str, Any] = {"format": "png"}
        if height is not None:
            width = self.evaluate("document.documentElement.clientWidth")
            params |= {
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
                "captureBeyondViewport": True,
            }
        return base64.b64decode(self.send("Page.captureScreenshot", **params)["data"])

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
