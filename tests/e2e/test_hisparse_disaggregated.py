# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation: a remote prefix lands in the decode instance's host pool.

Real `vllm serve` processes on CPU: a prefill instance (`kv_producer`) and a
decode instance (`kv_consumer`) share ExampleConnector's storage behind the
proxy of scripts/pd_proxy.py. The decode instance runs Hybrid HiSparse with a
KV pool that cannot hold the concurrent sessions' prefixes, so its imports
land in the host pool. Several multi-turn sessions go through the proxy:
- greedy tokens equal those of one all-resident instance that serves the same
  sessions (float32, and both it and the prefill instance compute each prompt
  in one chunk, so the prefix rows are computed alike);
- the decode instance's metrics show pages imported to the host pool, requests
  started NONE, and prompt tokens computed only for what the import leaves
  (each prompt's tail past its stored prefix): nothing imported is recomputed;
- the same decode instance with HiSparse off and the same pool lands every
  import on the device, so it holds fewer sessions at once; its tokens must be
  the same, and the contrast (running requests, preemptions, prompt tokens
  computed, wall time) is printed for the record;
- over NixlConnector (UCX on the CPU) the decode instance with HiSparse pulls
  every prompt, the pages it lands on the host straight into its host pool,
  and gives the same tokens; the proxy signs what it sends with the secret it
  shares with the decode instance, and a client that names a peer itself
  (unsigned, or signed with another secret) is refused with a 400: the peer's
  listener is never contacted and the decode instance holds nothing for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine import SPARSE_GLM5, model_dir
from serving import SERVER_ERRORS, VllmServer, free_port, metric

pytestmark = [pytest.mark.slow_test, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 64
# The decode instance's KV cache: 52 blocks of the HiSparse grouping (17 pages of each
# of its 3 groups, and the null block), one whole request and short of the sessions;
# the same memory holds 24 pages of the single group without HiSparse.
DECODE_KV_CACHE_BYTES = 7_700_000
HOST_POOL_PAGES = 200
SESSIONS = 4
TURNS = 3
FIRST_PROMPT = 380
TURN_PROMPT = 40
OUTPUT_TOKENS = 12
COMMON = ["--max-model-len", "1024", "--enforce-eager", "--seed", "0", "--dtype", "float32"]
# Each prompt is computed in one chunk on the prefill and the reference instance alike.
ONE_CHUNK = ["--max-num-batched-tokens", "4096", "--kv-cache-memory-bytes", str(256 << 20)]


def host_pool_gib(pages: int) -> float:
    """A pool of `pages` pages (plus half a page for rounding) of the tiny model's float32 rows."""
    row_bytes = (SPARSE_GLM5.kv_lora_rank + SPARSE_GLM5.qk_rope_head_dim) * 4
    return (pages + 0.5) * SPARSE_GLM5.num_hidden_layers * BLOCK_SIZE * row_bytes / (1 << 30)


def example_connector(role: str, storage: Path) -> list[str]:
    config = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
    return ["--kv-transfer-config", json.dumps(config)]


HISPARSE_CONFIG = {"hisparse_config": {"host_pool_gib": host_pool_gib(HOST_POOL_PAGES)}}
HISPARSE = ["--attention-config", json.dumps(HISPARSE_CONFIG)]
# The decode instance: a KV cache short of the sessions.
DECODE = [*COMMON, "--kv-cache-memory-bytes", str(DECODE_KV_CACHE_BYTES)]


class Proxy:
    """scripts/pd_proxy.py in a process of its own."""

    def __init__(self, prefill: VllmServer, decode: VllmServer, log: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.env = {**os.environ, **env} if env else None
        self.cmd = [sys.executable, str(REPO / "scripts" / "pd_proxy.py"), "--port", str(self.port),
                    "--prefill", prefill.url(""), "--decode", decode.url("")]  # fmt: skip
        self.log = log
        self.served_name = decode.served_name

    @contextlib.contextmanager
    def running(self):
        with self.log.open("wb") as log:
            process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
            try:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                            break
                    except SERVER_ERRORS:
                        assert process.poll() is None and time.monotonic() < deadline, self.log.read_text()
                        time.sleep(0.5)
                yield self
            finally:
                process.terminate()
                process.wait(timeout=30)

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())


def run_sessions(client) -> tuple[dict[tuple[int, int], list[int]], list[int]]:
    """Concurrent multi-turn sessions: (session, turn) -> greedy tokens, and every prompt's length."""
    rng = random.Random(14)
    openings = [[rng.randrange(3, 500) for _ in range(FIRST_PROMPT + 24 * s)] for s in range(SESSIONS)]
    turns = [
        [[rng.randrange(3, 500) for _ in range(TURN_PROMPT)] for _ in range(TURNS)] for _ in range(SESSIONS)
    ]
    prompt_lengths: list[int] = []

    def session(s: int) -> dict[tuple[int, int], list[int]]:
        context, out = openings[s], {}
        for t in range(TURNS):
            prompt = context if t == 0 else context + turns[s][t]
            choice = client.complete(prompt, OUTPUT_TOKENS)["choices"][0]
            assert choice["finish_reason"] == "length", choice
            out[(s, t)] = choice["token_ids"]
            prompt_lengths.append(len(prompt))
            context = prompt + choice["token_ids"]
        return out

    with ThreadPoolExecutor(SESSIONS) as pool:
        results = list(pool.map(session, range(SESSIONS)))
    return {key: tokens for result in results for key, tokens in result.items()}, prompt_lengths


def stored_prefix(num_prompt_tokens: int) -> int:
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


class RunningSampler:
    """The decode instance's running requests, read from /metrics while the sessions run."""

    def __init__(self, server: VllmServer) -> None:
        self.server, self.samples = server, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.25):
            self.samples.append(metric(self.server.metrics(), "vllm:num_requests_running"))

    def __enter__(self) -> RunningSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def through_proxy(
    prefill: VllmServer, decode: VllmServer, logs: Path, name: str, proxy_env: dict | None = None, after=None
) -> DecodeRun:
    """The sessions through the proxy in front of `decode`, which starts and stops here;
    `after(decode)` runs once they are done, before `decode` stops."""
    with contextlib.ExitStack() as stack:
        decode.start()
        stack.callback(decode.stop)
        proxy = stack.enter_context(Proxy(prefill, decode, logs / f"proxy-{name}.log", proxy_env).running())
        started = time.monotonic()
        with RunningSampler(decode) as running:
            tokens, lengths = run_sessions(proxy)
        wall_s = time.monotonic() - started
        if after is not None:
            after(decode)
        return DecodeRun(tokens, lengths, decode.metrics(), running.samples, wall_s)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[tuple[int, int], list[int]]:
    """The sessions' greedy tokens on one all-resident instance."""
    server = VllmServer(
        model_dir(SPARSE_GLM5),
        "tiny-glm5",
        [*COMMON, *ONE_CHUNK],
        tmp_path_factory.mktemp("serve-reference") / "reference.log",
    )
    server.start()
    try:
        return run_sessions(server)[0]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference):
    """The sessions through P/D over ExampleConnector, HiSparse on and off."""
    logs = tmp_path_factory.mktemp("serve-pd")
    model = model_dir(SPARSE_GLM5)
    out = {"reference": reference}
    storage = logs / "storage"
    prefill_args = [*COMMON, *ONE_CHUNK, *example_connector("kv_producer", storage)]
    prefill = VllmServer(model, "tiny-glm5", prefill_args, logs / "prefill.log")
    prefill.start()
    try:
        for name, hisparse in (("on", True), ("off", False)):
            decode_args = DECODE + example_connector("kv_consumer", storage) + (HISPARSE if hisparse else [])
            decode = VllmServer(model, "tiny-glm5", decode_args, logs / f"decode-{name}.log")
            out[name] = through_proxy(prefill, decode, logs, name)
    finally:
        prefill.stop()
    return out


@dataclasses.dataclass
class DecodeRun:
    tokens: dict[tuple[int, int], list[int]]
    prompt_lengths: list[int]
    metrics: str
    running: list[float]
    wall_s: float

    def count(self, name: str, **labels: str) -> float:
        return metric(self.metrics, name, **labels)

    @property
    def computed_prompt_tokens(self) -> float:
        return self.count("vllm:prompt_tokens_by_source_total", source="local_compute")

    @property
    def import_tails(self) -> int:
        """Prompt tokens the imports leave to compute: each prompt past its stored prefix."""
        return sum(n - stored_prefix(n) for n in self.prompt_lengths)

    def summary(self) -> str:
        mean = sum(self.running) / max(len(self.running), 1)
        return (
            f"computed {self.computed_prompt_tokens:.0f} prompt tokens (imports leave {self.import_tails}), "
            f"{self.count('vllm:num_preemptions_total'):.0f} preemptions, running mean {mean:.2f} "
            f"max {max(self.running, default=0):.0f}, "
            f"{self.count('vllm:hisparse_pages_imported_to_host_total'):.0f} pages imported to host, "
            f"{self.wall_s:.1f} s"
        )


def test_disaggregated_decode_lands_imports_in_the_host_pool_and_matches_one_instance(runs):
    on = runs["on"]
    assert on.tokens == runs["reference"]
    assert on.count("vllm:hisparse_pages_imported_to_host_total") > 0, "imports landed in the host pool"
    assert on.count("vllm:hisparse_requests_started_none_total") > 0, "imported requests started NONE"
    assert on.computed_prompt_tokens == on.import_tails, "no imported prompt token was recomputed"


def test_disaggregated_decode_without_hisparse_lands_every_import_on_the_device(runs):
    off, on = runs["off"], runs["on"]
    assert off.tokens == runs["reference"]
    assert "vllm:hisparse_pages_imported_to_host" not in off.metrics
    print(f"\ndecode in {DECODE_KV_CACHE_BYTES} bytes of KV cache, HiSparse on: {on.summary()}")
    print(f"decode in {DECODE_KV_CACHE_BYTES} bytes of KV cache, HiSparse off: {off.summary()}")


def nixl_connector(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role})]


# The secret the proxy and the NIXL decode instance share (VLLM_HISPARSE_PD_SECRET).
PD_SECRET = {"VLLM_HISPARSE_PD_SECRET": "e2e-test-secret-0123456789abcdef"}


def refuses_clients_that_name_a_peer(decode: VllmServer) -> None:
    """A client sends the decode instance kv_transfer_params naming a peer, a listener here,
    unsigned and signed with another secret: each is a 400, the listener is never contacted
    (neither to read from it nor to tell it to free blocks, as upstream does for a request
    refused before the engine) and nothing is held or computed for them."""
    from vllm.v1.hisparse import trust

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    with listener:
        host, port = listener.getsockname()
        hostile = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "attacker",
                   "remote_host": host, "remote_port": port, "remote_block_ids": [[1, 2], [1, 2], [1, 2]],
                   "remote_request_id": "victim-req", "remote_num_tokens": 128}  # fmt: skip
        before = decode.metrics()
        forged = trust.sign(hostile, b"not the secret the instances share")
        for params, reason in ((hostile, "no signature"), (forged, "does not accept")):
            body = {"model": decode.served_name, "prompt": list(range(3, 131)), "max_tokens": 4,
                    "kv_transfer_params": params}  # fmt: skip
            request = urllib.request.Request(decode.url("/v1/completions"), json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 400
            assert reason in refused.value.read().decode()
        time.sleep(3)  # a connection attempt would have been made by now
        readable, _, _ = select.select([listener], [], [], 0)
        assert not readable, "the decode instance contacted the peer a client named"
    after = decode.metrics()
    for name in ("vllm:prompt_tokens_total", "vllm:request_success_total", "vllm:num_requests_waiting",
                 "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert metric(after, name) == metric(before, name), name


def test_nixl_imports_land_in_the_host_pool_and_match_one_instance(reference, tmp_path):
    """NixlConnector over UCX on the CPU: the decode instance pulls every prompt from the
    prefill instance's KV blocks, the pages HiSparse lands on the host straight into its
    registered host pool. Both instances need the same KV cache groups, so the prefill
    instance runs with hisparse_config too. Both of a landing request's reads notify the
    prefill instance, which frees its blocks once both are done: none are left held or
    expired after the sessions."""
    model = model_dir(SPARSE_GLM5)
    prefill = VllmServer(
        model, "tiny-glm5", [*COMMON, *ONE_CHUNK, *HISPARSE, *nixl_connector("kv_producer")],
        tmp_path / "prefill-nixl.log", env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )  # fmt: skip
    decode = VllmServer(
        model, "tiny-glm5", [*DECODE, *HISPARSE, *nixl_connector("kv_consumer")],
        tmp_path / "decode-nixl.log",
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), **PD_SECRET},
    )  # fmt: skip
    prefill.start()
    try:
        nixl = through_proxy(prefill, decode, tmp_path, "nixl", PD_SECRET, refuses_clients_that_name_a_peer)
        prefill_metrics = prefill.metrics()
    finally:
        prefill.stop()
    print(f"\nNIXL decode in {DECODE_KV_CACHE_BYTES} bytes of KV cache, HiSparse on: {nixl.summary()}")
    assert nixl.tokens == reference
    assert nixl.count("vllm:nixl_num_failed_transfers_total") == 0
    assert nixl.count("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert nixl.computed_prompt_tokens == 0, "the decode instance computed no prompt token itself"
    assert nixl.count("vllm:hisparse_pages_imported_to_host_total") > 0, "imports landed in the host pool"
    assert nixl.count("vllm:hisparse_requests_started_none_total") > 0, "imported requests started NONE"
    # Every read notified the prefill instance: it freed every block at once, none on expiry.
    assert metric(prefill_metrics, "vllm:nixl_num_kv_expired_reqs_total") == 0
    assert metric(prefill_metrics, "vllm:kv_cache_usage_perc") == 0
