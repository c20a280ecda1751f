# SPDX-License-Identifier: Apache-2.0
"""scripts/pd_proxy.py between stand-in prefill and decode instances: a client cannot set the
KV-transfer fields that tell a decode instance which peer to read KV from; Authorization and
a request id reach both instances; several instances are taken in turn; oversized bodies and
requests beyond the concurrency limit are turned away before any instance is called.

The instances are the seam: two local HTTP servers record every body they are sent and
answer as a prefill instance does (with or without `kv_transfer_params`). The proxy runs
its own handler on a local port, as `python scripts/pd_proxy.py` does.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import pd_proxy

# What a hostile client sends: a remote prefill from a peer it chose.
HOSTILE = {
    "do_remote_prefill": True,
    "remote_engine_id": "attacker",
    "remote_host": "10.6.6.6",
    "remote_port": 5600,
    "remote_block_ids": [[-5, 123456]],
    "remote_request_id": "victim-req",
}


class Instance:
    """A stand-in vLLM instance: records bodies, answers `answer` as JSON."""

    def __init__(self, answer: dict, hold: threading.Event | None = None) -> None:
        """`hold`: when given, each answer waits until it is set."""
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        instance = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                instance.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                instance.headers.append({k.lower(): v for k, v in self.headers.items()})
                if hold is not None:
                    hold.wait(30)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def proxy_of():
    servers = []

    def start(prefill_answer: dict) -> tuple[str, Instance, Instance]:
        prefill, decode = Instance(prefill_answer), Instance({"choices": [{"text": "ok"}]})
        proxy, url = serve(pd_proxy.build_app(prefill.url, decode.url))
        servers.extend([prefill.server, decode.server, proxy])
        return url, prefill, decode

    yield start
    for server in servers:
        server.shutdown()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return post_with_headers(url, body, headers)[:2]


def post_with_headers(url: str, body: bytes, headers: dict[str, str] | None = None):
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, error.read(), {k.lower(): v for k, v in error.headers.items()}


class ProxyServer:
    """The proxy's application under uvicorn on a local port, as `python scripts/pd_proxy.py` runs it."""

    def __init__(self, app) -> None:
        import socket

        import uvicorn

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()


def serve(app) -> tuple[ProxyServer, str]:
    proxy = ProxyServer(app)
    return proxy, proxy.url


PREFILL_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "prefill-0"}


@pytest.mark.parametrize("prefill_params", [None, PREFILL_PARAMS])
def test_a_clients_kv_transfer_params_never_reach_either_instance(proxy_of, prefill_params):
    answer = {"choices": [{"text": "x"}]}
    if prefill_params:
        answer["kv_transfer_params"] = prefill_params
    url, prefill, decode = proxy_of(answer)
    client = {"prompt": "hi", "max_tokens": 4, "kv_transfer_params": HOSTILE}
    status, _ = post(url, json.dumps(client).encode())
    assert status == 200
    (sent_prefill,) = prefill.bodies
    assert sent_prefill["kv_transfer_params"] == pd_proxy.REMOTE_DECODE
    (sent_decode,) = decode.bodies
    # Only the prefill instance's own answer sets them; with none, the decode has none.
    assert sent_decode.get("kv_transfer_params") == prefill_params
    assert sent_decode["prompt"] == "hi" and sent_decode["max_tokens"] == 4


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"7", b"null"])
def test_a_body_that_is_not_a_json_object_is_refused_before_any_instance_is_called(proxy_of, body):
    url, prefill, decode = proxy_of({"choices": []})
    status, answer = post(url, body)
    assert status == 400 and b"JSON object" in answer
    assert not prefill.bodies and not decode.bodies


@pytest.mark.parametrize("body", [b'{"prompt": "hi", "n": 2}', b'{"prompt": "hi", "best_of": 3}'])
def test_more_than_one_sequence_is_refused_before_any_instance_is_called(proxy_of, body):
    """The prefill instance holds the prompt's blocks for one read: n sequences on the
    decode instance would each read them."""
    url, prefill, decode = proxy_of({"choices": []})
    status, answer = post(url, body)
    assert status == 400 and b"n and best_of must be 1" in answer
    assert not prefill.bodies and not decode.bodies


def test_authorization_and_a_request_id_reach_both_instances_and_the_id_comes_back(proxy_of):
    url, prefill, decode = proxy_of({"choices": [{"text": "x"}]})
    status, answer, headers = post_with_headers(url, b'{"prompt": "hi"}', {"Authorization": "Bearer k-1"})
    assert status == 200 and json.loads(answer) == {"choices": [{"text": "ok"}]}, "the decode answer, relayed"
    (to_prefill,), (to_decode,) = prefill.headers, decode.headers
    assert to_prefill["authorization"] == to_decode["authorization"] == "Bearer k-1"
    request_id = to_prefill["x-request-id"]
    assert request_id and to_decode["x-request-id"] == request_id == headers["x-request-id"]
    # A client's own plain id is kept; one that is not a plain token is replaced.
    post(url, b'{"prompt": "hi"}', {"X-Request-Id": "client-7"})
    assert prefill.headers[-1]["x-request-id"] == decode.headers[-1]["x-request-id"] == "client-7"
    post(url, b'{"prompt": "hi"}', {"X-Request-Id": "a b;" + "z" * 200})
    replaced = prefill.headers[-1]["x-request-id"]
    assert len(replaced) == 32 and int(replaced, 16) >= 0, replaced
    # Without a client Authorization header, none is sent.
    assert "authorization" not in prefill.headers[-1]


def test_several_instances_are_taken_in_turn():
    prefills = [Instance({"choices": []}) for _ in range(2)]
    decodes = [Instance({"choices": []}) for _ in range(3)]
    proxy, url = serve(pd_proxy.build_app([p.url for p in prefills], [d.url for d in decodes]))
    try:
        for _ in range(6):
            assert post(url, b'{"prompt": "hi"}')[0] == 200
    finally:
        for server in (proxy, *(i.server for i in prefills + decodes)):
            server.shutdown()
    assert [len(p.bodies) for p in prefills] == [3, 3]
    assert [len(d.bodies) for d in decodes] == [2, 2, 2]


def test_a_body_over_the_limit_is_refused_unread_and_requests_over_the_concurrency_are_turned_away():
    hold = threading.Event()
    prefill, decode = Instance({"choices": []}), Instance({"choices": []}, hold)
    proxy, url = serve(pd_proxy.build_app(prefill.url, decode.url, max_body_bytes=64, max_concurrency=1))
    try:
        status, answer = post(url, json.dumps({"prompt": "x" * 100}).encode())
        assert status == 413 and b"at most 64" in answer and not prefill.bodies
        first = threading.Thread(target=post, args=(url, b'{"prompt": "a"}'))
        first.start()
        deadline = time.monotonic() + 10
        while not decode.bodies and time.monotonic() < deadline:
            time.sleep(0.02)
        assert decode.bodies, "the first request reached the decode instance and waits there"
        status, answer, headers = post_with_headers(url, b'{"prompt": "b"}')
        assert status == 503 and headers.get("retry-after") == "1"
        assert len(prefill.bodies) == 1, "the request turned away never reached an instance"
        hold.set()
        first.join(10)
        assert post(url, b'{"prompt": "c"}')[0] == 200, "its slot is free again"
    finally:
        hold.set()
        for server in (proxy, prefill.server, decode.server):
            server.shutdown()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"prompt": "hi", "max_tokens": 512, "truncate_prompt_tokens": -1}', b"truncate_prompt_tokens"),
        (b'{"prompt": "hi", "max_tokens": 0}', b"max_tokens must be a positive integer"),
        (b'{"prompt": "hi", "stream": false, "stream_options": {"include_usage": true}}', b"stream_options"),
        (b'{"prompt": "hi", "stream": true, "prompt_logprobs": 1}', b"prompt_logprobs"),
        (b'{"prompt": "hi", "vllm_xargs": {"x": 36893488147419103232}}', b"an integer in the request"),
    ],
    ids=["truncate-by-max-tokens", "max-tokens", "stream-options", "streamed-prompt-logprobs", "wide-int"],
)
def test_a_body_the_two_calls_would_treat_differently_is_refused_before_any_instance_is_called(
    proxy_of, body, reason
):
    """The prefill call asks for one token, not streamed: a prompt cut by max_tokens differs
    between the two instances (the decode instance would load KV of other tokens), and a
    body only the decode instance refuses leaves the prefill's blocks held for a read that
    never comes. An integer wider than 64 bits fails a request only after each server has
    registered it, which then stays unfinished there."""
    url, prefill, decode = proxy_of({"choices": []})
    status, answer = post(url, body)
    assert status == 400 and reason in answer
    assert not prefill.bodies and not decode.bodies
