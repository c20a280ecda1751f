# SPDX-License-Identifier: Apache-2.0
"""The KV cache manager's block pool and block tables, as Hybrid HiSparse residency sees them.

Owns the adapter between the residency state machine (`residency.py`, which
speaks of block ids) and vLLM's `KVCacheManager`: hot leases are ordinary pool
blocks taken and given back; a demoted page leaves the request's block table
for the null block in every sparse-MLA group, and each such change is recorded
as a `BlockTableUpdate` for the step's plan.

It never decides what to demote or lease; it only carries out what residency
asks, through the block pool's and the single-type managers' own structures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.hisparse.plan import BlockTableUpdate

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager


class KVCacheBlockAccess:
    """The KV cache manager's block pool and block tables, as residency sees them."""

    def __init__(self, kv_cache_manager: KVCacheManager, mla_group_ids: Sequence[int]) -> None:
        self.block_pool = kv_cache_manager.block_pool
        self.managers = [kv_cache_manager.coordinator.single_type_managers[g] for g in mla_group_ids]
        self.mla_group_ids = tuple(mla_group_ids)
        self.updates: list[BlockTableUpdate] = []

    def _blocks(self, block_ids: Sequence[int]):
        return [self.block_pool.blocks[b] for b in block_ids]

    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def take(self, num_blocks: int) -> list[int]:
        return [b.block_id for b in self.block_pool.get_new_blocks(num_blocks)]

    def give_back(self, block_ids: Sequence[int]) -> None:
        self.block_pool.free_blocks(self._blocks(block_ids))

    def hold(self, block_ids: Sequence[int]) -> None:
        blocks = self._blocks(block_ids)
        assert all(b.ref_cnt > 0 for b in blocks), "only a referenced block can be held"
        self.block_pool.touch(blocks)

    def num_exclusive(self, block_ids: Sequence[int]) -> int:
        return sum(b.ref_cnt == 1 for b in self._blocks(block_ids))

    def drop_page(self, request_id: str, page_index: int, block_ids: Sequence[int]) -> int:
        null_block = self.block_pool.null_block
        dropped = []
        for manager, group_id, block_id in zip(self.managers, self.mla_group_ids, block_ids, strict=True):
            table = manager.req_to_blocks[request_id]
            block = table[page_index]
            assert block.block_id == block_id, (
                f"{request_id} page {page_index}: table holds block {block.block_id}, "
                f"residency {block_id}"
            )
            table[page_index] = null_block
            dropped.append(block)
            self.updates.append(BlockTableUpdate(request_id, group_id, page_index, null_block.block_id))
        free_before = self.block_pool.get_num_free_blocks()
        self.block_pool.free_blocks(dropped)
        return self.block_pool.get_num_free_blocks() - free_before


