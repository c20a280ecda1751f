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

pytestmark = pytest.mark.slow_test


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
    # Every step a turn waited for room for its hot lease was a try that found none.
    assert 0 <= hybrid["lease_waits"] <= hybrid["host_hits_without_lease"]
    # Ratios are the two runs' own figures divided, measured in the same invocation.
    for name, ratio in runs["hybrid"]["ratios_to_baseline"].items():
        assert ratio == pytest.approx(runs["hybrid"][name] / runs["offload"][name])
    assert set(runs["offload"]["ratios_to_baseline"].values()) == {1.0}
    assert (out / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)


def test_the_benchmark_runs_against_a_separately_started_server_and_reports_bench_serve_fields(tmp_path):
    """`--base-url` and `--model`: the sessions against a server the benchmark did not start,
    labelled with --configs' one entry, with `vllm bench serve`'s fields in its units."""
    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_models
    from serving import VllmServer

    model = tiny_models.tiny_model_dir(tiny_models.TINY_GLM53, REPO / ".cache" / "tiny-models")
    args = ["--max-model-len", "2048", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
            "--attention-config", json.dumps({"hisparse_config": {"host_pool_gib": 0.1}})]  # fmt: skip
    server = VllmServer(model, "deployed-glm", args, tmp_path / "server.log",
                        env={"VLLM_HISPARSE_DEBUG_METRICS": "1"})  # fmt: skip
    server.start()
    try:
        out = tmp_path / "bench"
        done = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "agentic.py"), "--base-url", server.url(""),
             "--model", "deployed-glm", "--configs", "hybrid-node-a", "--vocab-size", "500",
             "--concurrency", "2", "--turns", "2", "--scale", "0.0125", "--out", str(out)],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert result["base_url"] == server.url("") and result["model"] == "deployed-glm"
    (run,) = result["runs"]
    assert run["config"] == "hybrid-node-a" and run["requests"] == 4 and not run["failed"]
    assert run["completed"] == 4 and run["total_output_tokens"] == 4 * 16
    assert run["total_input_tokens"] == 2 * 927 + 2 * (927 + 16 + 16), "each turn's whole prompt"
    assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"] and run["mean_ttft_ms"] > 0
    assert run["median_tpot_ms"] > 0 and run["output_throughput"] == run["output_tokens_per_s"]
    assert run["duration"] == run["wall_s"] and run["request_throughput"] == pytest.approx(4 / run["wall_s"])
    assert run["mean_running"] > 0, "the server's /metrics were read"
    assert run["ratios_to_baseline"] == {}, "one deployment: compared with nothing"
    assert (out / "pareto.png").read_bytes().startswith(PNG_SIGNATURE)


def test_base_url_needs_a_model_and_one_label(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import agentic

    for argv, named in ((["--base-url", "http://x"], "needs --model"),
                        (["--base-url", "http://x", "--model", "m", "--configs", "a,b"], "one configuration"),
                        (["--model", "m"], "--model names the served model")):  # fmt: skip
        with pytest.raises(SystemExit):
            agentic.parse_args(argv)
        assert named in capsys.readouterr().err


def test_a_labelled_run_is_drawn_with_its_label(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import agentic

    runs = [agentic.Run("hybrid-node-a", 2, per_user_tokens_per_s=3.0, output_tokens_per_s=5.0)]
    import matplotlib.pyplot as pyplot

    drawn = []
    original = pyplot.Axes.plot

    def record(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    pyplot.Axes.plot = record
    try:
        agentic.plot(runs, tmp_path / "p.png")
    finally:
        pyplot.Axes.plot = original
    assert drawn == ["hybrid-node-a"]
