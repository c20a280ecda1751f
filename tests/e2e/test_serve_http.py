# SPDX-License-Identifier: Apache-2.0
"""`vllm serve` of the tiny GLM-5 DSA model over HTTP on CPU, with the announcement's flags.

One real server process: OpenAI completions and chat completions answer, the
Prometheus endpoint reports the engine's counters, and the OffloadingConnector
given by `--kv-transfer-config` stores blocks. `--attention-config` carries
`hisparse_config`, which start-up validates and reports.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine import offloading_connector

REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny-glm5"
STARTUP_TIMEOUT_S = 300

pytestmark = pytest.mark.slow_test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process = process
        self.base = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, marker: str, timeout_s: float) -> None:
        """Read the server's log until `marker` appears; fail if it exits first."""
        while True:
            try:
                line = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                pytest.fail(f"no {marker!r} within {timeout_s}s; log tail:\n{''.join(self.lines[-40:])}")
            if line is None:
                pytest.fail(f"server exited ({self.process.wait()}); log tail:\n{''.join(self.lines[-40:])}")
            if marker in line:
                return

    def wait_listening(self, timeout_s: float) -> None:
        """Uvicorn logs startup completion just before it accepts connections: poll the
        socket itself (a readiness check on the condition, bounded by a deadline)."""
        deadline = time.monotonic() + timeout_s
        host, port = self.base.removeprefix("http://").split(":")
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
                return
            except ConnectionRefusedError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    pytest.fail(f"server not listening; log tail:\n{''.join(self.lines[-40:])}")
                time.sleep(0.05)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())
        except urllib.error.URLError as e:
            detail = e.read().decode() if isinstance(e, urllib.error.HTTPError) else ""
            pytest.fail(f"POST {path}: {e} {detail}\nserver log tail:\n{''.join(self.lines[-30:])}")

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=60) as response:
            assert response.status == 200
            return response.read().decode()


@pytest.fixture(scope="module")
def server(sparse_glm5_dir) -> Iterator[Server]:
    with offloading_connector("TieringOffloadingSpec", label="test-serve") as kv_transfer:
        yield from serve(sparse_glm5_dir, kv_transfer)


def serve(sparse_glm5_dir, kv_transfer: dict) -> Iterator[Server]:
    port = free_port()
    cmd = [
        str(REPO / ".venv" / "bin" / "vllm"),
        "serve",
        str(sparse_glm5_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--gpu-memory-utilization",
        "0.3",
        "--attention-config",
        '{"hisparse_config":{"host_pool_gib":1}}',
        "--kv-transfer-config",
        json.dumps(kv_transfer),
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(process, port)
    try:
        srv.wait_for("Application startup complete", STARTUP_TIMEOUT_S)
        srv.wait_listening(30)
        yield srv
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_startup_reports_the_hisparse_config(server):
    log = "".join(server.lines)
    assert "Hybrid HiSparse: on (mode=hybrid" in log
    assert "device_buffer_size=64" in log  # 2 x index_topk=32


def test_completions_answer(server):
    body = server.post(
        "/v1/completions",
        {
            "model": SERVED_NAME,
            "prompt": "the agent opens the file and",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert body["model"] == SERVED_NAME
    assert body["usage"]["completion_tokens"] == 8
    assert isinstance(body["choices"][0]["text"], str) and body["choices"][0]["text"]


def test_chat_completions_use_the_chat_template(server):
    body = server.post(
        "/v1/chat/completions",
        {
            "model": SERVED_NAME,
            "messages": [
                {"role": "system", "content": "you are a coding agent"},
                {"role": "user", "content": "run the tests and report"},
            ],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] > 10  # the template wraps both messages


def test_metrics_show_requests_and_offloaded_blocks(server):
    long_prompt = " ".join(["the agent edits the function and runs the tests"] * 12)
    for _ in range(2):
        server.post(
            "/v1/completions",
            {
                "model": SERVED_NAME,
                "prompt": long_prompt,
                "max_tokens": 4,
                "temperature": 0,
            },
        )
    metrics = server.get_text("/metrics")

    def value(name: str) -> float:
        rows = [line for line in metrics.splitlines() if line.startswith(name) and not line.startswith("#")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in rows)

    assert value("vllm:request_success_total") >= 2
    assert value("vllm:kv_offload_store_bytes_total") > 0
    # Hybrid HiSparse's own metrics: the host pool's size and the pages copied ahead of pressure.
    assert value("vllm:hisparse_host_pool_pages{") > 0
    assert value("vllm:hisparse_pages_copied_to_host_total") > 0
    assert value("vllm:hisparse_bytes_to_host_total") > 0
    assert "vllm:hisparse_requests{" in metrics and 'state="mixed"' in metrics
