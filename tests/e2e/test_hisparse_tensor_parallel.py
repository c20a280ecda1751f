# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse at tensor-parallel size 2, through the real engine on CPU: under the mp
executor (tiny GLM-5 and DeepSeek-V3.2), and under Ray on a local cluster of two nodes.

The two workers are processes of their own (vLLM's CPU workers, one core each);
the engine core runs in this process so the test reads its scheduler. The ranks of
the machine share one host pool of the whole host_pool_gib: rank 0 copies each page
into it once, both read rows from it. The two Ray nodes run on this one machine, so
they share it too.

Like is compared with like: the reference is the all-resident run at the same
tensor-parallel size, replaying the HiSparse run's prefill chunks and steps (each
forward holds the same requests). Splitting the
model over two ranks changes its arithmetic (sharded matmuls, an all-reduce), so a
TP=2 run and a TP=1 run may differ in a greedy token with no HiSparse at all; that
is no oracle for residency. Counts that do not depend on the arithmetic (pages,
copies, bytes) are compared with the TP=1 run of the same workload.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from engine import model_dir, prefill_chunks, scheduled_chunks
from oracle_runs import PRESSURE, REPLAY_BUDGET, SIX_LAYERS, alike, hisparse, multiprocessing_off, two_turns

pytestmark = [pytest.mark.slow_test, pytest.mark.distributed, pytest.mark.machine_wide]

SHM = Path("/dev/shm")
HOST_POOL_GIB = hisparse()["hisparse_config"]["host_pool_gib"]
TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")


def pool_names() -> set[str]:
    return {p.name for p in SHM.glob("vllm_hisparse_*")}


def tensor_parallel(run):
    """`run` with two CPU workers, each bound to one of this machine's cores."""

    def with_two_workers():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
            return run()

    return multiprocessing_off(with_two_workers)


@pytest.fixture(scope="module")
def model():
    return model_dir(SIX_LAYERS)


@pytest.fixture(scope="module")
def runs(model):
    before = pool_names()
    seen_while_serving: list[set[str]] = []

    def under_pressure():
        def look() -> None:
            seen_while_serving.append(pool_names() - before)

        return two_turns(
            model, churn=True, attention_config=hisparse(), between_turns=look, **PRESSURE, **TP2
        )

    chunks: dict = {}
    pressed, resident = alike(
        tensor_parallel(under_pressure),
        tensor_parallel(lambda: two_turns(model, **REPLAY_BUDGET, **TP2)),
        recorded=chunks,
        same_steps=True,
    )
    single = multiprocessing_off(
        lambda: two_turns(model, churn=True, attention_config=hisparse(), **PRESSURE)
    )()
    return {
        "pressed": pressed,
        "resident": resident,
        "single": single,
        "chunks": chunks,
        "serving": seen_while_serving,
        "left": pool_names() - before,
    }


def test_tokens_at_tp2_under_pressure_equal_the_tp2_all_resident_run(runs):
    tokens, tokens2, cached2, stats, preemptions, _ = runs["pressed"]
    ref_tokens, ref_tokens2, ref_cached2, *_ = runs["resident"]
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0, "pages left the device and came back"
    assert stats["request_steps_none"] > 0 and stats["host_prefix_pages_reused"] > 0
    assert preemptions == 0
    assert cached2 == ref_cached2
    assert (tokens, tokens2) == (ref_tokens, ref_tokens2)


def test_the_node_pool_holds_the_configured_size_at_tp1_and_tp2(runs):
    tp2, tp1 = runs["pressed"][3], runs["single"][3]
    page_bytes = tp1["bytes_to_host"] // tp1["pages_copied_to_host"]
    assert tp2["host_pages_total"] == tp1["host_pages_total"] == int(HOST_POOL_GIB * (1 << 30)) // page_bytes
    assert tp2["max_host_pools"] == tp1["max_host_pools"] == 1, "both ranks run on this node: one pool"


def test_each_page_is_copied_to_the_host_once_at_tp2_as_at_tp1(runs):
    tp2, tp1 = runs["pressed"][3], runs["single"][3]
    exported_tp2, exported_tp1 = runs["pressed"][5], runs["single"][5]
    assert tp2["pages_copied_to_host"] == tp1["pages_copied_to_host"] > 0
    assert tp2["bytes_to_host"] == tp1["bytes_to_host"]
    assert exported_tp2["vllm:hisparse_bytes_to_host"] == exported_tp1["vllm:hisparse_bytes_to_host"]
    # Reads are per rank: each loads its rows into its own device.
    assert tp2["bytes_from_host"] > tp1["bytes_from_host"]


def test_the_shared_pool_has_no_name_while_serving_or_after_shutdown(runs):
    """The name is removed once both ranks mapped the pool, so no exit, a killed
    worker's included, can leave it in /dev/shm."""
    assert runs["serving"] == [set()]
    assert runs["left"] == set()


def test_deepseek_v32_at_tp2_under_pressure_equals_its_tp2_all_resident_run():
    model = model_dir(dataclasses.replace(SIX_LAYERS, arch="deepseek_v32"))
    pressed, resident = alike(
        tensor_parallel(lambda: two_turns(model, churn=True, attention_config=hisparse(), **PRESSURE, **TP2)),
        tensor_parallel(lambda: two_turns(model, **REPLAY_BUDGET, **TP2)),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, _ = pressed
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert stats["request_steps_none"] > 0
    assert cached2 == resident[2]
    assert (tokens, tokens2) == resident[:2]


# ----------------------------------------------------------------------------- Ray

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def ray_cli(*args: str) -> subprocess.CompletedProcess:
    ray = Path(sys.executable).parent / "ray"
    return subprocess.run(
        [str(ray), *args], env={**os.environ, **RAY_ENV}, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def two_node_ray_cluster():
    """A Ray head and a second Ray node on this machine, one CPU each, stopped afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = ray_cli("start", "--head", "--num-cpus", "1", "--port", str(port), "--include-dashboard=false")
    assert head.returncode == 0, head.stdout + head.stderr
    try:
        node = ray_cli("start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1")
        assert node.returncode == 0, node.stdout + node.stderr
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        ray_cli("stop", "--force")


def test_ray_on_two_nodes_serves_tp2_under_pressure_like_the_mp_executor(model, runs, two_node_ray_cluster):
    """`--distributed-executor-backend ray` with one worker on each of two Ray nodes: the
    same arithmetic as the mp executor, so the tokens equal the TP=2 all-resident run."""
    import ray

    recorded: dict = {}

    def on_ray():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_ADDRESS", two_node_ray_cluster)
            for name, value in RAY_ENV.items():
                mp.setenv(name, value)
            with prefill_chunks(record=recorded):
                result = two_turns(
                    model,
                    churn=True,
                    attention_config=hisparse(),
                    **PRESSURE,
                    tensor_parallel_size=2,
                    distributed_executor_backend="ray",
                )
            nodes = [n for n in ray.nodes() if n["Alive"]]
        return result, nodes

    (tokens, tokens2, cached2, stats, preemptions, _), nodes = tensor_parallel(on_ray)()
    assert len(nodes) == 2 and all(n["Resources"].get("CPU") == 1 for n in nodes), (
        "two Ray nodes of one CPU: each holds one worker's bundle"
    )
    ref_tokens, ref_tokens2, ref_cached2, *_ = runs["resident"]
    assert scheduled_chunks(recorded) == scheduled_chunks(runs["chunks"]), "chunked as the reference replayed"
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert stats["pages_copied_to_host"] == runs["pressed"][3]["pages_copied_to_host"]
    assert stats["max_host_pools"] == 1, "both nodes run on this machine: one shared pool"
    assert cached2 == ref_cached2
    assert (tokens, tokens2) == (ref_tokens, ref_tokens2)
    assert pool_names() == set()
