# SPDX-License-Identifier: Apache-2.0
"""`make bench`: the agentic benchmark runs the configurations side by side and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow


def test_the_benchmark_measures_the_baseline_and_hybrid_side_by_side(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "agentic.py"), "--configs", "offload,hybrid",
         "--concurrency", "2", "--turns", "2", "--scale", "0.0125", "--kv-cache-bytes", str(12 << 20),
         "--no-warmup", "--no-scheduler-steps", "--out", str(out)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["shape"] == {"turns": 2, "first_turn_tokens": 927, "turn_tokens": 16, "output_tokens": 16}
    runs = {run["config"]: run for run in result["runs"]}
    assert set(runs) == {"offload", "hybrid"}
    for run in runs.values():
        assert run["concurrency"] == 2 and run["requests"] == 4 and not run["failed"]
        assert run["output_tokens"] == 4 * 16
        assert run["output_tokens_per_s"] > 0 and run["per_user_tokens_per_s"] > 0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
        assert run["mean_running"] > 0
        # Two first turns and two second turns' new tokens; the engine computed at least those.
        assert run["new_prompt_tokens"] == 2 * 927 + 2 * 16
        assert run["computed_prompt_tokens"] >= run["new_prompt_tokens"]
        assert run["bytes_to_host"] > 0, "the connector stored, or HiSparse copied, something"
    assert runs["hybrid"]["pages_demoted"] > 0, "the KV pool was under pressure"
    # The data path's work counters: one attention call per layer and step, which resolves
    # once per pass (one pass, unless a chunk's selections outgrew its hot and staging
    # rows), every one of them counted.
    hybrid = runs["hybrid"]
    assert hybrid["attention_calls_per_layer_step"] == pytest.approx(1.0)
    assert hybrid["max_resolver_calls_per_layer_step"] >= 1
    extra = hybrid["extra_attention_passes_per_layer_step"]
    assert 0 < hybrid["resolver_calls_per_layer_step"] - extra <= 1
    assert hybrid["rows_loaded"] > 0 and hybrid["engine_steps"] > 0
    assert hybrid["host_syncs_per_step"] == pytest.approx(1.0), "one read of the step's counters"
    # Ratios are the two runs' own figures divided, measured in the same invocation.
    for name, ratio in runs["hybrid"]["ratios_to_baseline"].items():
        assert ratio == pytest.approx(runs["hybrid"][name] / runs["offload"][name])
    assert set(runs["offload"]["ratios_to_baseline"].values()) == {1.0}
    assert (out / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)
