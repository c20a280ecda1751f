# SPDX-License-Identifier: Apache-2.0
"""What a session's next turn costs residency when its history's copies are in the host pool.

A turn whose history the device still caches registers it as DEVICE pages; the host pool
still holds the copies the earlier turns made, so proactive copy makes each page BOTH
with that copy instead of copying it again (`ResidencyManager._reuse_host_copies`).
Without pressure that is every page of every new turn: about 460,000 pages in the
simulator's 64-session OpenHands run.

This times it alone, on residency and the host pool (no vLLM scheduler), for one history
of `--pages` pages: `plan_copies` until every page is BOTH. Reports the microseconds per
page (the best and the median of `--repeats` runs) and the host pool calls made per page, the work
counter that predicts it where this machine's timing is noisy.

Usage: python benchmarks/history_reuse.py [--pages 2200] [--repeats 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "unit"))

BLOCK = 64


def reuse_once(num_pages: int, calls: Counter | None = None) -> float:
    """Seconds `plan_copies` takes to make a `num_pages` history BOTH from cached copies."""
    from test_residency import BlockPoolModel

    from vllm.v1.hisparse.host_pool import HostPagePool
    from vllm.v1.hisparse.residency import PageState, ResidencyManager

    pool = BlockPoolModel(num_pages + 64)
    host_pool = HostPagePool(num_pages + 64)
    mgr = ResidencyManager(pool, host_pool, BLOCK, 2048, max_copies_per_step=256)
    hashes = [f"page-{i}".encode() for i in range(num_pages)]
    for block_hash in hashes:  # an earlier turn's landed copies, cached
        page = host_pool.allocate()
        host_pool.publish(page, block_hash)
        host_pool.release(page)
    mgr.add_request("turn", block_hashes=hashes)
    mgr.append_pages("turn", pool.allocate_pages("turn", num_pages, 1))
    mgr.advance("turn", num_pages * BLOCK)
    if calls is not None:
        for name in ("lookup", "lookup_all", "retain", "retain_all", "retain_cached", "retain_all_cached"):
            method = getattr(host_pool, name, None)
            if method is not None:
                setattr(host_pool, name, _counted(method, name, calls))
    started = time.perf_counter()
    while mgr.requests["turn"].uncopied:
        assert mgr.plan_copies() == [], "a page whose copy the pool holds was copied"
    elapsed = time.perf_counter() - started
    assert mgr.pages_by_state()[PageState.BOTH] == num_pages
    mgr.check()
    return elapsed


def _counted(method, name: str, calls: Counter):
    def counted(*args, **kwargs):
        calls[name] += 1
        return method(*args, **kwargs)

    return counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=2200, help="the history's pages (2,200: 142K tokens)")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    if args.pages < 2 or args.repeats < 1:
        parser.error("--pages must be at least 2 and --repeats at least 1")
    from vllm.v1.hisparse.capacity.__main__ import logs_to_stderr

    logs_to_stderr()  # stdout is the report
    calls: Counter = Counter()
    reuse_once(args.pages, calls)
    times = [reuse_once(args.pages) for _ in range(args.repeats)]
    print(
        json.dumps(
            {
                "pages": args.pages,
                "us_per_page_best": round(1e6 * min(times) / args.pages, 3),
                "us_per_page_median": round(1e6 * statistics.median(times) / args.pages, 3),
                "host_pool_calls_per_page": round(sum(calls.values()) / args.pages, 4),
                "host_pool_calls": dict(calls),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
