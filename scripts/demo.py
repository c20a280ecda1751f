# SPDX-License-Identifier: Apache-2.0
"""`make demo`: Hybrid HiSparse under KV pressure, end to end, on this machine.

Builds a small GLM-5-architecture checkpoint locally (random weights, fixed seed,
local tokenizer; no network), starts `vllm serve` with the announcement's two
flags (`hisparse_config` and the OffloadingConnector with TieringOffloadingSpec)
and a KV pool far too small for the workload, then drives it with a multi-turn
agentic client: several concurrent sessions, each turn sending the whole
conversation so far (previous prompt, the model's answer, a new tool result) as
token ids, so later turns reuse their prefixes. While it runs it samples the
server's Prometheus metrics; at the end it prints what happened (residency
states, pages copied, demoted and reused, resolver hits and loads, preemptions,
bytes moved) and exits 0, or exits 1 naming what went wrong (the server log
is kept).

Owns only the demo: the engine, the server and the metrics are vLLM's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_models
from serving import SERVER_ERRORS, VllmServer, metric, offloading_connector

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
DEMO_MODEL = tiny_models.TINY_GLM53
SERVED_NAME = "tiny-glm53-hisparse-demo"


@dataclass
class Observed:
    """What the client saw: per-request results and peaks of sampled gauges."""

    finished: int = 0
    failed: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    peaks: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def demo_server(model: Path, args: argparse.Namespace, log_path: Path) -> VllmServer:
    """`vllm serve` with the announcement's two flags and a KV pool far too small for the workload."""
    engine_id = f"hisparse-demo-{uuid.uuid4().hex[:8]}"
    kv_transfer = offloading_connector(engine_id, "TieringOffloadingSpec", 64 << 20)
    hisparse = {"hisparse_config": {"host_pool_gib": args.host_pool_gib}}
    serve_args = [
        "--max-model-len", "2048",
        "--max-num-batched-tokens", "128",
        "--num-gpu-blocks-override", str(args.kv_blocks),
        "--kv-cache-memory-bytes", str(256 << 20),
        "--gpu-memory-utilization", "0.3",
        "--enforce-eager",
        "--seed", "0",
        "--enable-prompt-tokens-details",
        "--attention-config", json.dumps(hisparse),
        "--kv-transfer-config", json.dumps(kv_transfer),
    ]  # fmt: skip
    return VllmServer(model, SERVED_NAME, serve_args, log_path, engine_id)


def run_session(server: VllmServer, session: int, args: argparse.Namespace, observed: Observed) -> None:
    """One agent: a long first prompt, then turns that append the answer and a tool result."""
    rng = random.Random(1000 + session)
    vocab = DEMO_MODEL.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(args.first_turn_tokens + 40 * session)]
    for turn in range(args.turns):
        try:
            body = server.complete(prompt, args.output_tokens)
        except SERVER_ERRORS as e:
            with observed.lock:
                observed.failed.append(f"session {session + 1} turn {turn + 1}: {e}")
            return
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        with observed.lock:
            observed.finished += 1
            observed.prompt_tokens += usage.get("prompt_tokens", len(prompt))
            observed.cached_tokens += cached
            observed.generated_tokens += usage.get("completion_tokens", 0)
        print(
            f"  session {session + 1} turn {turn + 1}: {len(prompt)} prompt tokens "
            f"({cached} cached), {len(choice['token_ids'])} generated",
            flush=True,
        )
        tool_result = [rng.randrange(3, vocab) for _ in range(args.tool_result_tokens)]
        prompt = prompt + list(choice["token_ids"]) + tool_result


GAUGES = {
    "running": ("vllm:num_requests_running", {}),
    "mixed": ("vllm:hisparse_requests", {"state": "mixed"}),
    "none": ("vllm:hisparse_requests", {"state": "none"}),
    "host_pages_used": ("vllm:hisparse_host_pool_used_pages", {}),
}


def sample_gauges(server: VllmServer, observed: Observed, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        try:
            text = server.metrics()
        except SERVER_ERRORS:
            continue
        with observed.lock:
            for key, (name, labels) in GAUGES.items():
                observed.peaks[key] = max(observed.peaks.get(key, 0.0), metric(text, name, **labels))


def mib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"


def report(metrics_text: str, observed: Observed, elapsed: float) -> list[str]:
    def total(name: str) -> float:
        return metric(metrics_text, name)

    loaded, hit = total("vllm:hisparse_rows_loaded_total"), total("vllm:hisparse_rows_hit_total")
    hit_rate = f"{100 * hit / (hit + loaded):.0f}%" if hit + loaded else "n/a, no row came from the host"
    peaks = observed.peaks
    return [
        f"What happened ({elapsed:.0f} s):",
        f"  requests      {observed.finished} finished, {len(observed.failed)} failed; "
        f"peak running {peaks.get('running', 0):.0f}",
        f"  residency     peak MIXED {peaks.get('mixed', 0):.0f}, peak NONE {peaks.get('none', 0):.0f} "
        f"requests; host pool peak {peaks.get('host_pages_used', 0):.0f} of "
        f"{total('vllm:hisparse_host_pool_pages'):.0f} pages",
        f"  pages         copied to host {total('vllm:hisparse_pages_copied_to_host_total'):.0f}, "
        f"demoted {total('vllm:hisparse_pages_demoted_total'):.0f}, "
        f"reused from host {total('vllm:hisparse_host_prefix_pages_reused_total'):.0f}, "
        f"restored {total('vllm:hisparse_pages_restored_total'):.0f} (connector hits) and "
        f"{total('vllm:hisparse_pages_restored_for_prefill_total'):.0f} (prefill chunks)",
        f"  resolver      rows loaded {loaded:.0f}, hot hits {hit:.0f} (hot hit rate {hit_rate})",
        f"  preemptions   {total('vllm:num_preemptions_total'):.0f} "
        f"(demotion served {total('vllm:hisparse_preemptions_avoided_total'):.0f} allocations instead)",
        f"  bytes moved   to host {mib(total('vllm:hisparse_bytes_to_host_total'))}, "
        f"from host {mib(total('vllm:hisparse_bytes_from_host_total'))}; OffloadingConnector "
        f"stored {mib(total('vllm:kv_offload_store_bytes_total'))}, "
        f"loaded {mib(total('vllm:kv_offload_load_bytes_total'))}",
        f"  prompt tokens {observed.prompt_tokens} sent, {observed.cached_tokens} served from cache; "
        f"{observed.generated_tokens} generated",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="demo.py", description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4, help="concurrent agent sessions (default 4)")
    parser.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    parser.add_argument("--first-turn-tokens", type=int, default=360, help="first prompt length")
    parser.add_argument("--tool-result-tokens", type=int, default=60, help="tokens a tool adds per turn")
    parser.add_argument("--output-tokens", type=int, default=24, help="tokens generated per turn")
    parser.add_argument("--kv-blocks", type=int, default=110, help="device KV pool size in blocks")
    parser.add_argument("--host-pool-gib", type=float, default=0.1, help="HiSparse host pool (GiB)")
    args = parser.parse_args(argv)
    for name in ("sessions", "turns", "first_turn_tokens", "output_tokens", "kv_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.tool_result_tokens < 0 or args.host_pool_gib <= 0:
        parser.error("--tool-result-tokens must be >= 0 and --host-pool-gib > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("Hybrid HiSparse demo", flush=True)
    model = tiny_models.tiny_model_dir(DEMO_MODEL, CACHE / "tiny-models")
    print(
        f"  model        tiny GLM-5.3 ({DEMO_MODEL.num_hidden_layers} layers, an indexer per "
        f"{DEMO_MODEL.index_topk_freq}, an MTP layer, index top-K "
        f"{DEMO_MODEL.index_topk}), random weights, seed {DEMO_MODEL.seed}: {model}"
    )
    print(
        f"  KV pool      {args.kv_blocks} blocks of 64 tokens; HiSparse host pool "
        f"{args.host_pool_gib} GiB; OffloadingConnector (TieringOffloadingSpec) 64 MiB"
    )
    print(f"  workload     {args.sessions} concurrent sessions x {args.turns} turns", flush=True)
    log_path = CACHE / "demo" / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = demo_server(model, args, log_path)
    observed = Observed()
    stop = threading.Event()
    start = time.monotonic()
    try:
        print(f"Starting vllm serve on port {server.port} (log: {log_path})...", flush=True)
        server.start()
        print(f"  up in {time.monotonic() - start:.0f} s; running the sessions", flush=True)
        sampler = threading.Thread(target=sample_gauges, args=(server, observed, stop), daemon=True)
        sampler.start()
        run_start = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.sessions) as pool:
            for future in [pool.submit(run_session, server, s, args, observed) for s in range(args.sessions)]:
                future.result()
        stop.set()
        sampler.join()
        time.sleep(1)  # the last step's stats reach the metrics
        metrics_text = server.metrics()
        lines = report(metrics_text, observed, time.monotonic() - run_start)
    except (RuntimeError, *SERVER_ERRORS) as e:
        stop.set()
        print(f"demo failed: {e}", file=sys.stderr)
        print(f"server log: {log_path}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    print("\n".join(lines))
    if observed.failed:
        print("failed requests:\n  " + "\n  ".join(observed.failed), file=sys.stderr)
        print(f"server log: {log_path}", file=sys.stderr)
        return 1
    if not metric(metrics_text, "vllm:hisparse_pages_demoted_total"):
        print(
            f"the KV pool of {args.kv_blocks} blocks was never under pressure, so no page left the "
            "device; run with a smaller --kv-blocks or a longer workload",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
