# SPDX-License-Identifier: Apache-2.0
"""Finished sessions' histories, held on the device under pressure.

Owns one holder of device blocks: the blocks of a finished request's pages
outside the sparse-MLA groups (the indexer K cache, an MTP drafter's layers)
whose sparse-MLA content the host pool holds (its leading HOST and BOTH
pages). Those blocks exist nowhere else without a connector, or only in a
connector's tier that the histories may outgrow; the host pool can give back
the sparse-MLA pages, but not them. A session's next turn that finds them on
the device starts from the host pool; one that does not, recomputes its whole
history.

vLLM's free queue evicts cached blocks oldest first whenever a block is
allocated, ahead of any demotion: a waiting session's history goes before a
running request's resident page, which the host pool could take at the cost of
a copy. Holding a history (one reference per block, taken before upstream frees
the request's table) keeps it off the free queue, so allocation first demotes;
the histories go, oldest first, only when demotion cannot free what a running
request needs, or what any request needs while none runs (`release`; a new
turn's admission waits for room instead), and all of them once no request is
left (`release_all`).

Each held block has exactly one holder here: the newest history that reached
it (a session's next turn shares its prefix and takes the hold over). The
ownership check counts these references (`held_references`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess


class HeldHistories:
    """Finished requests' non-sparse-MLA blocks of host-backed pages, one reference each."""

    def __init__(self, blocks: KVCacheBlockAccess) -> None:
        self._blocks = blocks
        # Request -> its held blocks (an ordered set); requests oldest first.
        self._by_request: dict[str, dict[int, None]] = {}
        self._holder: dict[int, str] = {}
        # Blocks held so far, and blocks given back while requests still needed room.
        self.blocks_held = 0
        self.blocks_released_under_pressure = 0

    def hold(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Hold these blocks (referenced by the request's table now) for `request_id`; a
        block an older history holds passes to this one."""
        mine: dict[int, None] = {}
        new = []
        for block_id in block_ids:
            if block_id in mine:
                continue
            older = self._holder.get(block_id)
            if older is None:
                new.append(block_id)
            else:
                del self._by_request[older][block_id]
                if not self._by_request[older]:
                    del self._by_request[older]
            self._holder[block_id] = request_id
            mine[block_id] = None
        if not mine:
            return
        self._blocks.hold(new)
        self.blocks_held += len(new)
        self._by_request.pop(request_id, None)
        self._by_request[request_id] = mine

    def release(self, num_blocks: int) -> int:
        """Give back the oldest histories until `num_blocks` blocks have become free (or
        none is left); how many became free."""
        freed = 0
        while freed < num_blocks and self._by_request:
            request_id = next(iter(self._by_request))
            freed += self._give_back(request_id)
        self.blocks_released_under_pressure += freed
        return freed

    def release_all(self) -> int:
        freed = 0
        for request_id in list(self._by_request):
            freed += self._give_back(request_id)
        return freed

    def _give_back(self, request_id: str) -> int:
        block_ids = list(self._by_request.pop(request_id))
        for block_id in block_ids:
            del self._holder[block_id]
        return self._blocks.give_back(block_ids)

    def __len__(self) -> int:
        return len(self._holder)

    def held_references(self) -> Counter[int]:
        """Block -> references held here (one each)."""
        return Counter(self._holder.keys())
