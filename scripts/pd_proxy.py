"""A prefill/decode disaggregation proxy in front of `vllm serve` instances.

Every completion or chat completion request goes first to the prefill
instance (a `kv_producer`) with `max_tokens` 1, which computes the prompt and
leaves its KV cache where the KV connector puts it; then the unchanged
request goes to the decode instance (a `kv_consumer`), which loads that KV
cache instead of computing the prompt, and its answer (streamed or not) goes
back to the client. A client's own `kv_transfer_params` are dropped: they would
tell the decode instance which peer to read KV from, so only the prefill
instance's answer sets them, and the proxy signs them with the secret it shares
with the decode instances (VLLM_HISPARSE_PD_SECRET, or --secret-file): a KV
consumer of this distribution refuses a remote prefill that is not signed so
(docs/deploy.md, "Trust model"). A body that is not a JSON object is refused (400).
With ExampleConnector both instances name the same
`shared_storage_path` and nothing else needs to pass between them. For
connectors that pull the KV cache from the prefill instance (NixlConnector),
the prefill request asks for a remote decode (`kv_transfer_params` with
`do_remote_decode`) and the decode request carries the `kv_transfer_params`
the prefill instance answered with, which say where to pull from.

    python scripts/pd_proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

`--prefill` and `--decode` may each be given several times: requests take the
instances in turn. The client's `Authorization` header goes to both instances
(servers started with --api-key), and each request carries an `X-Request-Id`
(the client's, when it is a plain token, else a new one) to both instances and
back to the client. At most --max-concurrency requests are in flight (more are
answered 503 with Retry-After) and bodies over --max-body-bytes are answered 413
unread. GET /health answers 200 when every instance does. Errors of either
instance reach the client with their status and body. A prefill whose decode
call fails keeps its blocks on the producer until the connector's own timeout
(VLLM_NIXL_ABORT_REQUEST_TIMEOUT): vLLM has no call that releases them sooner.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FORWARDED = ("/v1/completions", "/v1/chat/completions")
# The prefill instance keeps the request's KV cache for a decode instance to pull.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
TIMEOUT_S = 600
MAX_BODY_BYTES = 32 << 20
MAX_CONCURRENCY = 256


def _post(url: str, body: bytes, headers: dict[str, str]):
    request = urllib.request.Request(url, data=body, headers=headers)
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


def _trust():
    """vllm/v1/hisparse/trust.py (standard library only): from this checkout when the script
    runs from one, else from the installed distribution."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "vllm", "v1", "hisparse", "trust.py")
    if not os.path.exists(path):
        from vllm.v1.hisparse import trust

        return trust
    import importlib.util

    spec = importlib.util.spec_from_file_location("hisparse_trust", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _request_id(value: str | None) -> str:
    """The client's X-Request-Id when it is a plain token, else a new one."""
    if value and len(value) <= 128 and all(c.isalnum() or c in "-_.:" for c in value):
        return value
    return uuid.uuid4().hex


class _RoundRobin:
    def __init__(self, urls: list[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self._next = itertools.cycle(self.urls)
        self._lock = threading.Lock()

    def pick(self) -> str:
        with self._lock:
            return next(self._next)


def make_handler(
    prefill: str | list[str],
    decode: str | list[str],
    secret: bytes | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_concurrency: int = MAX_CONCURRENCY,
) -> type[BaseHTTPRequestHandler]:
    """`prefill`/`decode`: an instance's base URL or several, taken in turn; `secret`: shared
    with the decode instances, signs the kv_transfer_params they get; at most
    `max_concurrency` requests in flight (more are answered 503) and bodies of at most
    `max_body_bytes` (larger ones 413)."""
    trust = _trust() if secret is not None else None
    prefills = _RoundRobin([prefill] if isinstance(prefill, str) else list(prefill))
    decodes = _RoundRobin([decode] if isinstance(decode, str) else list(decode))
    slots = threading.BoundedSemaphore(max_concurrency)

    class ProxyHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # one line per request on stderr
            sys.stderr.write("pd_proxy: " + format % args + "\n")

        def _reply(self, status: int, body: bytes, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
            self._reply(status, json.dumps({"error": message}).encode(), headers=headers)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._error(404, "not found")
                return
            for base in (*prefills.urls, *decodes.urls):
                try:
                    with urllib.request.urlopen(base + "/health", timeout=10):
                        pass
                except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                    self._error(503, f"{base}: {error}")
                    return
            self._reply(200, b"")

        def do_POST(self) -> None:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                self._error(411, "a request body with a Content-Length is required")
                return
            if int(length) > max_body_bytes:
                self.close_connection = True  # the body is not read
                self._error(413, f"request body of {length} bytes; at most {max_body_bytes}")
                return
            body = self.rfile.read(int(length))
            if self.path not in FORWARDED:
                self._error(404, "not found")
                return
            try:
                request = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                self._error(400, f"request body is not JSON: {error}")
                return
            if not isinstance(request, dict):
                self._error(400, "request body must be a JSON object")
                return
            if not slots.acquire(blocking=False):
                self._error(503, f"{max_concurrency} requests in flight; retry", {"Retry-After": "1"})
                return
            try:
                self._forward(request)
            finally:
                slots.release()

        def _forward(self, request: dict) -> None:
            request_id = _request_id(self.headers.get("X-Request-Id"))
            headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
            if self.headers.get("Authorization"):
                headers["Authorization"] = self.headers["Authorization"]
            # KV-transfer fields steer which peer the decode instance reads KV from: only the
            # prefill instance's answer may set them, never the client.
            request.pop("kv_transfer_params", None)
            prefill_request = dict(request, max_tokens=1, stream=False)
            prefill_request["kv_transfer_params"] = REMOTE_DECODE
            prefill_request.pop("max_completion_tokens", None)
            prefill_request.pop("stream_options", None)
            try:
                with _post(prefills.pick() + self.path, json.dumps(prefill_request).encode(),
                           headers) as response:  # fmt: skip
                    prefilled = json.loads(response.read())
                params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
                if params and trust is not None and isinstance(params, dict):
                    params = trust.sign(params, secret)
                decode_request = dict(request, kv_transfer_params=params) if params else request
                with _post(decodes.pick() + self.path, json.dumps(decode_request).encode(),
                           headers) as response:  # fmt: skip
                    self._relay(response, request_id)
            except urllib.error.HTTPError as error:
                self._reply(error.code, error.read(), headers={"X-Request-Id": request_id})
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as error:
                self._error(502, f"an instance did not answer: {error}", {"X-Request-Id": request_id})

        def _relay(self, response, request_id: str) -> None:
            """The decode instance's answer as it arrives (chunked, so streams stay streams)."""
            self.send_response(response.status)
            self.send_header("X-Request-Id", request_id)
            self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(1 << 16):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    return ProxyHandler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", required=True, action="append",
                        help="base URL of a prefill (kv_producer) instance; repeatable, taken in turn")
    parser.add_argument("--decode", required=True, action="append",
                        help="base URL of a decode (kv_consumer) instance; repeatable, taken in turn")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help=f"larger request bodies are answered 413 (default {MAX_BODY_BYTES})")
    parser.add_argument("--max-concurrency", type=int, default=MAX_CONCURRENCY,
                        help=f"requests in flight; more are answered 503 (default {MAX_CONCURRENCY})")
    parser.add_argument(
        "--secret-file",
        help="file holding the secret shared with the decode instances (default: the "
        "VLLM_HISPARSE_PD_SECRET environment variable)",
    )
    args = parser.parse_args(argv)
    trust = _trust()
    try:
        if args.secret_file:
            with open(args.secret_file) as f:
                secret = trust.secret_from_env({trust.SECRET_ENV: f.read().strip()})
        else:
            secret = trust.secret_from_env()
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if secret is None:
        print(
            f"pd_proxy: no shared secret ({trust.SECRET_ENV} or --secret-file): decode instances "
            "that pull KV cache from the prefill instance will refuse its requests",
            file=sys.stderr,
            flush=True,
        )
    if args.max_body_bytes < 1 or args.max_concurrency < 1:
        parser.error("--max-body-bytes and --max-concurrency must be >= 1")
    handler = make_handler(args.prefill, args.decode, secret, args.max_body_bytes, args.max_concurrency)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    print(f"pd_proxy: listening on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
