# SPDX-License-Identifier: Apache-2.0
"""A `vllm serve` process of a local checkpoint for the demo and the benchmark.

Owns the server process (start, wait for /health, stop, remove the
OffloadingConnector's shared-memory files), its HTTP client (completions,
streamed with token timings, and /metrics) and reading Prometheus text. The
engine, the server and the metrics are vLLM's; nothing here changes them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = 600
# What a client sees when the server is gone or not answering.
SERVER_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError)


def metric(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these label values) in a /metrics page."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series != name and not series.startswith(name + "{"):
            continue
        if all(f'{key}="{val}"' in series for key, val in labels.items()):
            total += float(value)
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def offloading_connector(engine_id: str, spec_name: str, cpu_bytes: int) -> dict:
    """The announcement's --kv-transfer-config, with an engine id naming its shared memory."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"spec_name": spec_name, "cpu_bytes_to_use": cpu_bytes},
    }


@dataclass
class Completion:
    """One streamed completion as the client saw it."""

    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # request sent -> first token
    decode_s: float  # first token -> last token


class VllmServer:
    """`vllm serve <model>` on a free local port, with the given extra arguments."""

    def __init__(
        self,
        model: Path,
        served_name: str,
        serve_args: Sequence[str],
        log_path: Path,
        engine_id: str = "",
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`env`: variables added to this process's environment for the server."""
        self.port = free_port()
        self.served_name = served_name
        self.engine_id = engine_id
        self.env = {**os.environ, **env} if env else None
        self.cmd = [
            str(Path(sys.executable).parent / "vllm"), "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", served_name,
            *serve_args,
        ]  # fmt: skip
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode} during start-up")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as response:
                    if response.status == 200:
                        return
            except SERVER_ERRORS:
                pass
            time.sleep(1)
        raise RuntimeError(f"vllm serve did not answer /health within {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.engine_id:
            for leftover in Path("/dev/shm").glob(f"vllm_offload_{self.engine_id}*"):
                leftover.unlink(missing_ok=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _request(self, body: dict) -> urllib.request.Request:
        # Greedy, and always the requested length: runs compare like with like.
        body = {
            "model": self.served_name, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **body,
        }  # fmt: skip
        return urllib.request.Request(
            self.url("/v1/completions"), json.dumps(body).encode(), {"Content-Type": "application/json"}
        )

    def complete(self, prompt: list[int], max_tokens: int, **fields: object) -> dict:
        """A greedy completion; `fields` add to or override the request body (e.g. `cache_salt`)."""
        request = self._request({"prompt": prompt, "max_tokens": max_tokens, **fields})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def stream(self, prompt: list[int], max_tokens: int) -> Completion:
        """A greedy completion streamed token by token, timed at the client."""
        request = self._request({
            "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
        })  # fmt: skip
        sent = time.monotonic()
        first = last = None
        token_ids: list[int] = []
        usage: dict = {}
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    new = choice.get("token_ids") or []
                    if new:
                        last = time.monotonic()
                        first = first if first is not None else last
                        token_ids.extend(new)
        if first is None or last is None:
            raise RuntimeError("the server streamed no token")
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            token_ids=token_ids,
            prompt_tokens=usage.get("prompt_tokens", len(prompt)),
            cached_tokens=details.get("cached_tokens") or 0,
            ttft_s=first - sent,
            decode_s=last - first,
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as response:
            return response.read().decode()
