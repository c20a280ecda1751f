# SPDX-License-Identifier: Apache-2.0
"""Where the scheduler's time goes in the steps that admit a turn, and in the others.

Runs one capacity simulation (`python -m vllm.v1.hisparse.capacity simulate`, the real
scheduler on the OpenHands workload) in this process with timers on the seams below,
and splits the steps in two: those whose `schedule()` admitted a new request (a turn)
and the others (a `schedule()` that scheduled nothing is not a step, as the simulator
counts). Reports, per kind, the steps, the mean milliseconds of `schedule()` (the
simulator's own figure adds `update_from_output()`), and the mean milliseconds per
step spent in each seam (measured, wall-clock; the timers add a little to every
figure, so read the shares, and compare runs of this script only).

Seams (a seam's time includes the seams it calls):
- `walk`: HiSparse's admission walk over a waiting turn's history (`Admissions._walk`);
- `get_computed_blocks`: vLLM's own device prefix-cache lookup;
- `allocate_slots`: vLLM's block allocation (and caching) for every scheduled request;
- `fit_chunk`: HiSparse's chunk fitting (staging, relief for the chunk's blocks);
- `connector_meta`, `connector_match`: the OffloadingConnector's step metadata and hit lookup;
- `finish_step`: HiSparse's bookkeeping after `schedule()`, which includes `register`
  (a new turn's pages registered with residency), `advance` (pages completed),
  `cache_pages` (the page layout's per-page prefix caching) and `plan_copies`
  (proactive copies, and pages whose copies the host pool already holds);
- `gc`: the garbage collector's collections that ran inside `schedule()`.

Usage: python benchmarks/turn_steps.py [--concurrency 64] [--turns 6] [--config hybrid]
       [--kv-layout page] [--no-pressure] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# 900 GiB per GPU: every session fits whole, nothing is demoted.
NO_PRESSURE_BYTES = 966_367_641_600


def _seams() -> list[tuple[object, str, str]]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.hisparse.admission import Admissions
    from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess
    from vllm.v1.hisparse.residency import ResidencyManager
    from vllm.v1.hisparse.scheduling import HiSparseScheduling

    return [
        (Admissions, "_walk", "walk"),
        (KVCacheManager, "get_computed_blocks", "get_computed_blocks"),
        (KVCacheManager, "allocate_slots", "allocate_slots"),
        (HiSparseScheduling, "fit_chunk", "fit_chunk"),
        (Scheduler, "_build_kv_connector_meta", "connector_meta"),
        (OffloadingConnector, "get_num_new_matched_tokens", "connector_match"),
        (HiSparseScheduling, "finish_step", "finish_step"),
        (HiSparseScheduling, "_register_pages", "register"),
        (ResidencyManager, "advance", "advance"),
        (KVCacheBlockAccess, "cache_pages", "cache_pages"),
        (ResidencyManager, "plan_copies", "plan_copies"),
    ]


def measure(argv: list[str]) -> dict:
    """Run `capacity simulate` with these arguments; the per-kind split of its steps."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.hisparse.capacity import simulate

    step: Counter = Counter()
    totals = {"turn": Counter(), "other": Counter()}
    steps: Counter = Counter()

    def timed(original, name):
        def seam(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                step[name] += time.perf_counter() - started

        return seam

    originals = []
    for owner, attribute, name in _seams():
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))
        setattr(owner, attribute, timed(original, name))
    schedule = Scheduler.schedule

    def timed_schedule(self):
        step.clear()
        started = time.perf_counter()
        output = schedule(self)
        elapsed = time.perf_counter() - started
        if output.total_num_scheduled_tokens <= 0:
            step.clear()  # nothing to run (waiting on copies or loads): not a step, as the simulator counts
            return output
        kind = "turn" if output.scheduled_new_reqs else "other"
        steps[kind] += 1
        totals[kind]["schedule"] += elapsed
        totals[kind].update(step)
        step.clear()
        return output

    collecting = {"since": 0.0}

    def on_collection(phase, info):
        if phase == "start":
            collecting["since"] = time.perf_counter()
        else:
            step["gc"] += time.perf_counter() - collecting["since"]

    Scheduler.schedule = timed_schedule
    gc.callbacks.append(on_collection)
    try:
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "report.json"
            code = simulate.main([*argv, "--jobs", "1", "--format", "json", "--output", str(report)])
            if code:
                raise SystemExit(f"the simulation failed (exit status {code})")
            record = json.loads(report.read_text())["records"][0]
    finally:
        Scheduler.schedule = schedule
        gc.callbacks.remove(on_collection)
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)
    return {
        "config": record["config"],
        "concurrency": record["concurrency"],
        "mean_running": record["mean_running"],
        "simulated_steps": record["steps"],
        "steps": dict(steps),
        "ms_per_step": {
            kind: {name: round(1000 * s / steps[kind], 3) for name, s in totals[kind].most_common()}
            for kind in totals
            if steps[kind]
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="glm-5.3")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--config", default="hybrid", choices=("preemption", "offload", "hybrid", "always"))
    parser.add_argument("--kv-layout", default="page", choices=("groups", "page"))
    parser.add_argument(
        "--no-pressure", action="store_true", help="a KV cache that holds every session whole"
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.turns < 1:
        parser.error("--concurrency and --turns must be at least 1")
    simulate_args = [
        "--model", args.model, "-tp", "8", "--concurrency", str(args.concurrency),
        "--turns", str(args.turns), "--configs", args.config, "--workload", "openhands",
        "--kv-layout", args.kv_layout,
    ]  # fmt: skip
    if args.no_pressure:
        simulate_args += ["--kv-cache-memory-bytes", str(NO_PRESSURE_BYTES)]
    from vllm.v1.hisparse.capacity.__main__ import logs_to_stderr

    logs_to_stderr()  # stdout is the report
    result = measure(simulate_args)
    result["pressure"] = not args.no_pressure
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
