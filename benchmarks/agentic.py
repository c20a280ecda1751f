# SPDX-License-Identifier: Apache-2.0
"""`make bench`: the announcement's agentic workload, four residency configurations side by side.

Replays OpenHands-style sessions (13 turns; a first turn of 74,160 tokens; later
turns 753 tokens in, 220 out) scaled by --scale, against a real `vllm serve` of
a small GLM-5-architecture checkpoint over HTTP, at a sweep of concurrent
sessions. Every turn resends the conversation so far (the previous prompt, the
model's answer, a new tool result) as token ids, so a turn's history is a
prefix the server may still hold. For each concurrency, each configuration gets
a fresh server with the same KV cache bytes:

- `preemption`: neither flag; under pressure vLLM preempts and recomputes;
- `offload`: the OffloadingConnector alone (the announcement's baseline);
- `hybrid`: both flags, Hybrid HiSparse;
- `always`: both flags, HiSparse with mode "always" (the ablation).

Per run: mean running requests (the server's gauge, sampled), output tokens/s,
per-user tokens/s (1 / time per output token), TTFT p50/p99 (all turns, the first
turns, the later turns: a tool result prefilled over the history), preemptions,
recomputed prompt tokens (prompt tokens the engine computed beyond each turn's
new tokens) and bytes moved between host and device. The claims are ratios to
`offload` at the same concurrency, measured in the same invocation; absolute
times on a shared CPU are not claims. Writes results.json and pareto.png
(per-user tokens/s against output tokens/s) into --out.

Against a real deployment: `--base-url URL --model NAME` runs the same sessions
against any OpenAI-compatible server (token-id prompts below --vocab-size) instead
of starting one. Such a server runs one configuration, so the run is labelled with
`--configs`' single entry (default `external`) and compared with nothing; run the
benchmark once per deployment and compare their results. Figures from the server's
/metrics (running requests, preemptions, bytes moved) are read when it exports them.

Each run also carries `vllm bench serve`'s fields and units where they overlap
(`duration`, `completed`, `total_input_tokens`, `total_output_tokens`,
`request_throughput`, `output_throughput`, `mean_ttft_ms`, `median_ttft_ms`,
`p99_ttft_ms`, `mean_tpot_ms`, `median_tpot_ms`, `p99_tpot_ms`). The Pareto plot is
drawn here: `vllm bench sweep plot_pareto` reads the result folders of
`vllm bench sweep serve`, whose runs are one server configuration each at fixed
request rates, not closed-loop multi-turn sessions of several configurations.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))

import tiny_models  # noqa: E402
from serving import SERVER_ERRORS, Completion, VllmServer, metric, offloading_connector  # noqa: E402

CACHE = REPO / ".cache"
RESULTS = REPO / "benchmarks" / "results"
MODEL = tiny_models.TINY_GLM53
SERVED_NAME = "tiny-glm53-bench"
CONFIGS = ("preemption", "offload", "hybrid", "always")
BASELINE = "offload"
# The announcement's session shape.
FULL_SHAPE = {"turns": 13, "first_turn_tokens": 74_160, "turn_tokens": 753, "output_tokens": 220}
MIN_TURN_TOKENS = 16  # a scaled turn keeps enough tokens to time its decode
QUICK = {"scale": 1 / 40, "turns": 4, "concurrency": "2,4", "kv_cache_bytes": 24 << 20}


@dataclass
class Shape:
    turns: int
    first_turn_tokens: int
    turn_tokens: int
    output_tokens: int

    @classmethod
    def scaled(cls, scale: float, turns: int, first_turn_tokens: int | None = None) -> Shape:
        """The announcement's session times `scale`; `first_turn_tokens` replaces the first
        turn's scaled length (later turns at full size without a 74K-token first turn)."""

        def tokens(n: int) -> int:
            return max(MIN_TURN_TOKENS, round(n * scale))

        return cls(
            turns=turns,
            first_turn_tokens=first_turn_tokens or tokens(FULL_SHAPE["first_turn_tokens"]),
            turn_tokens=tokens(FULL_SHAPE["turn_tokens"]),
            output_tokens=tokens(FULL_SHAPE["output_tokens"]),
        )

    def max_session_tokens(self) -> int:
        return self.first_turn_tokens + (self.turns - 1) * self.turn_tokens + self.turns * self.output_tokens


# One short session: the warm-up before a run's measurements.
WARMUP_SHAPE = Shape(
    turns=1, first_turn_tokens=256, turn_tokens=MIN_TURN_TOKENS, output_tokens=MIN_TURN_TOKENS
)


@dataclass
class Run:
    """One configuration at one concurrency."""

    config: str
    concurrency: int
    requests: int = 0
    failed: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    per_user_tokens_per_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    # A session's first turn (its long prompt) and its later turns (a tool result over the
    # history: the turns whose prefill runs over host pages under pressure).
    first_turn_ttft_p50_s: float = 0.0
    later_turn_ttft_p50_s: float = 0.0
    later_turn_ttft_p99_s: float = 0.0
    mean_running: float = 0.0
    preemptions: float = 0.0
    new_prompt_tokens: int = 0
    computed_prompt_tokens: float = 0.0
    recomputed_prompt_tokens: float = 0.0
    bytes_to_host: float = 0.0
    bytes_from_host: float = 0.0
    pages_demoted: float = 0.0
    # Work counters of the HiSparse data path (they predict GPU cost where CPU time cannot):
    # per sparse-MLA layer and engine step with a forward.
    engine_steps: float = 0.0
    attention_calls_per_layer_step: float = 0.0
    resolver_calls_per_layer_step: float = 0.0
    max_resolver_calls_per_layer_step: float = 0.0
    # Attention passes beyond a layer's first in a step (a prefill chunk whose selections
    # outgrew its hot buffer and staging), per layer and step.
    extra_attention_passes_per_layer_step: float = 0.0
    resolution_plans_per_step: float = 0.0
    resolving_steps: float = 0.0
    rows_loaded: float = 0.0
    rows_staged: float = 0.0
    rows_staged_per_layer_step: float = 0.0
    staging_rows_leased: float = 0.0
    staging_rows_short: float = 0.0
    host_syncs_per_step: float = 0.0
    # Admission tries whose history the host pool held but that found no room for a hot
    # lease, and the steps such turns waited for room instead of recomputing it.
    host_hits_without_lease: float = 0.0
    lease_waits: float = 0.0
    ratios_to_baseline: dict[str, float] = field(default_factory=dict)
    # `vllm bench serve`'s fields and units (milliseconds) where they overlap.
    duration: float = 0.0
    completed: int = 0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    mean_ttft_ms: float = 0.0
    median_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    median_tpot_ms: float = 0.0
    p99_tpot_ms: float = 0.0


def serve_args(config: str, args: argparse.Namespace, engine_id: str) -> list[str]:
    common = [
        "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", "128",
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
        "--gpu-memory-utilization", "0.3",
        "--enforce-eager",
        "--seed", "0",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    kv_transfer = offloading_connector(engine_id, args.spec, args.offload_bytes)
    connector = ["--kv-transfer-config", json.dumps(kv_transfer)]
    if config == "preemption":
        return common
    if config == "offload":
        return common + connector
    hisparse = {"hisparse_config": {"host_pool_gib": args.host_pool_gib, "mode": config}}
    return common + connector + ["--attention-config", json.dumps(hisparse)]


class ExternalServer(VllmServer):
    """A server this benchmark did not start: only its OpenAI-compatible API and /metrics."""

    def __init__(self, base_url: str, served_name: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.served_name = served_name
        self.engine_id = ""
        self.process = None

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def start(self) -> None:
        import urllib.request

        with urllib.request.urlopen(self.url("/v1/models"), timeout=30) as response:
            served = [m.get("id") for m in json.loads(response.read()).get("data", ())]
        if self.served_name not in served:
            raise RuntimeError(f"{self.base_url} serves {served}, not --model {self.served_name!r}")

    def stop(self) -> None:
        pass

    def metrics(self) -> str:
        try:
            return super().metrics()
        except SERVER_ERRORS:
            return ""  # a gateway may not expose /metrics: those figures stay 0


def run_session(
    server: VllmServer, session: int, shape: Shape, results: list, failed: list, vocab: int = MODEL.vocab_size
) -> None:
    rng = random.Random(7000 + session)
    prompt = [rng.randrange(3, vocab) for _ in range(shape.first_turn_tokens)]
    history = 0  # tokens an earlier turn already computed (prompt and answer)
    for turn in range(shape.turns):
        try:
            done: Completion = server.stream(prompt, shape.output_tokens)
        except (*SERVER_ERRORS, RuntimeError) as e:
            failed.append(f"session {session + 1} turn {turn + 1}: {e}")
            return
        results.append((done, len(prompt) - history, turn))
        history = len(prompt) + len(done.token_ids)
        prompt = prompt + done.token_ids + [rng.randrange(3, vocab) for _ in range(shape.turn_tokens)]


def sample_running(server: VllmServer, samples: list[float], stop: threading.Event) -> None:
    while not stop.wait(0.25):
        try:
            samples.append(metric(server.metrics(), "vllm:num_requests_running"))
        except SERVER_ERRORS:
            continue


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(config: str, concurrency: int, shape: Shape, model: Path | None, args: argparse.Namespace) -> Run:
    engine_id = f"hisparse-bench-{uuid.uuid4().hex[:8]}"
    log_path = args.out / "logs" / f"{config}-c{concurrency}.log"
    # Sessions longer than the tiny model's positions (--scale above about 1/20): its plain
    # RoPE extends, and every configuration runs the same model, so the ratios stand.
    long = args.max_model_len > MODEL.max_position_embeddings
    # The work counters below read the servers' test-and-benchmark counters (docs/metrics.md).
    env = {"VLLM_HISPARSE_DEBUG_METRICS": "1"}
    if long:
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    if args.base_url:
        server: VllmServer = ExternalServer(args.base_url, args.model)
    else:
        server = VllmServer(model, SERVED_NAME, serve_args(config, args, engine_id), log_path, engine_id, env)
    vocab = args.vocab_size if args.base_url else MODEL.vocab_size
    run = Run(config, concurrency)
    results: list[tuple[Completion, int, int]] = []  # (completion, new prompt tokens, turn)
    samples: list[float] = []
    stop = threading.Event()
    try:
        server.start()
        sampler = threading.Thread(target=sample_running, args=(server, samples, stop), daemon=True)
        sampler.start()
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for future in [
                pool.submit(run_session, server, s, shape, results, run.failed, vocab)
                for s in range(concurrency)
            ]:
                future.result()
        run.wall_s = time.monotonic() - start
        stop.set()
        sampler.join()
        time.sleep(1)  # the last step's stats reach the metrics
        text = server.metrics()
    finally:
        stop.set()
        server.stop()
    done = [c for c, _, _ in results]
    run.requests = len(done)
    if not done:
        return run
    run.output_tokens = sum(len(c.token_ids) for c in done)
    run.output_tokens_per_s = run.output_tokens / run.wall_s
    decoded = [(len(c.token_ids) - 1) / c.decode_s for c in done if len(c.token_ids) > 1 and c.decode_s > 0]
    run.per_user_tokens_per_s = statistics.fmean(decoded) if decoded else 0.0
    ttfts = [c.ttft_s for c in done]
    run.ttft_p50_s, run.ttft_p99_s = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    first = [c.ttft_s for c, _, turn in results if turn == 0]
    later = [c.ttft_s for c, _, turn in results if turn > 0]
    run.first_turn_ttft_p50_s = percentile(first, 0.5) if first else 0.0
    if later:
        run.later_turn_ttft_p50_s, run.later_turn_ttft_p99_s = percentile(later, 0.5), percentile(later, 0.99)
    run.mean_running = statistics.fmean(samples) if samples else 0.0
    run.preemptions = metric(text, "vllm:num_preemptions_total")
    run.new_prompt_tokens = sum(new for _, new, _ in results)
    # Every step's tokens, less the decode steps (each output token after the first is one).
    decode_steps = sum(max(len(c.token_ids) - 1, 0) for c in done)
    run.computed_prompt_tokens = metric(text, "vllm:iteration_tokens_total_sum") - decode_steps
    run.recomputed_prompt_tokens = max(run.computed_prompt_tokens - run.new_prompt_tokens, 0.0)
    run.bytes_to_host = metric(text, "vllm:hisparse_bytes_to_host_total") + metric(
        text, "vllm:kv_offload_store_bytes_total"
    )
    run.bytes_from_host = metric(text, "vllm:hisparse_bytes_from_host_total") + metric(
        text, "vllm:kv_offload_load_bytes_total"
    )
    run.pages_demoted = metric(text, "vllm:hisparse_pages_demoted_total")
    add_bench_serve_fields(run, results)
    add_work_counters(run, text)
    return run


def add_bench_serve_fields(run: Run, results: list) -> None:
    """`vllm bench serve`'s figures (times in milliseconds) from the same requests."""
    done = [c for c, _, _ in results]
    ttfts = [c.ttft_s * 1e3 for c in done]
    tpots = [c.decode_s * 1e3 / (len(c.token_ids) - 1) for c in done if len(c.token_ids) > 1]
    run.duration = run.wall_s
    run.completed = len(done)
    run.total_input_tokens = sum(c.prompt_tokens for c in done)
    run.total_output_tokens = run.output_tokens
    run.request_throughput = run.completed / run.wall_s if run.wall_s else 0.0
    run.output_throughput = run.output_tokens_per_s
    if ttfts:
        run.mean_ttft_ms, run.median_ttft_ms = statistics.fmean(ttfts), statistics.median(ttfts)
        run.p99_ttft_ms = percentile(ttfts, 0.99)
    if tpots:
        run.mean_tpot_ms, run.median_tpot_ms = statistics.fmean(tpots), statistics.median(tpots)
        run.p99_tpot_ms = percentile(tpots, 0.99)


def add_work_counters(run: Run, text: str) -> None:
    """The data path's work per engine step, from the server's HiSparse counters."""
    run.engine_steps = metric(text, "vllm:iteration_tokens_total_count")
    if run.config in ("preemption", "offload"):
        return
    forward_steps = metric(text, "vllm:hisparse_forward_steps_total")
    layered = forward_steps * MODEL.num_hidden_layers
    if not layered:
        return
    run.attention_calls_per_layer_step = metric(text, "vllm:hisparse_attention_calls_total") / layered
    run.resolver_calls_per_layer_step = metric(text, "vllm:hisparse_resolver_calls_total") / layered
    run.max_resolver_calls_per_layer_step = metric(text, "vllm:hisparse_max_resolver_calls_per_layer_step")
    run.extra_attention_passes_per_layer_step = (
        metric(text, "vllm:hisparse_extra_attention_passes_total") / layered
    )
    run.resolution_plans_per_step = metric(text, "vllm:hisparse_resolution_plans_total") / forward_steps
    run.resolving_steps = metric(text, "vllm:hisparse_resolving_steps_total")
    run.rows_loaded = metric(text, "vllm:hisparse_rows_loaded_total")
    run.rows_staged = metric(text, "vllm:hisparse_rows_staged_total")
    run.rows_staged_per_layer_step = run.rows_staged / layered
    run.staging_rows_leased = metric(text, "vllm:hisparse_staging_rows_leased_total")
    run.staging_rows_short = metric(text, "vllm:hisparse_staging_rows_short_total")
    run.host_hits_without_lease = metric(text, "vllm:hisparse_host_hits_without_lease_total")
    run.lease_waits = metric(text, "vllm:hisparse_lease_waits_total")
    worker_steps = metric(text, "vllm:hisparse_worker_steps_total")
    run.host_syncs_per_step = metric(text, "vllm:hisparse_device_reads_total") / max(worker_steps, 1)


RATIO_FIELDS = (
    "output_tokens_per_s",
    "per_user_tokens_per_s",
    "mean_running",
    "ttft_p50_s",
    "ttft_p99_s",
    "later_turn_ttft_p50_s",
    "later_turn_ttft_p99_s",
)


def add_ratios(runs: list[Run]) -> None:
    """Each run's figures divided by the baseline's at the same concurrency (same invocation)."""
    baseline = {r.concurrency: r for r in runs if r.config == BASELINE}
    for run in runs:
        base = baseline.get(run.concurrency)
        if base is None:
            continue
        run.ratios_to_baseline = {
            name: getattr(run, name) / getattr(base, name) for name in RATIO_FIELDS if getattr(base, name) > 0
        }


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6.4, 4.8))
    # The configurations in their usual order, then any label a --base-url run was given.
    for config in [*CONFIGS, *sorted({r.config for r in runs} - set(CONFIGS))]:
        mine = [r for r in runs if r.config == config]
        points = sorted((r.concurrency, r.per_user_tokens_per_s, r.output_tokens_per_s) for r in mine)
        if not points:
            continue
        axes.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=config)
        for concurrency, x, y in points:
            axes.annotate(str(concurrency), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xlabel("per-user tokens/s (1 / TPOT)")
    axes.set_ylabel("output tokens/s")
    axes.set_title("Interactivity vs throughput (labels: concurrent sessions)")
    axes.legend()
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentic.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale",
        type=float,
        default=QUICK["scale"],
        help="token counts of the announcement's sessions times this (default 1/40; "
        f"each turn keeps at least {MIN_TURN_TOKENS} tokens)",
    )
    parser.add_argument(
        "--first-turn-tokens",
        type=int,
        default=None,
        help="the first turn's tokens instead of its scaled length (e.g. later turns of "
        "256 tokens, --scale 0.34, without a 25K-token first turn)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=QUICK["turns"],
        help="turns per session (default 4; the announcement's 13)",
    )
    parser.add_argument(
        "--concurrency",
        default=QUICK["concurrency"],
        help="comma-separated concurrent sessions to sweep (default 2,4)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"subset of {','.join(CONFIGS)} (default: all); "
        "with --base-url, the run's label (default: external)",
    )
    parser.add_argument(
        "--base-url", default=None, help="run against this OpenAI-compatible server instead of starting one"
    )
    parser.add_argument("--model", default=None, help="with --base-url: the served model name")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=32_000,
        help="with --base-url: prompt token ids are drawn below this (default 32000)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each configuration per concurrency, in alternating order; the "
        "fastest is reported, every one is kept in results.json (default 1)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the discarded warm-up server run before the measurements",
    )
    parser.add_argument(
        "--no-scheduler-steps",
        dest="scheduler_steps",
        action="store_false",
        help="skip the per-step scheduling time sweep (benchmarks/scheduler_steps.py)",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=QUICK["kv_cache_bytes"],
        help="device KV cache bytes, the same for every configuration (default 24 MiB)",
    )
    parser.add_argument("--host-pool-gib", type=float, default=0.1, help="HiSparse host pool (GiB)")
    parser.add_argument("--offload-bytes", type=int, default=64 << 20, help="OffloadingConnector host bytes")
    parser.add_argument("--spec", default="TieringOffloadingSpec", help="OffloadingConnector spec_name")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS / time.strftime("%Y%m%d-%H%M%S"),
        help="output folder (default benchmarks/results/<date-time>)",
    )
    args = parser.parse_args(argv)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        parser.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if args.base_url:
        if not args.model:
            parser.error("--base-url needs --model, the name the server serves")
        # One server, one configuration: --configs only labels the run.
        args.configs = [c for c in (args.configs or "external").split(",") if c]
        if len(args.configs) != 1:
            parser.error("--base-url runs one configuration: give --configs one label (or none)")
        if args.vocab_size < 4:
            parser.error("--vocab-size must be >= 4")
        args.warmup = False
        args.scheduler_steps = False
    else:
        if args.model:
            parser.error("--model names the served model of --base-url; without it the tiny model is served")
        args.configs = [c for c in (args.configs or ",".join(CONFIGS)).split(",") if c]
        unknown = [c for c in args.configs if c not in CONFIGS]
        if unknown or not args.configs:
            parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if min(args.concurrency) < 1 or args.turns < 1 or args.repeats < 1:
        parser.error("--concurrency, --turns and --repeats must be >= 1")
    if args.first_turn_tokens is not None and args.first_turn_tokens < MIN_TURN_TOKENS:
        parser.error(f"--first-turn-tokens must be >= {MIN_TURN_TOKENS}")
    if args.scale <= 0 or args.host_pool_gib <= 0:
        parser.error("--scale and --host-pool-gib must be > 0")
    shape = Shape.scaled(args.scale, args.turns, args.first_turn_tokens)
    # Room for one whole session, rounded up to whole 64-token pages.
    args.max_model_len = -(-shape.max_session_tokens() // 64) * 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = Shape.scaled(args.scale, args.turns, args.first_turn_tokens)
    model = None if args.base_url else tiny_models.tiny_model_dir(MODEL, CACHE / "tiny-models")
    args.out.mkdir(parents=True, exist_ok=True)
    where = (f"against {args.base_url} ({args.model})" if args.base_url
             else f"KV cache {args.kv_cache_bytes / (1 << 20):.1f} MiB")  # fmt: skip
    print(
        f"Agentic benchmark: {shape.turns} turns, first turn {shape.first_turn_tokens} tokens, later turns "
        f"{shape.turn_tokens} in / {shape.output_tokens} out (scale {args.scale:g}); {where}; configs "
        f"{', '.join(args.configs)}; concurrency {', '.join(map(str, args.concurrency))}",
        flush=True,
    )
    if args.warmup:
        # The first server of a run pays for cold caches (bytecode, files): not a configuration's cost.
        print("  warm-up (discarded) ...", end=" ", flush=True)
        try:
            measure(args.configs[0], 1, WARMUP_SHAPE, model, args)
        except (RuntimeError, *SERVER_ERRORS) as e:
            print(f"failed: {e} (log: {args.out / 'logs'})", file=sys.stderr)
            return 1
        print("done", flush=True)
    runs: list[Run] = []
    all_runs: list[Run] = []
    for concurrency in args.concurrency:
        tried: dict[str, list[Run]] = {config: [] for config in args.configs}
        for repeat in range(args.repeats):
            # Alternate the order so no configuration always runs first or last.
            for config in args.configs if repeat % 2 == 0 else reversed(args.configs):
                print(f"  {config:<10} x{concurrency} ...", end=" ", flush=True)
                try:
                    run = measure(config, concurrency, shape, model, args)
                except (RuntimeError, *SERVER_ERRORS) as e:
                    print(f"failed: {e} (log: {args.out / 'logs'})", file=sys.stderr)
                    return 1
                tried[config].append(run)
                print(
                    f"{run.output_tokens_per_s:.1f} tok/s, {run.per_user_tokens_per_s:.1f} tok/s/user, "
                    f"running {run.mean_running:.2f}, preemptions {run.preemptions:.0f}, recomputed "
                    f"{run.recomputed_prompt_tokens:.0f}, steps {run.engine_steps:.0f}, TTFT p50 "
                    f"first turn {run.first_turn_ttft_p50_s:.2f} s, later turns "
                    f"{run.later_turn_ttft_p50_s:.2f} s",
                    flush=True,
                )
        for config in args.configs:
            # Interference on a shared machine only slows a run down: keep each one's fastest.
            runs.append(max(tried[config], key=lambda r: r.output_tokens_per_s))
            all_runs.extend(tried[config])
    add_ratios(runs)
    scheduling: list[dict[str, float]] = []
    if args.scheduler_steps:
        import scheduler_steps

        print(
            "  per-step scheduling time, batch of "
            f"{scheduler_steps.BATCH} under pressure (scheduler harness, no model):",
            flush=True,
        )
        for context in scheduler_steps.CONTEXTS:
            row = scheduler_steps.measure(context)
            scheduling.append(row)
            print(
                f"    context {context:>6}: {row['mean_ms']:.2f} ms/step, {row['host_pages']} host pages",
                flush=True,
            )
    result = {
        "shape": asdict(shape),
        "scale": args.scale,
        "kv_cache_bytes": args.kv_cache_bytes,
        "base_url": args.base_url,
        "model": args.model or SERVED_NAME,
        "baseline": BASELINE,
        "repeats": args.repeats,
        "runs": [asdict(r) for r in runs],
        "all_runs": [asdict(r) for r in all_runs],
        "scheduler_steps": scheduling,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    plot(runs, args.out / "pareto.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'pareto.png'}")
    failed = [f for r in runs for f in r.failed]
    if failed:
        print("failed requests:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
