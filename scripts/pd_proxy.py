# SPDX-License-Identifier: Apache-2.0
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
instance reach the client with their status and body. When the decode
instance refuses a request, it tells the prefill instance to free the blocks it
holds for it (vLLM's rejection notice, sent for parameters this proxy signed);
when it cannot be reached, the producer frees them after its own timeout
(the NixlConnector's `kv_lease_duration`, 30 s by default). A client that
disconnects mid-answer closes the decode call, which aborts the request there.
Bodies the two calls would treat differently are refused with 400 before
either instance is called: n or best_of above 1, truncate_prompt_tokens below 0
(it cuts by max_tokens, which differs between the calls), stream options only
the decode call checks, and integers wider than vLLM's engine messages carry.

It is a FastAPI application served by uvicorn, calling the instances with
httpx (all three ship with vLLM), as vLLM's own example proxies are.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

FORWARDED = ("/v1/completions", "/v1/chat/completions")
# The prefill instance keeps the request's KV cache for a decode instance to pull.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
TIMEOUT_S = 600
MAX_BODY_BYTES = 32 << 20
MAX_CONCURRENCY = 256


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


# The widest integer vLLM's engine messages carry (msgpack): a larger one fails a request
# only after the server has registered it, which then stays unfinished there.
INT_RANGE = (-(2**63), 2**64 - 1)


def refusal(body: dict) -> str | None:
    """Why a body must be refused before either instance is called, or None. The prefill
    call differs from the client's (one token, not streamed), so a body the prefill instance
    accepts and the decode instance refuses would leave the prefill's blocks held for a
    read that never comes, and a prompt cut by max_tokens would differ between the two."""
    truncate = body.get("truncate_prompt_tokens")
    if isinstance(truncate, int) and truncate < 0:
        return (
            "truncate_prompt_tokens below 0 cuts the prompt by max_tokens, which the prefill and "
            "decode calls set differently: give the number of prompt tokens to keep"
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"{field} must be a positive integer"
    streamed = bool(body.get("stream"))
    if body.get("stream_options") and not streamed:
        return "stream_options can only be given with stream=true"
    prompt_logprobs = body.get("prompt_logprobs")
    if streamed and isinstance(prompt_logprobs, int) and (prompt_logprobs > 0 or prompt_logprobs == -1):
        return "prompt_logprobs are not available with stream=true"
    if _out_of_range(body):
        return f"an integer in the request is outside [{INT_RANGE[0]}, {INT_RANGE[1]}]"
    return None


def _out_of_range(value: object, depth: int = 0) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not INT_RANGE[0] <= value <= INT_RANGE[1]
    if depth > 64:
        return True  # nested deeper than any request field
    if isinstance(value, dict):
        return any(_out_of_range(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_out_of_range(v, depth + 1) for v in value)
    return False


def _request_id(value: str | None) -> str:
    """The client's X-Request-Id when it is a plain token, else a new one."""
    if value and len(value) <= 128 and all(c.isalnum() or c in "-_.:" for c in value):
        return value
    return uuid.uuid4().hex


class _RoundRobin:
    def __init__(self, urls: str | list[str]) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        self._next = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._next)  # one event loop: no two picks interleave


def build_app(
    prefill: str | list[str],
    decode: str | list[str],
    secret: bytes | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_concurrency: int = MAX_CONCURRENCY,
    timeout_s: float = TIMEOUT_S,
) -> FastAPI:
    """The proxy as an ASGI application. `prefill`/`decode`: an instance's base URL or
    several, taken in turn; `secret`: shared with the decode instances, signs the
    kv_transfer_params they get; at most `max_concurrency` requests in flight (more are
    answered 503) and bodies of at most `max_body_bytes` (larger ones 413)."""
    trust = _trust() if secret is not None else None
    prefills, decodes = _RoundRobin(prefill), _RoundRobin(decode)
    state = {"in_flight": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=2 * max_concurrency, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            app.state.client = client
            yield

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.get("/health")
    async def health(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        for base in (*prefills.urls, *decodes.urls):
            try:
                answer = await client.get(base + "/health", timeout=10)
            except httpx.HTTPError as e:
                return error(503, f"{base}: {e!r}")
            if answer.status_code != 200:
                return error(503, f"{base}: /health answered {answer.status_code}")
        return Response(status_code=200)

    async def read_body(request: Request) -> bytes | JSONResponse:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return error(413, f"request body of {length} bytes; at most {max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                return error(413, f"request body over {max_body_bytes} bytes")
        return bytes(body)

    async def forward(request: Request) -> Response:
        body = await read_body(request)
        if isinstance(body, Response):
            return body
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"request body is not JSON: {e}")
        if not isinstance(parsed, dict):
            return error(400, "request body must be a JSON object")
        if parsed.get("n", 1) not in (1, None) or parsed.get("best_of", 1) not in (1, None):
            # The prefill instance holds one prompt's blocks for one read by the decode
            # instance; n sequences would each read them.
            return error(400, "a disaggregated prefill serves one sequence: n and best_of must be 1")
        refused = refusal(parsed)
        if refused:
            return error(400, refused)
        if state["in_flight"] >= max_concurrency:
            return error(503, f"{max_concurrency} requests in flight; retry", {"Retry-After": "1"})
        state["in_flight"] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                state["in_flight"] -= 1

        return await call_instances(request, parsed, release)

    async def call_instances(request: Request, parsed: dict, release) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        request_id = _request_id(request.headers.get("x-request-id"))
        headers = {"X-Request-Id": request_id}
        if request.headers.get("authorization"):
            headers["Authorization"] = request.headers["authorization"]
        path = request.url.path
        # KV-transfer fields steer which peer the decode instance reads KV from: only the
        # prefill instance's answer may set them, never the client.
        parsed.pop("kv_transfer_params", None)
        prefill_request = dict(parsed, max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
        prefill_request.pop("max_completion_tokens", None)
        prefill_request.pop("stream_options", None)
        streaming = False
        try:
            answer = await client.post(prefills.pick() + path, json=prefill_request, headers=headers)
            if answer.status_code != 200:
                return Response(answer.content, answer.status_code, headers=headers,
                                media_type=answer.headers.get("content-type"))  # fmt: skip
            prefilled = answer.json()
            params = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
            if params and trust is not None and isinstance(params, dict):
                params = trust.sign(params, secret)
            decode_request = dict(parsed, kv_transfer_params=params) if params else parsed
            call = client.build_request("POST", decodes.pick() + path, json=decode_request, headers=headers)
            answer = await client.send(call, stream=True)
            if answer.status_code != 200:
                content = await answer.aread()
                await answer.aclose()
                return Response(content, answer.status_code, headers=headers,
                                media_type=answer.headers.get("content-type"))  # fmt: skip

            async def relay():
                # A client that goes away stops this generator: the decode call closes, and the
                # decode instance aborts the request.
                try:
                    async for chunk in answer.aiter_raw():
                        yield chunk
                finally:
                    await answer.aclose()
                    release()

            async def cleanup() -> None:
                # Also when the stream never started (the client left first); both are idempotent.
                await answer.aclose()
                release()

            streaming = True
            return StreamingResponse(relay(), status_code=answer.status_code, headers=headers,
                                     media_type=answer.headers.get("content-type"),
                                     background=BackgroundTask(cleanup))  # fmt: skip
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return error(502, f"an instance did not answer: {e!r}", headers)
        finally:
            if not streaming:
                release()

    for route in FORWARDED:
        app.add_api_route(route, forward, methods=["POST"])
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--prefill",
        required=True,
        action="append",
        help="base URL of a prefill (kv_producer) instance; repeatable, taken in turn",
    )
    parser.add_argument(
        "--decode",
        required=True,
        action="append",
        help="base URL of a decode (kv_consumer) instance; repeatable, taken in turn",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"larger request bodies are answered 413 (default {MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=MAX_CONCURRENCY,
        help=f"requests in flight; more are answered 503 (default {MAX_CONCURRENCY})",
    )
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
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if secret is None:
        print(
            f"pd_proxy: no shared secret ({trust.SECRET_ENV} or --secret-file): decode instances "
            "that pull KV cache from the prefill instance will refuse its requests",
            file=sys.stderr,
            flush=True,
        )
    if args.max_body_bytes < 1 or args.max_concurrency < 1:
        parser.error("--max-body-bytes and --max-concurrency must be >= 1")
    import uvicorn

    app = build_app(args.prefill, args.decode, secret, args.max_body_bytes, args.max_concurrency)
    print(f"pd_proxy: listening on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
