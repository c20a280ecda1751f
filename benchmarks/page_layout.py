# SPDX-License-Identifier: Apache-2.0
"""What the page layout saves the scheduler: HiSparse's KV cache groups against the
page layout, side by side, in the capacity simulator.

HiSparse's layout today splits the sparse-MLA layers into k groups (k = 13 for
GLM-5.3) beside the resident group, so vLLM's KV cache manager allocates, caches,
looks up and frees k + 1 blocks per 64-token page. The page layout
(`page_layout_kv_cache_groups`) puts every sparse-MLA layer in one group and gives
the resident group blocks of m pages, so a page costs 1 + 1/m blocks.

Both run the real scheduler (vLLM's Scheduler, KV cache manager and
OffloadingConnector, and HiSparse's scheduling) on the simulator's OpenHands workload,
in two scenarios:
- `pressure`: the KV cache the planner gives the GPUs, so pages are demoted to the
  host pool and histories come back from it;
- `no-pressure`: a KV cache that holds every session whole (`--kv-cache-memory-bytes`,
  900 GiB per GPU by default), so the two differ only in layout; a run that demotes is
  refused.
The page layout's prefix hits end on its resident blocks (vLLM caches a block once
it is full), so a later turn recomputes more: the recomputed tokens and the
simulated throughput are reported beside the timings.

Reports, per scenario and layout: the scheduler's wall-clock ms per step (measured,
the mean of `--repeats` runs, alternated so that both see the same machine), the
simulated outcome, and the KV cache manager's work per step (block-pool blocks
allocated, freed and cached, and per-group prefix-cache lookups), which predicts the
cost where this machine's timing is noisy. The OffloadingConnector configuration
(upstream's layout) is timed in the same run for reference.

Usage: python benchmarks/page_layout.py [--concurrency 64] [--turns 6] [--repeats 2]
       [--scenarios pressure,no-pressure] [--output benchmarks/results/page_layout.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

NO_PRESSURE_BYTES = 900 << 30


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    """The KV cache groups vLLM's start-up sizing and the scheduler get: HiSparse's
    (`groups`) or the page layout's (`page`), as `simulate --kv-layout` chooses them."""
    from vllm.v1.hisparse.kv_grouping import kv_layout

    with kv_layout(name):
        yield


@contextlib.contextmanager
def counting(counts: collections.Counter[str]) -> Iterator[None]:
    """Count the block pool's work: blocks allocated, freed and cached, and per-group
    prefix-cache lookups."""
    from vllm.v1.core.block_pool import BlockPool

    get_new, free, cache, lookup = (
        BlockPool.get_new_blocks,
        BlockPool.free_blocks,
        BlockPool.cache_full_blocks,
        BlockPool.get_cached_block,
    )

    def get_new_blocks(self, num_blocks, *args, **kwargs):
        counts["blocks allocated"] += num_blocks
        return get_new(self, num_blocks, *args, **kwargs)

    def free_blocks(self, ordered_blocks, *args, **kwargs):
        blocks = list(ordered_blocks)
        counts["blocks freed"] += len(blocks)
        return free(self, blocks, *args, **kwargs)

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs):
        counts["blocks cached"] += max(0, num_full_blocks - num_cached_blocks)
        return cache(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        counts["vLLM prefix-cache group lookups"] += len(kv_cache_group_ids)
        return lookup(self, block_hash, kv_cache_group_ids)

    with (
        mock.patch.object(BlockPool, "get_new_blocks", get_new_blocks),
        mock.patch.object(BlockPool, "free_blocks", free_blocks),
        mock.patch.object(BlockPool, "cache_full_blocks", cache_full_blocks),
        mock.patch.object(BlockPool, "get_cached_block", get_cached_block),
    ):
        yield


SCENARIOS = ("pressure", "no-pressure")


def simulate(config: str, args: argparse.Namespace, scenario: str, kv_layout: str) -> dict[str, Any]:
    """One simulator record on `kv_layout` (the simulator's own command line, in this process)."""
    from vllm.v1.hisparse.capacity.simulate import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        argv = [
            *("--model", args.model, "-tp", str(args.tensor_parallel_size)),
            *("--workload", "openhands", "--turns", str(args.turns)),
            *("--concurrency", str(args.concurrency), "--configs", config),
            *("--jobs", "1", "--format", "json", "--output", str(out)),
            *("--kv-layout", kv_layout),
        ]
        if scenario == "no-pressure":
            argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        if main(argv) != 0:
            raise SystemExit(f"the simulation of {config} failed")
        document = json.loads(out.read_text())
        if document.get("kv_layout", "groups") != kv_layout:
            raise SystemExit(f"the simulation ran {document.get('kv_layout')!r}, not {kv_layout!r}")
        (record,) = document["records"]
    return record


OUTCOMES = (
    "steps",
    "mean_running",
    "output_tokens_per_s",
    "preemptions",
    "pages_demoted",
    "new_prompt_tokens",
    "recomputed_prompt_tokens",
)


def run_scenario(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    times: dict[str, list[float]] = {"groups": [], "page": [], "offload": []}
    outcome: dict[str, dict[str, Any]] = {}
    for repeat in range(args.repeats):
        for name in ("groups", "page", "offload") if repeat % 2 == 0 else ("page", "groups", "offload"):
            if name == "offload":
                record = simulate("offload", args, scenario, "groups")
            else:
                record = simulate("hybrid", args, scenario, name)
            if scenario == "no-pressure" and record["pages_demoted"]:
                raise SystemExit(
                    f"{name}: {record['pages_demoted']} pages were demoted; give a larger "
                    "--kv-cache-memory-bytes so that the layouts compare without pressure"
                )
            times[name].append(record["scheduler_ms_per_step"])
            outcome[name] = record
            print(
                f"  {scenario}, {name} run {repeat + 1}: {record['scheduler_ms_per_step']:.2f} ms/step",
                flush=True,
            )
    work: dict[str, dict[str, float]] = {}
    for name in ("groups", "page"):
        counts: collections.Counter[str] = collections.Counter()
        with counting(counts):
            record = simulate("hybrid", args, scenario, name)
        work[name] = {key: value / record["steps"] for key, value in sorted(counts.items())}
    rows = {
        name: {
            "scheduler_ms_per_step": statistics.fmean(times[name]),
            "scheduler_ms_per_step_runs": times[name],
            **{key: outcome[name][key] for key in OUTCOMES},
            "work_per_step": work.get(name, {}),
        }
        for name in ("groups", "page", "offload")
    }
    return {
        "page_over_groups": rows["page"]["scheduler_ms_per_step"] / rows["groups"]["scheduler_ms_per_step"],
        "layouts": rows,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "concurrency": args.concurrency,
        "turns": args.turns,
        "no_pressure_kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "labels": {
            "scheduler_ms_per_step": "measured (this machine's clock)",
            "work_per_step": "measured (counted in vLLM's block pool)",
            "output_tokens_per_s": "simulated",
            "mean_running": "simulated",
        },
        "scenarios": {scenario: run_scenario(args, scenario) for scenario in args.scenarios},
    }


def render(result: dict[str, Any]) -> str:
    lines = []
    for scenario, outcome in result["scenarios"].items():
        rows = outcome["layouts"]
        keys = sorted({k for row in rows.values() for k in row["work_per_step"]})
        head = [
            "layout",
            "scheduler ms/step",
            "steps",
            "mean running (sim)",
            "output tok/s (sim)",
            "recomputed tokens",
            "pages demoted",
            *keys,
        ]
        lines += [f"\n{scenario}:", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for name, row in rows.items():
            cells = [
                name,
                f"{row['scheduler_ms_per_step']:.2f}",
                str(row["steps"]),
                f"{row['mean_running']:.1f}",
                f"{row['output_tokens_per_s']:.0f}",
                f"{row['recomputed_prompt_tokens']:,}",
                f"{row['pages_demoted']:,}",
                *(f"{row['work_per_step'][k]:,.0f}" if k in row["work_per_step"] else "-" for k in keys),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        ratio = outcome["page_over_groups"]
        lines.append(f"page layout / HiSparse's groups, scheduler ms per step: {ratio:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="glm-5.3")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--scenarios",
        type=lambda text: [s for s in text.split(",") if s],
        default=list(SCENARIOS),
        help="comma-separated: pressure (the planner's KV cache), no-pressure (default: both)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=NO_PRESSURE_BYTES,
        help="the no-pressure scenario's KV cache per GPU (default 900 GiB: nothing is demoted)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios takes {', '.join(SCENARIOS)}")
    result = run(args)
    print(render(result))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
