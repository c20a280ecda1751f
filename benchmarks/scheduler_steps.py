# SPDX-License-Identifier: Apache-2.0
"""Per-step scheduling time of Hybrid HiSparse as contexts grow, at a fixed batch size.

vLLM's real Scheduler and KV cache manager, with the test harness playing the
worker (tests/support/scheduler_harness.py), no model: a fixed batch of
requests decodes under KV pressure (every sparse-MLA page outside the tails
demoted to the host pool) at a sweep of context lengths. Each decode step's
`schedule()` and `update_from_output()` (stats included, as the engine calls
them) is timed; the mean per step is the figure. HiSparse's per-step work
follows what changed in a step, so the figure should stay flat as the pages
held grow with the context; a figure that grows with the context is per-step
work proportional to history.

Usage: python benchmarks/scheduler_steps.py [--contexts 1024,4096,16384,65536]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "support"))

CONTEXTS = (1024, 4096, 16384, 65536)
BATCH = 4
DECODE_STEPS = 64
CHUNK = 128


def measure(context: int, batch: int = BATCH, decode_steps: int = DECODE_STEPS) -> dict[str, float]:
    """Mean and p90 milliseconds of one decode step's scheduling with `batch` requests of `context`."""
    import random

    import scheduler_harness as sh
    import tiny_models

    from vllm.v1.hisparse.kv_grouping import hisparse_device_blocks_per_request

    spec = tiny_models.TinyModelSpec(
        arch="glm5", num_hidden_layers=6, index_topk=32, max_position_embeddings=2 * max(CONTEXTS)
    )
    # Earlier requests decode while later ones prefill, then all decode for the measurement.
    max_len = context + batch * -(-context // CHUNK) + decode_steps + 2 * CHUNK
    page_bytes = 6 * 64 * 576 * 2  # one page of the six bf16 sparse-MLA layers
    host_gib = 1.1 * batch * -(-max_len // 64) * page_bytes / (1 << 30) + 0.01

    def new_config():  # one per scheduler: building its KV cache config updates it
        return sh.make_vllm_config(
            sh.tiny_glm5_dir(spec),
            max_model_len=max_len,
            max_num_batched_tokens=CHUNK,
            max_num_seqs=batch,
            attention_config={"hisparse_config": {"host_pool_gib": host_gib}},
        )

    # The pool holds one whole request and every other one's resident share (indexer
    # pages, tail, lease, a chunk): the requests prefill one after another, each pushing
    # the earlier ones' sparse-MLA pages to the host pool, and all decode under pressure.
    probe = new_config()
    specs = sh.model_kv_cache_specs(probe)
    groups = sh.build_kv_cache_config(probe, specs, num_blocks=10_000).kv_cache_groups
    share = hisparse_device_blocks_per_request(probe, groups)
    whole = -(-max_len // 64) * len(groups)
    config = new_config()
    h = sh.SchedulerHarness(config, num_blocks=whole + (batch - 1) * share + 2 * len(groups))
    rng = random.Random(context)
    for _ in range(batch):
        h.add_request([rng.randrange(3, 500) for _ in range(context)], max_tokens=max_len - context - CHUNK)
    scheduler = h.scheduler
    # Prefill, untimed, until every request decodes.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in h.requests.values()):
        output = scheduler.schedule()
        scheduler.update_from_output(output, h.model_runner_output(output))
    times = []
    for _ in range(decode_steps):
        start = time.perf_counter()
        output = scheduler.schedule()
        runner_output = h.model_runner_output(output)
        scheduler.update_from_output(output, runner_output)
        times.append((time.perf_counter() - start) * 1000)
    stats = scheduler.hisparse.stats()
    ordered = sorted(times)
    return {
        "context": context,
        "batch": batch,
        "mean_ms": statistics.fmean(times),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "host_pages": stats["pages_host"],
        "device_pages": stats["pages_device"] + stats["pages_both"],
        "preemptions": h.total_preemptions,
    }


def sweep(contexts=CONTEXTS) -> list[dict[str, float]]:
    return [measure(context) for context in contexts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scheduler_steps.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts",
        default=",".join(map(str, CONTEXTS)),
        help="comma-separated tokens per request (default %(default)s)",
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts must be comma-separated integers, got {args.contexts!r}")
    rows = []
    for context in contexts:
        row = measure(context)
        rows.append(row)
        print(
            f"context {context:>6}: {row['mean_ms']:.2f} ms/step (p90 {row['p90_ms']:.2f}), "
            f"{row['host_pages']} host pages, {row['device_pages']} device pages",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
