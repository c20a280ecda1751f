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
does); every other request keeps its place for the next step.

Holders can also strand one another: upstream admits an asynchronous load when
its own blocks fit beside the other loads' reservations, but neither the
blocks its own remaining prefill needs nor a drafter's lookahead slots are
reserved. Two landed loads can then each hold their history while neither's
next chunk fits in what is left. When a step schedules nothing, nothing runs,
and nothing in flight (a step's deferred frees, a load, a copy to the host)
can free a block, the youngest such holder gives its blocks back as a
preemption would: its blocks are freed (the prefix cache keeps their hashes),
its computed tokens go back to zero, and it keeps its place in the queue. The
next step schedules the others.

The scheduler calls these functions (patch 0007); this module decides nothing
else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

logger = init_logger(__name__)


def can_go_on_holding_blocks(scheduler: Scheduler, request: Request) -> bool:
    """Whether `request` waits holding device blocks and can be scheduled now: its load
    landed, or it was promoted after one (a load in flight cannot go on)."""
    if (
        request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        and request.request_id not in scheduler.finished_recving_kv_req_ids
    ):
        return False
    return _holds_blocks(scheduler, request)


def holder_waits_behind(scheduler: Scheduler, request: Request) -> bool:
    """Whether another waiting request that holds blocks can go on, past `request`."""
    return any(
        other is not request and can_go_on_holding_blocks(scheduler, other)
        for queue in (scheduler.skipped_waiting, scheduler.waiting)
        for other in queue
    )


def _holds_blocks(scheduler: Scheduler, request: Request) -> bool:
    """Whether `request` holds device blocks in any KV cache group."""
    request_id = request.request_id
    return any(
        manager.req_to_blocks.get(request_id)
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers
    )


def _frees_pending(scheduler: Scheduler) -> bool:
    """Whether something already in flight will free blocks or land a load."""
    if scheduler.deferred_frees:
        return True
    if scheduler.hisparse is not None and scheduler.hisparse.has_copies_in_flight():
        return True
    return any(
        request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        for queue in (scheduler.skipped_waiting, scheduler.waiting)
        for request in queue
    )


def release_stranded_holder(scheduler: Scheduler, timestamp: float) -> Request | None:
    """After a step that scheduled nothing with nothing running: when no block can come
    back by itself, free the blocks of the youngest waiting request that holds some, as
    a preemption would, and return it (None when there is none, or something in flight
    frees blocks anyway)."""
    if scheduler.running or _frees_pending(scheduler):
        return None
    holders = [
        request
        for queue in (scheduler.skipped_waiting, scheduler.waiting)
        for request in queue
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        and _holds_blocks(scheduler, request)
    ]
    if not holders:
        return None
    request = max(holders, key=lambda r: (r.priority, r.arrival_time))
    scheduler._free_request_blocks(request)
    scheduler._inflight_prefills.discard(request)
    if request.num_computed_tokens:
        logger.info(
            "Released the %d computed tokens' blocks of waiting request %s: no waiting "
            "request could be allocated and nothing runs",
            request.num_computed_tokens,
            request.request_id,
        )
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    if scheduler.log_stats:
        request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
    scheduler.num_holders_released += 1
    return request
