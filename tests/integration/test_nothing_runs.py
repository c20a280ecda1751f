# SPDX-License-Identifier: Apache-2.0
"""With nothing running, a waiting request can always go on: nothing else will free a block.

Waiting requests that hold blocks never strand one another (patch 0007,
waiting_holders.py). A connector's asynchronous load leaves its request waiting with
device blocks for the tokens it loaded; only the request's own compute frees them.
Upstream admits such a load beside the other loads' reservations, but not the blocks its
own remaining prefill (or a drafter's lookahead) needs, so two landed loads can each hold
their history while neither's next chunk fits, with nothing running to free a block. The
scheduler then gives the youngest holder's blocks back, as a preemption would, and the
other goes on. Here the state a landed, promoted load leaves is made directly through the
KV cache manager (the same calls the scheduler makes for an async load and its landing),
on the real scheduler of the scheduler harness, so that the case is exact and small.

A request alone takes no more of its history from the device than leaves its first chunk
room (admission.py, `room_when_alone`). With HiSparse a request may be longer than the
pool holds; its history cached on the device, upstream's prefix hit included, could take
the free blocks its own chunk needs.
"""

from __future__ import annotations

import random

import pytest
import scheduler_harness as sh

BLOCK = 64
PROMPT_TOKENS = 11 * BLOCK
LOADED_TOKENS = 8 * BLOCK
# 8 blocks loaded for each of two requests leave 2 free; each needs 3 more to go on.
NUM_BLOCKS = 1 + 2 * 8 + 2


def land(h: sh.SchedulerHarness, request, num_tokens: int) -> None:
    """What a landed and promoted asynchronous load leaves: the request waits, holding
    blocks for its first `num_tokens` tokens, which count as computed and are cached."""
    blocks = h.kv_cache_manager.allocate_slots(
        request, 0, num_external_computed_tokens=num_tokens, delay_cache_blocks=True
    )
    assert blocks is not None
    request.num_computed_tokens = num_tokens
    h.kv_cache_manager.cache_blocks(request, num_tokens)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("config", ["plain", "hisparse"])
def test_two_landed_loads_that_strand_each_other_both_finish(config, async_scheduling):
    groups = 1 if config == "plain" else sh.TINY_GLM5.num_hidden_layers + 1
    h = sh.SchedulerHarness.create(
        num_blocks=1 + (NUM_BLOCKS - 1) * groups,
        attention_config=sh.HISPARSE if config == "hisparse" else None,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=1024,
    )
    rng = random.Random(7)
    older, younger = (
        h.add_request([rng.randrange(3, 3000) for _ in range(PROMPT_TOKENS)], max_tokens=4) for _ in range(2)
    )
    land(h, older, LOADED_TOKENS)
    land(h, younger, LOADED_TOKENS)
    free = h.num_free_blocks()
    assert free == 2 * groups, "each request's next chunk needs 3 blocks per group"

    observations = h.run_until_done(max_steps=200)

    assert older.is_finished() and younger.is_finished()
    assert h.scheduler.num_holders_released == 1
    # The younger one gave its blocks back, once; the older one went on from its load.
    assert (older.num_preemptions, younger.num_preemptions) == (0, 1)
    first = next(obs for obs in observations if obs.num_scheduled_tokens)
    assert first.num_scheduled_tokens == {older.request_id: PROMPT_TOKENS - LOADED_TOKENS}
    # The released blocks kept their hashes: the younger one's history is a prefix hit
    # (less the blocks the older one's chunk and decode took from the free queue).
    cached = [obs.new_request_cached_tokens[younger.request_id] for obs in observations
              if younger.request_id in obs.new_request_cached_tokens]  # fmt: skip
    assert len(cached) == 1 and 0 < cached[0] <= LOADED_TOKENS, cached
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1, "every block returns"


def test_nothing_is_released_while_a_load_is_still_in_flight():
    """A load in flight lands by itself; the scan waits for it rather than release."""
    from vllm.v1.request import RequestStatus

    h = sh.SchedulerHarness.create(num_blocks=NUM_BLOCKS, max_num_batched_tokens=1024)
    rng = random.Random(8)
    older, younger = (
        h.add_request([rng.randrange(3, 3000) for _ in range(PROMPT_TOKENS)], max_tokens=4) for _ in range(2)
    )
    land(h, older, LOADED_TOKENS)
    land(h, younger, LOADED_TOKENS)
    younger.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # its load has not landed

    for _ in range(3):
        assert not h.step().num_scheduled_tokens
    assert h.scheduler.num_holders_released == 0
    assert older.num_computed_tokens == younger.num_computed_tokens == LOADED_TOKENS


def test_a_request_alone_whose_cached_history_leaves_its_chunk_no_room_goes_on():
    """A finished turn's 10 pages stay cached on a 13-page device; the next turn (16 pages,
    more than the device holds) arrives with nothing running. Its hit leaves its first
    256-token chunk room, and the turn runs to the end, its older pages going to the host."""
    h = sh.SchedulerHarness.create(
        num_blocks=1 + 3 * 13, attention_config=sh.HISPARSE, max_num_batched_tokens=256
    )
    assert h.num_groups == 3
    rng = random.Random(3)
    first = h.add_request([rng.randrange(3, 3000) for _ in range(10 * BLOCK)], max_tokens=1)
    h.run_until_done(max_steps=50)
    history = [*first.prompt_token_ids, *first.output_token_ids]
    second = h.add_request(history + [rng.randrange(3, 3000) for _ in range(370)], max_tokens=4)
    assert second.num_tokens > 13 * BLOCK, "longer than the device holds"

    observations = h.run_until_done(max_steps=100)

    assert second.is_finished() and second.num_output_tokens == 4
    (cached,) = [obs.new_request_cached_tokens[second.request_id] for obs in observations
                 if second.request_id in obs.new_request_cached_tokens]  # fmt: skip
    # Part of the history, not all: the first chunk's 5 pages and the lease fit beside it.
    assert 0 < cached < 10 * BLOCK
    assert observations[0].num_scheduled_tokens == {second.request_id: 256}
    assert h.hisparse.stats()["pages_demoted"] > 0
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1, "every block returns"
