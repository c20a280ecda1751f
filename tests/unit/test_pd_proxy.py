# SPDX-License-Identifier: Apache-2.0
"""scripts/pd_proxy.py between stand-in prefill and decode instances: a client cannot set the
KV-transfer fields that tell a decode instance which peer to read KV from.

The instances are the seam: two local HTTP servers record every body they are sent and
answer as a prefill instance does (with or without `kv_transfer_params`). The proxy runs
its own handler on a local port, as `python scripts/pd_proxy.py` does.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import pd_proxy

# What a hostile client sends: a remote prefill from a peer it chose.
HOSTILE = {
    "do_remote_prefill": True, "remote_engine_id": "attacker", "remote_host": "10.6.6.6",
    "remote_port": 5600, "remote_block_ids": [[-5, 123456]], "remote_request_id": "victim-req",
}


class Instance:
    """A stand-in vLLM instance: records bodies, answers `answer` as JSON."""

    def __init__(self, answer: dict) -> None:
        self.bodies: list[dict] = []
        instance = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                instance.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
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
        proxy = ThreadingHTTPServer(("127.0.0.1", 0), pd_proxy.make_handler(prefill.url, decode.url))
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        servers.extend([prefill.server, decode.server, proxy])
        return f"http://127.0.0.1:{proxy.server_port}", prefill, decode

    yield start
    for server in servers:
        server.shutdown()


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


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
