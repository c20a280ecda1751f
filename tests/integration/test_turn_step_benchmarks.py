# SPDX-License-Identifier: Apache-2.0
"""The benchmarks that read the scheduler's work per new turn: they run, and what they
count is what the code does."""

from __future__ import annotations

import sys

import scheduler_harness as sh

sys.path.insert(0, str(sh.REPO / "benchmarks"))

import history_reuse
import turn_steps


def test_a_history_whose_copies_the_host_pool_holds_is_retained_in_batches_not_page_by_page():
    """Every page of a 300-page history becomes BOTH with its cached copy (the benchmark
    checks it), at one host pool call per batch of `plan_copies`, not one or two per page."""
    calls = history_reuse.Counter()
    history_reuse.reuse_once(300, calls)
    assert calls, "the host pool was asked for the copies"
    assert sum(calls.values()) <= 2 * -(-300 // 256), f"host pool calls for 300 pages: {dict(calls)}"


def test_the_turn_step_split_accounts_for_every_step_of_the_simulation():
    result = turn_steps.measure(
        ["--model", "glm-5.3", "-tp", "8", "--concurrency", "4", "--turns", "2", "--configs", "hybrid",
         "--workload", "openhands", "--kv-layout", "page"]
    )  # fmt: skip
    steps = result["steps"]
    assert steps["turn"] >= 1 and sum(steps.values()) == result["simulated_steps"]
    turn = result["ms_per_step"]["turn"]
    assert turn["schedule"] > 0 and {"finish_step", "allocate_slots", "get_computed_blocks"} <= set(turn)
    assert all(turn[name] <= turn["schedule"] for name in turn), "a seam in schedule() outlasted it"
