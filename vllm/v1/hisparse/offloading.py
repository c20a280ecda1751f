# SPDX-License-Identifier: Apache-2.0
"""The OffloadingConnector's view of the KV cache with Hybrid HiSparse on.

Owns which KV cache groups the OffloadingConnector handles when
`hisparse_config` is set: every group but the sparse-MLA groups HiSparse
manages (`hisparse_managed_group_ids`), so the connector stores and loads the
indexer K cache (and an MTP drafter's layers) block by block while HiSparse
alone moves sparse-MLA pages to and from its host pool. The connector sees a
KV cache config of its groups only, and every per-group list of block ids that
crosses into it is narrowed to those groups.

A connector hit then covers only the connector's groups; the scheduler side
of HiSparse (`HiSparseScheduling.cap_external_hit`) limits it to pages whose
sparse-MLA content the host pool holds and serves those pages from there.
Where residency plans do not run (see `plans_executable`), the connector
keeps every group, as upstream.

The connector does not hold a finished request's blocks while it stores them:
it fences their reuse instead, flushing a pending store before the forward of
the step that allocates one of its blocks again (the step's `jobs_to_flush`).
It learns which blocks a step allocates from the block ids it is shown, and
KV cache groups share block ids (a block belongs to one group at a time), so
a block its store still reads could come back as another group's block, a
hot lease or staging, all written in the forward, unseen. `BlockPoolTakes`
records every block the block pool hands out, whoever takes it, and each
step's fence includes them (`connector_scheduler_output`).

It never touches tensors; of the connector's state it only adds to the
blocks its step fences.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.config.hisparse import hisparse_active
from vllm.v1.hisparse.kv_grouping import hisparse_managed_group_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

T = TypeVar("T")


def hisparse_connector_view(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[tuple[int, ...] | None, KVCacheConfig]:
    """(the connector's group ids, its KV cache config); (None, unchanged) with HiSparse off.

    Where the workers do not execute residency plans (see `plans_executable`), the
    sparse-MLA cache stays resident and the connector keeps handling every group.
    """
    if not hisparse_active(vllm_config):
        return None, kv_cache_config
    groups = kv_cache_config.kv_cache_groups
    managed = set(hisparse_managed_group_ids(groups))
    if not managed:
        return None, kv_cache_config
    group_ids = tuple(g for g in range(len(groups)) if g not in managed)
    # The tensors describe the one shared allocation and stay as they are.
    view = dataclasses.replace(kv_cache_config, kv_cache_groups=[groups[g] for g in group_ids])
    return group_ids, view


def select_groups(group_ids: tuple[int, ...] | None, per_group: Sequence[T]) -> tuple[T, ...]:
    """The entries of a per-group sequence that belong to the connector's groups."""
    if group_ids is None:
        return tuple(per_group)
    return tuple(per_group[g] for g in group_ids)


def connector_blocks(group_ids: tuple[int, ...] | None, blocks: KVCacheBlocks) -> KVCacheBlocks:
    if group_ids is None:
        return blocks
    return dataclasses.replace(blocks, blocks=select_groups(group_ids, blocks.blocks))


class BlockPoolTakes:
    """The blocks a block pool hands out from its free queue (`BlockPool.get_new_blocks`,
    through which every allocation goes: vLLM's in every KV cache group, copy-on-write,
    and HiSparse's hot leases and staging), since the last `drain`."""

    def __init__(self, pool: BlockPool) -> None:
        self._ids: set[int] = set()
        get_new_blocks = pool.get_new_blocks

        def recorded(num_blocks: int) -> list[KVCacheBlock]:
            blocks = get_new_blocks(num_blocks)
            self._ids.update(block.block_id for block in blocks)
            return blocks

        pool.get_new_blocks = recorded  # type: ignore[method-assign]

    def drain(self) -> set[int]:
        ids, self._ids = self._ids, set()
        return ids


def narrowed_connectors(connector: Any) -> list[Any]:
    """The OffloadingConnectors that HiSparse narrows, `connector` itself or inside a
    MultiConnector."""
    if connector is None:
        return []
    if getattr(connector, "hisparse_group_ids", None) is not None:
        return [connector]
    return [c for sub in getattr(connector, "_connectors", ()) for c in narrowed_connectors(sub)]


def fence_block_pool_takes(connector: Any, pool: BlockPool) -> None:
    """Have each OffloadingConnector that HiSparse narrows fence every block `pool` hands
    out, not only those of its own groups (see the module's docstring)."""
    for narrowed in narrowed_connectors(connector):
        scheduler = getattr(narrowed, "connector_scheduler", None)
        # vLLM 0.29's OffloadingConnectorScheduler: the blocks its next step fences.
        if scheduler is not None:
            assert isinstance(getattr(scheduler, "_current_batch_allocated_block_ids", None), set)
            narrowed.hisparse_block_takes = BlockPoolTakes(pool)


def connector_scheduler_output(connector: Any, scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """A shallow copy whose new block ids cover only the connector's groups; every block the
    block pool handed out since its last step is added to the blocks its step fences."""
    group_ids = connector.hisparse_group_ids
    if group_ids is None:
        return scheduler_output
    takes = getattr(connector, "hisparse_block_takes", None)
    if takes is not None:
        connector.connector_scheduler._current_batch_allocated_block_ids.update(takes.drain())
    narrowed = copy.copy(scheduler_output)
    new_reqs = []
    for req in scheduler_output.scheduled_new_reqs:
        req = copy.copy(req)
        req.block_ids = select_groups(group_ids, req.block_ids)
        new_reqs.append(req)
    narrowed.scheduled_new_reqs = new_reqs
    cached = copy.copy(scheduler_output.scheduled_cached_reqs)
    cached.new_block_ids = [
        None if ids is None else select_groups(group_ids, ids) for ids in cached.new_block_ids
    ]
    narrowed.scheduled_cached_reqs = cached
    return narrowed
