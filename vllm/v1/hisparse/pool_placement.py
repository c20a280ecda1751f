# SPDX-License-Identifier: Apache-2.0
"""Where the Hybrid HiSparse host pool lives when a model runs on several ranks.

Owns one decision, made once at start-up by every rank of a tensor-parallel
group together: which ranks share a node (the same running kernel and the same
/dev/shm and RAM), and so map one host pool; which rank of each node creates the
pool and writes every page into it; how many pools the group has.

Under MLA every tensor-parallel rank holds the same latent cache, so one copy of
a page on a node serves all its ranks: the node's first rank copies the page
device -> host, every rank reads rows from it into its own hot buffer. Ranks on
other nodes have pools of their own, written by their own first rank.

Why a reader never sees a row before it is written: the scheduler turns a page
HOST only after the group's first rank (the rank whose output it reads, and the
writer of its node) reported the copy durable, and on every other node the
writer copied the page in the same step. On CPU a copy has returned before its
step does. On CUDA the copies run on a copy stream, and with several pools the
report waits two steps while every writer's compute stream waits, two steps after
a copy, for that copy (`worker.COPY_FENCE_STEPS`): a reader resolves a HOST row
inside a later forward, after that forward's first collective (the vocabulary-
parallel embedding's all-reduce), which its node's writer joins only after the
wait.

It never allocates memory (`host_memory.py` does) and never talks to the
scheduler; it only asks the group's ranks where they run.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.v1.hisparse.host_memory import SHARED_POOL_DIR, PoolShare, shared_pool_path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class PoolPlacement:
    """This rank's part in the group's host pools."""

    share: PoolShare
    writer: bool  # copies pages device -> host for its node
    num_pools: int  # host pools of the group: one per node it spans
    node_ranks: tuple[int, ...]  # the group ranks on this rank's node

    @classmethod
    def alone(cls) -> PoolPlacement:
        """A rank with a pool of its own, which it writes."""
        return cls(PoolShare.alone(), writer=True, num_pools=1, node_ranks=(0,))


def node_id() -> str:
    """The running kernel and its /dev/shm: ranks that share both share the pool's memory
    (containers on one kernel with a /dev/shm each are separate nodes here)."""
    try:
        kernel = BOOT_ID.read_text().strip()
    except OSError:
        kernel = socket.gethostname()
    try:
        shm = os.stat(SHARED_POOL_DIR).st_dev
    except OSError:
        return kernel
    return f"{kernel}:{shm}"


def place_ranks(node_of_rank: list[str], rank: int) -> tuple[tuple[int, ...], int, int]:
    """(ranks on `rank`'s node, that node's index in order of first rank, number of nodes)."""
    nodes = list(dict.fromkeys(node_of_rank))
    mine = node_of_rank[rank]
    return tuple(r for r, node in enumerate(node_of_rank) if node == mine), nodes.index(mine), len(nodes)


def pool_placement(vllm_config: Any) -> PoolPlacement:
    """This rank's placement in its tensor-parallel group (a collective: every rank calls it)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1:
        return PoolPlacement.alone()
    import torch.distributed as dist

    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    # Each rank's node, and the key it would name its engine's pools by: ranks whose configs
    # were built apart (torchrun's external launcher) carry different instance ids.
    placed: list[Any] = [None] * group.world_size
    dist.all_gather_object(placed, (node_id(), _engine_key(vllm_config)), group=group.cpu_group)
    node_ranks, node_index, num_pools = place_ranks([node for node, _ in placed], group.rank_in_group)

    def agree(ok: bool) -> bool:
        votes: list[Any] = [None] * group.world_size
        dist.all_gather_object(votes, bool(ok), group=group.cpu_group)
        return all(votes)

    writer = group.rank_in_group == node_ranks[0]
    if len(node_ranks) == 1:
        share = PoolShare(None, True, agree)
    else:
        engine_key = placed[node_ranks[0]][1]  # the node's writer's, for every rank of it
        path = shared_pool_path(engine_key, parallel.data_parallel_rank, node_index)
        share = PoolShare(path, writer, agree)
    return PoolPlacement(share, writer, num_pools, node_ranks)


def _engine_key(vllm_config: Any) -> str:
    """What names this engine's pools: its instance id (a node's ranks use its writer's)."""
    key = vllm_config.instance_id or "engine"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in key)
