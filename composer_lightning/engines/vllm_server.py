"""vLLM's own OpenAI-compatible server, started as a subprocess with the options that work on CPU.

    with VLLMServer("path/to/model", name="judge") as server:
        judge = OpenAIEngine(server.url)

For a served judge (`OpenAIEngine`, `NextStateJudgeScore`) or to compare against vLLM's own
serving. The same command by hand:

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server \\
        --model DIR --served-model-name NAME --host 127.0.0.1 --port PORT --dtype float32 \\
        --no-enable-chunked-prefill --enforce-eager --max-model-len 256

The `vllm serve` console script fails with vllm-cpu (it looks up the distribution "vllm",
which is named "vllm-cpu"), so the module is started instead. Chunked prefill is off for the
reason `engines/vllm.py` gives (seeded requests on CPU). Measured start: 45–100 s on 2 cores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from composer_lightning.engines.base import resolve_model_dir


class VLLMServer:
    """vLLM's OpenAI server on `model`, on a free loopback port, for the `with` block's life.

    Args:
        model: a model directory or hub id (resolved as the engines resolve it).
        name: the model id it serves (`--served-model-name`).
        threads: `OMP_NUM_THREADS` of its processes.
        max_model_len: the longest prompt + reply.
        kv_cache_gib: its KV cache on CPU, in GiB.
        start_timeout_s: how long to wait for `/v1/models` to answer.
        args: further `api_server` arguments, passed as they are.

    Attributes:
        url: its OpenAI base URL (`http://127.0.0.1:PORT/v1`), once started.
    """

    def __init__(
        self,
        model: str,
        *,
        name: str = "policy",
        threads: int = 1,
        max_model_len: int = 256,
        kv_cache_gib: int = 1,
        start_timeout_s: float = 300.0,
        args: list[str] | None = None,
    ) -> None:
        self.model = resolve_model_dir(model, "VLLMServer")
        self.name, self.threads, self.max_model_len = name, threads, max_model_len
        self.kv_cache_gib, self.start_timeout_s = kv_cache_gib, start_timeout_s
        self.args = list(args or [])
        self.url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def command(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--no-enable-chunked-prefill", "--enforce-eager",
            "--max-model-len", str(self.max_model_len), *self.args,
        ]  # fmt: skip

    def start(self) -> str:
        """Start it and wait until it answers; its URL. Fails with the end of its log when it
        exits or does not answer in time."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(self.threads),
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_NO_USAGE_STATS="1",
        )
        self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm_server_", suffix=".log")
        self._proc = subprocess.Popen(
            self.command(port), stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM's server exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"vLLM's server did not answer within {self.start_timeout_s} s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(1)
        self.url = url
        return url

    def log_tail(self, chars: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
