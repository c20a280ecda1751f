"""A prefill/decode disaggregation proxy in front of two `vllm serve` instances.

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

GET /health answers 200 when both instances do. Errors of either instance
reach the client with their status and body.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FORWARDED = ("/v1/completions", "/v1/chat/completions")
# The prefill instance keeps the request's KV cache for a decode instance to pull.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
TIMEOUT_S = 600


def _post(url: str, body: bytes):
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
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


def make_handler(prefill: str, decode: str, secret: bytes | None = None) -> type[BaseHTTPRequestHandler]:
    """`secret`: shared with the decode instances; signs the kv_transfer_params they get."""
    trust = _trust() if secret is not None else None

    class ProxyHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # one line per request on stderr
            sys.stderr.write("pd_proxy: " + format % args + "\n")

        def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._reply(404, b'{"error": "not found"}')
                return
            for base in (prefill, decode):
                try:
                    with urllib.request.urlopen(base + "/health", timeout=10):
                        pass
                except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                    self._reply(503, json.dumps({"error": f"{base}: {error}"}).encode())
                    return
            self._reply(200, b"")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path not in FORWARDED:
                self._reply(404, b'{"error": "not found"}')
                return
            try:
                request = json.loads(body)
            except json.JSONDecodeError as error:
                self._reply(400, json.dumps({"error": f"request body is not JSON: {error}"}).encode())
                return
            if not isinstance(request, dict):
                self._reply(400, json.dumps({"error": "request body must be a JSON object"}).encode())
                return
            # KV-transfer fields steer which peer the decode instance reads KV from: only the
            # prefill instance's answer may set them, never the client.
            request.pop("kv_transfer_params", None)
            prefill_request = dict(request, max_tokens=1, stream=False)
            prefill_request["kv_transfer_params"] = REMOTE_DECODE
            prefill_request.pop("max_completion_tokens", None)
            prefill_request.pop("stream_options", None)
            try:
                with _post(prefill + self.path, json.dumps(prefill_request).encode()) as response:
                    prefilled = json.loads(response.read())
                params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
                if params and trust is not None and isinstance(params, dict):
                    params = trust.sign(params, secret)
                decode_request = dict(request, kv_transfer_params=params) if params else request
                with _post(decode + self.path, json.dumps(decode_request).encode()) as response:
                    self._relay(response)
            except urllib.error.HTTPError as error:
                self._reply(error.code, error.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                self._reply(502, json.dumps({"error": f"an instance did not answer: {error}"}).encode())

        def _relay(self, response) -> None:
            """The decode instance's answer as it arrives (chunked, so streams stay streams)."""
            self.send_response(response.status)
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
    parser.add_argument("--prefill", required=True, help="base URL of the prefill (kv_producer) instance")
    parser.add_argument("--decode", required=True, help="base URL of the decode (kv_consumer) instance")
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
    handler = make_handler(args.prefill.rstrip("/"), args.decode.rstrip("/"), secret)
    server = ThreadingHTTPServer((args.host, args.port), handler)
    print(f"pd_proxy: listening on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
