# SPDX-License-Identifier: Apache-2.0
"""Ray workers for vLLM's CPU platform (`--distributed-executor-backend ray`).

Owns what the Ray executor needs on CPU that upstream 0.29.0 only has for
accelerators:
- resources: a worker's placement group bundle reserves one Ray `CPU` (the
  platform's `ray_device_key`); the actor itself asks for nothing more, since
  Ray refuses `CPU` among an actor's custom resources and the bundle already
  holds the core;
- device ids: a CPU worker has none to discover;
- OpenMP threads: the mp executor gives each worker process its own
  `VLLM_CPU_OMP_THREADS_BIND` cores through environment variables set before
  the process starts (OpenMP reads them once). A Ray actor's process is started
  by Ray, so the same variables go into that actor's runtime_env, chosen by the
  worker's index among the ranks on its machine (its IP: several Ray nodes on
  one machine share its cores). Without them each worker runs as many OpenMP
  threads as the machine has cores, and two workers spinning at each other's
  all-reduces run several times slower.

Off the CPU platform every function returns None, and the caller keeps
upstream's own path. It never starts, joins or stops a Ray cluster.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from vllm.platforms import current_platform


def actor_resource_kwargs() -> dict[str, Any] | None:
    """The Ray actor options for a CPU worker's resources (None: not the CPU platform)."""
    if not current_platform.is_cpu():
        return None
    return {"num_gpus": 0}


def device_ids() -> list[int] | None:
    """A CPU worker's physical device ids: none (None: not the CPU platform)."""
    if not current_platform.is_cpu():
        return None
    return []


# What vLLM's OpenMP binding sets (vllm/utils/ompmultiprocessing.py), for the runtimes it knows.
OMP_BINDING_VARIABLES = (
    "OMP_NUM_THREADS",
    "OMP_PLACES",
    "OMP_PROC_BIND",
    "GOMP_CPU_AFFINITY",
    "KMP_AFFINITY",
    "KMP_BLOCKTIME",
    "KMP_TPAUSE",
)


def actor_runtime_env(runtime_env: dict, vllm_config: Any, node_ips: list[str], rank: int) -> dict | None:
    """`runtime_env` plus the OpenMP binding of worker `rank`, whose Ray nodes, by rank, run
    on the machines `node_ips` (None: not the CPU platform)."""
    if not current_platform.is_cpu():
        return None
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    mine = node_ips[rank]
    local_rank = node_ips[:rank].count(mine)
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    # The binding list has one entry per rank of a machine, however Ray splits it into nodes.
    config.parallel_config.nnodes = len(set(node_ips))
    manager = OMPProcessManager(config)
    # Taken out while the binding is made, so one it sets to the value this process already
    # has (OMP_NUM_THREADS=1 in the driver's shell) still reaches the actor, whose
    # environment is the raylet's, not this process's.
    saved = {name: os.environ.pop(name) for name in OMP_BINDING_VARIABLES if name in os.environ}
    try:
        before = dict(os.environ)
        with manager.configure_omp_envs(rank, local_rank):
            binding = {k: v for k, v in os.environ.items() if before.get(k) != v}
    finally:
        os.environ.update(saved)
    env = copy.deepcopy(runtime_env)
    env.setdefault("env_vars", {}).update(binding)
    return env
