# SPDX-License-Identifier: Apache-2.0
"""Ray workers on vLLM's CPU platform (patch 0014, vllm/v1/executor/cpu_ray.py)."""

from __future__ import annotations

import os

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.v1.executor import cpu_ray


def test_a_cpu_worker_asks_ray_for_no_resource_beyond_its_bundle_and_has_no_device_ids():
    assert cpu_ray.actor_resource_kwargs() == {"num_gpus": 0}
    assert cpu_ray.device_ids() == []


@pytest.fixture(scope="module")
def tp2_config(tiny_glm_dsa_dir):
    return EngineArgs(
        model=str(tiny_glm_dsa_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    ).create_engine_config()


@pytest.mark.parametrize(
    ("bind", "node_ips", "rank", "cores"),
    [
        ("0|1", ["10.0.0.1", "10.0.0.1"], 0, "0"),  # two Ray nodes on one machine share its cores
        ("0|1", ["10.0.0.1", "10.0.0.1"], 1, "1"),
        ("2,3", ["10.0.0.1", "10.0.0.2"], 1, "2,3"),  # one rank per machine: its first binding
    ],
)
def test_each_worker_gets_the_openmp_cores_of_its_index_on_its_machine(
    tp2_config, monkeypatch, bind, node_ips, rank, cores
):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    base = {"env_vars": {"KEPT": "1"}}
    env = cpu_ray.actor_runtime_env(base, tp2_config, node_ips, rank)
    assert env["env_vars"]["KEPT"] == "1" and base == {"env_vars": {"KEPT": "1"}}, "the base is not changed"
    assert env["env_vars"]["OMP_NUM_THREADS"] == str(len(cores.split(",")))
    assert env["env_vars"]["OMP_PLACES"] == "{" + cores + "}"


def test_a_binding_equal_to_the_drivers_own_environment_still_reaches_the_actor(tp2_config, monkeypatch):
    """A Ray actor's environment is the raylet's, not the driver's: a variable the binding sets
    to the value the driver happens to have (OMP_NUM_THREADS=1 for a one-core binding) must
    be in the actor's env_vars all the same, and the driver's environment is left as it was."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_PLACES", "{0}")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = cpu_ray.actor_runtime_env({}, tp2_config, ["10.0.0.1", "10.0.0.1"], 0)
    assert env["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert env["env_vars"]["OMP_PLACES"] == "{0}"
    assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["OMP_PLACES"] == "{0}"
