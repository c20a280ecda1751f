# SPDX-License-Identifier: Apache-2.0
"""Waiting requests that hold KV blocks are not stranded behind one that cannot be allocated.

vLLM 0.29's scan of the waiting queues stops at the first request it cannot
allocate. Some waiting requests hold device blocks: an asynchronous KV
connector load holds the blocks it loads into while it is in flight, and once
it has landed (its id among the scheduler's finished receives) only the scan
reaching it promotes it; a promoted one still holds them until it is
scheduled. Such a request frees its blocks only by computing. When it waits
behind a request that cannot be allocated (often for want of the very blocks
it holds, or of the reservation upstream keeps for its load) and nothing runs
to free blocks, the scheduler schedules nothing, for ever: under KV cache
pressure with the OffloadingConnector, which Hybrid HiSparse's deployment runs
beside it, the engine stalls with every request waiting.

So when the scan meets a request it cannot allocate while a request that can
go on holds blocks behind it, it passes over that request and goes on with the
block holders alone (a load still in flight is passed over too, as upstream
does); every other request keeps its place for the next step. The scheduler
calls these two predicates (patch 0007); this module decides nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request


def can_go_on_holding_blocks(scheduler: Scheduler, request: Request) -> bool:
    """Whether `request` waits holding device blocks and can be scheduled now: its load
    landed, or it was promoted after one (a load in flight cannot go on)."""
    if (
        request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        and request.request_id not in scheduler.finished_recving_kv_req_ids
    ):
        return False
    request_id = request.request_id
    return any(
        manager.req_to_blocks.get(request_id)
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers
    )


def holder_waits_behind(scheduler: Scheduler, request: Request) -> bool:
    """Whether another waiting request that holds blocks can go on, past `request`."""
    return any(
        other is not request and can_go_on_holding_blocks(scheduler, other)
        for queue in (scheduler.skipped_waiting, scheduler.waiting)
        for other in queue
    )
