# SPDX-License-Identifier: Apache-2.0
"""Every device block, host page and copy has exactly one owner, in vLLM's real Scheduler.

Multi-turn sessions under KV pressure, the traffic Hybrid HiSparse exists for, through
the scheduler harness (six-layer tiny GLM-5: six sparse-MLA groups and one indexer
group, a page is seven blocks). The harness runs HiSparse's ownership check after every
step (`vllm/v1/hisparse/ownership.py`); the tests here add what each scenario must show:
- a waiting request's device prefix hit never becomes another request's hot lease or
  staging while relief makes room for it;
- a host page a pending admission will read is retained from its lookup, so an import
  landing in the same step cannot take it over;
- a copy reported late, after its request was preempted and resumed, reaches its own
  copy: nothing leaks and nothing is credited to the wrong copy;
- frees follow upstream's fence when a KV consumer runs with a batch in flight;
- a finished request whose blocks a connector still sends keeps them, in mode "always"
  too, while the rest of its pages are copied;
- a step's restores write only into their own request's pages, also when the same step's
  relief looks for blocks to free;
- a block an OffloadingConnector store still reads is fenced (the store flushed before
  the forward) when the block comes back as another group's block, a hot lease or staging;
- the ownership check itself fails on each kind of double ownership (negative controls).
"""

from __future__ import annotations

import os
import random
import uuid

import pytest
import tiny_models
from scheduler_harness import (
    HISPARSE,
    SchedulerHarness,
    record_host_lookups,
    record_lease_attempts,
    tiny_glm5_dir,
)

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.grouped_example_connector import COMPLETE_MARKER
from vllm.v1.hisparse.ownership import OwnershipError
from vllm.v1.request import RequestStatus

BLOCK = 64
MLA_GROUPS = 6
SIX_LAYERS = tiny_models.TinyModelSpec(arch="glm5", index_topk=32, num_hidden_layers=6)
PAGE_GIB = MLA_GROUPS * BLOCK * 576 * 2 / (1 << 30)  # bf16 latent rows of six layers


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_glm5_dir(SIX_LAYERS))


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 10 for i in range(length)]


def held_blocks(h: SchedulerHarness) -> dict[int, str]:
    """Block -> the lease or staging set that holds it, across every holder HiSparse has."""
    hisparse = h.hisparse
    held = {b: f"lease of {rid}" for rid, req in hisparse.residency.requests.items() for b in req.hot_blocks}
    for record in hisparse.admissions.records():
        held.update((b, f"pending lease of {record.request_id}") for b in record.lease)
    held.update((b, "staging") for b in hisparse.staging_blocks())
    return held


# ------------------------------------------------------------------ finding 1: device hits


@pytest.mark.parametrize("num_blocks", [110, 111, 113, 114, 116, 118])
def test_a_second_turns_device_prefix_hit_never_becomes_a_victims_hot_lease(model, num_blocks):
    """R's first turn finishes; V decodes; R's second turn arrives with a 320-token device
    prefix hit whose blocks sit unreferenced in the free queue, and allocating for it needs
    relief, whose first demotion of V takes V a hot lease from the same free queue."""
    h = SchedulerHarness.create(
        model=model, num_blocks=num_blocks, attention_config=HISPARSE, max_model_len=1024,
        max_num_batched_tokens=128,
    )  # fmt: skip
    first_turn = prompt(1, 320)
    h.add_request(first_turn, max_tokens=1, request_id="R1")
    h.run_until_done()
    h.add_request(prompt(2, 640), max_tokens=200, request_id="V")
    for _ in range(8):
        h.step()
    h.add_request([*first_turn, 100, *prompt(3, 63)], max_tokens=20, request_id="R2")
    hit_blocks: set[int] = set()
    while h.busy():
        observation = h.step()
        if "R2" in observation.new_request_cached_tokens:
            assert observation.new_request_cached_tokens["R2"] == 320, "R2 took its device prefix hit"
            hit_blocks = {b for group in h.block_ids("R2") for b in group[:5]}
        if hit_blocks and "R2" in h.scheduler.requests:
            shared = {b: held for b, held in held_blocks(h).items() if b in hit_blocks}
            assert not shared, f"R2's prefix blocks are also {shared}"
    assert hit_blocks, "R2 was admitted"
    stats = h.hisparse.stats()
    assert stats["pages_demoted"] > 0 and stats["hot_leases"] > 0, "relief demoted V for R2"
    assert all(req.num_output_tokens == req.max_tokens for req in h.requests.values())


# -------------------------------------------------------------------- finding 2: host hits


def example_consumer(model: str, storage, memory_mib: int, host_pages: float, **kwargs) -> SchedulerHarness:
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )  # fmt: skip
    return SchedulerHarness.create(
        model=model, memory_bytes=memory_mib << 20,
        attention_config={"hisparse_config": {"host_pool_gib": host_pages * PAGE_GIB}},
        max_model_len=1024, max_num_batched_tokens=1024, kv_transfer_config=transfer, **kwargs,
    )  # fmt: skip


def store(h: SchedulerHarness, tokens: list[int]) -> None:
    """Mark `tokens`' stored prefix complete in the connector's storage, as a producer would."""
    folder = h.scheduler.connector.prompt_folder(tokens, [])
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, COMPLETE_MARKER), "w").close()


def test_a_pending_host_hit_is_not_taken_by_an_import_landing_in_the_same_step(model, tmp_path):
    """A decode instance (the deploy guide's shared-storage P/D recipe) under pressure: A's
    first turn lands in the host pool; A's second turn finds those pages there (its
    indexer blocks are still cached on the device), and in the same schedule() B's
    import lands in the host pool, whose only allocatable pages are A's cached ones."""
    h = example_consumer(model, tmp_path, memory_mib=8, host_pages=20.5)
    pool = h.hisparse.residency.host_pool
    assert pool.num_pages == 20
    h.add_request(prompt(0, 500), max_tokens=400, request_id="local")
    while h.requests["local"].num_output_tokens < 2:
        h.step()
    first_turn = prompt(1, 400)
    store(h, first_turn)
    h.add_request(first_turn, max_tokens=2, request_id="A1")
    while not h.requests["A1"].is_finished():
        h.step()
    assert h.hisparse.stats()["pages_imported_to_host"] == 6
    # Whatever the pool never handed out is taken and cached under other hashes, newer
    # than A's pages: an allocation now evicts A's cached pages first.
    others = [pool.allocate() for _ in range(pool.num_available - 6)]
    for i, page in enumerate(others):
        pool.publish(page, ("another session", i))
        pool.release(page)
    store(h, prompt(2, 400))
    h.add_request([*first_turn, 100, 100, *prompt(3, 60)], max_tokens=4, request_id="A2")
    h.add_request(prompt(2, 400), max_tokens=4, request_id="B")
    output = h.schedule()
    assert {"A2", "B"} <= set(output.num_scheduled_tokens), "both admitted in one schedule()"
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    h.hisparse.check_ownership()
    requests = h.hisparse.residency.requests
    a2 = {p.host_page for p in requests["A2"].pages if p.block_ids is None}
    b = {p.host_page for p in requests["B"].pages if p.block_ids is None}
    assert len(a2) == 6 and len(b) == 6, "A2 reuses its first turn from the host, B lands there"
    assert not a2 & b, f"host pages {sorted(a2 & b)} hold A2's prefix and B's import at once"
    h.run_until_done()
    assert pool.num_referenced == 0


# ----------------------------------------------------------------- finding 3: late reports


@pytest.mark.parametrize("seed", range(4))
def test_copies_reported_late_across_preemption_and_resumption_each_reach_their_own_copy(model, seed):
    """Copy reports arrive two steps late (on CUDA a step or more by design). A request
    preempted with copies in flight resumes under the same id and plans the same pages
    again; each late report must reach the copy it belongs to."""
    rng = random.Random(seed)
    h = SchedulerHarness.create(
        model=model, memory_bytes=int(3.5 * (1 << 20)), attention_config=HISPARSE, max_model_len=1024,
        max_num_batched_tokens=128, report_delay=2,
    )  # fmt: skip
    for i in range(5):
        h.add_request(prompt(seed * 10 + i, rng.randint(300, 450)), max_tokens=rng.randint(100, 160))
    h.run_until_done(max_steps=5000)
    assert h.total_preemptions > 0, "requests were preempted and resumed"
    assert all(req.num_output_tokens == req.max_tokens for req in h.requests.values())
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1, "every device block returns"
    residency = h.hisparse.residency
    assert residency.num_copies_in_flight() == 0 and not residency.held_blocks()
    assert residency.host_pool.num_referenced == 0, "every host page returns"


def test_a_report_for_a_copy_not_in_flight_stops_the_engine(model):
    h = SchedulerHarness.create(model=model, memory_bytes=20 << 20, attention_config=HISPARSE)
    h.add_request(prompt(0, 300), max_tokens=4)
    output = h.schedule()
    (copy, *_) = output.hisparse_plan.copies
    runner_output = h.model_runner_output(output)
    runner_output.hisparse_copied = [copy.copy_id, copy.copy_id]
    with pytest.raises(RuntimeError, match=f"reported copy {copy.copy_id}, which is not in flight"):
        h.scheduler.update_from_output(output, runner_output)


# -------------------------------------------------------------------- finding 4: the fence


def test_blocks_freed_while_a_step_is_in_flight_wait_for_upstreams_fence(model, tmp_path):
    """A KV consumer with asynchronous scheduling: upstream defers frees while a batch is in
    flight, since a connector's load into a reallocated block is not ordered against that
    step. HiSparse's demotions and returns follow the same fence."""
    from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess

    rng = random.Random(5)
    h = example_consumer(
        model, tmp_path, memory_mib=8, host_pages=2000, async_scheduling=True,
        report_delay=lambda: rng.randint(0, 3),
    )  # fmt: skip
    scheduler = h.scheduler
    assert scheduler.defer_block_free and h.batch_queue_size == 2
    fenced: list[tuple[int, list[int]]] = []
    free = KVCacheBlockAccess._free

    def recorded_free(self, blocks):
        deferred = self.frees_are_deferred()
        last = free(self, blocks)
        if deferred:
            fenced.append((scheduler.sched_step_seq, [b.block_id for b in blocks if b.ref_cnt == 1]))
        return last

    KVCacheBlockAccess._free = recorded_free
    try:
        prompts = [prompt(10 + i, 300 + 40 * i) for i in range(5)]
        for tokens in prompts[::2]:
            store(h, tokens)
        for _turn in range(2):
            for tokens in prompts:
                h.add_request(tokens, max_tokens=20)
            while h.busy():
                h.step()
                for fence, blocks in fenced:
                    if scheduler.processed_step_seq < fence:
                        free_queue = set(h.hisparse.blocks.free_queue_ids())
                        assert not free_queue & set(blocks), "a fenced block is free before its step ended"
            prompts = [tokens + [100] * 20 + prompt(90 + i, 50) for i, tokens in enumerate(prompts)]
    finally:
        KVCacheBlockAccess._free = free
    assert fenced, "HiSparse freed blocks while a step was in flight"
    assert h.hisparse.stats()["pages_demoted"] > 0
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1


# ------------------------------------------------------------ a producer's blocks in flight


def test_a_finished_request_whose_blocks_a_connector_sends_keeps_them_in_mode_always(model):
    """A P/D producer's request finishes with pages not yet copied (here one copy a step
    against a ten-page prompt); its connector keeps the blocks to send them, so the
    scheduler holds the request. Mode "always" goes on copying its pages after that: they
    become BOTH, and no page leaves the block table or frees its blocks until the
    connector is done. The harness has no remote peer, so the connector's answer for a
    producer's request (free the blocks later) is given at that seam."""
    h = SchedulerHarness.create(
        model=model, memory_bytes=64 << 20, max_model_len=1024,
        attention_config={"hisparse_config": {"host_pool_gib": 1, "mode": "always"}},
    )  # fmt: skip
    h.hisparse.residency.max_copies_per_step = 1
    scheduler = h.scheduler
    sending: set[str] = set()
    connector_finished = scheduler._connector_finished
    scheduler._connector_finished = lambda request: (
        (True, None) if request.request_id in sending else connector_finished(request)
    )
    request = h.add_request(prompt(3, 10 * BLOCK + 5), max_tokens=1)
    sending.add(request.request_id)
    while not request.is_finished():
        h.step()
    residency = h.hisparse.residency
    held = residency.requests[request.request_id]
    assert held.held and held.uncopied, "it finished with pages not yet copied"
    tables = h.block_ids(request.request_id)
    referenced = {b for table in tables for b in table if b != h.hisparse.null_block_id}
    copied_before = residency.counters.pages_copied_to_host
    for _ in range(2 * len(held.pages)):
        h.step()
    assert residency.counters.pages_copied_to_host > copied_before, "its pages were copied meanwhile"
    assert h.block_ids(request.request_id) == tables, "its block table is as the connector took it"
    freed = sorted(b for b in referenced if h.block_pool.blocks[b].ref_cnt == 0)
    assert not freed, f"blocks {freed} the connector is sending went back to the pool"
    scheduler._free_blocks(request)  # the connector is done
    h.run_until_done()
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1
    assert residency.host_pool.num_referenced == 0


# ---------------------------------------------------------- a fault fails its request alone


def test_a_request_whose_pages_cannot_be_registered_fails_alone(model, monkeypatch):
    """An injected bookkeeping fault in one request's registration: that request ends with
    an error and returns everything it held; the others finish, and ownership holds."""
    from vllm.v1.hisparse.residency import ResidencyManager

    append_pages = ResidencyManager.append_pages

    def broken_for_req_3(self, request_id, pages):
        if request_id == "req-3" and self.requests[request_id].pages:
            raise ValueError("injected")
        return append_pages(self, request_id, pages)

    monkeypatch.setattr(ResidencyManager, "append_pages", broken_for_req_3)
    h = SchedulerHarness.create(model=model, memory_bytes=20 << 20, attention_config=HISPARSE, report_delay=1)
    for i in range(8):
        h.add_request(prompt(i, 512), max_tokens=64)
    h.run_until_done()
    assert h.requests["req-3"].status is RequestStatus.FINISHED_ERROR
    assert h.requests["req-3"].num_output_tokens < 64
    others = [r for rid, r in h.requests.items() if rid != "req-3"]
    assert all(r.num_output_tokens == 64 and r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in others)
    assert h.hisparse.stats()["requests_failed"] == 1 and h.hisparse.stats()["pages_demoted"] > 0
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1
    assert h.hisparse.residency.host_pool.num_referenced == 0


def a_finished_turn_whose_latent_pages_only_the_host_pool_holds(
    h: SchedulerHarness, tokens: list[int], request_id: str
) -> list[int]:
    """A turn run to the end, then its sparse-MLA blocks evicted from the device prefix
    cache (its indexer blocks stay cached; the host pool holds its pages). Its tokens."""
    h.add_request(tokens, max_tokens=2, request_id=request_id)
    h.step()
    mla_blocks = {b for g in h.hisparse.mla_group_ids for b in h.block_ids(request_id)[g]}
    h.run_until_done()
    h.kv_cache_manager.evict_blocks(mla_blocks)
    return tokens


@pytest.mark.parametrize("broken", ["append_host_pages", "append_restored_page"])
def test_a_hit_whose_host_pages_cannot_be_registered_returns_its_lease_and_host_pages(
    model, monkeypatch, broken
):
    """An injected fault where a session's next turn registers the pages of its hit that the
    host pool holds: its host prefix hit's pages and hot lease, or the pages an
    OffloadingConnector hit restores. The turn ends with an error; every host page reference
    and every block it held comes back (none was handed over and dropped)."""
    from vllm.v1.hisparse.residency import ResidencyManager
    from vllm.v1.request import RequestStatus

    original = getattr(ResidencyManager, broken)
    held_at_fault = []

    def broken_for_the_next_turn(self, request_id, *args, **kwargs):
        if request_id == "T2":
            held_at_fault.append(self.host_pool.num_referenced)
            raise ValueError("injected")
        return original(self, request_id, *args, **kwargs)

    monkeypatch.setattr(ResidencyManager, broken, broken_for_the_next_turn)
    if broken == "append_host_pages":
        h = SchedulerHarness.create(model=model, memory_bytes=64 << 20, attention_config=HISPARSE)
        first_turn = a_finished_turn_whose_latent_pages_only_the_host_pool_holds(h, prompt(1, 640), "T1")
    else:
        h = offloading_harness(model, "broken-restore", report_delay=1)
        first_turn = prompt(1, 400)
        h.add_request(first_turn, max_tokens=2, request_id="T1")
        h.run_until_done()
        assert h.kv_cache_manager.reset_prefix_cache(), "only the connector and the host pool hold T1 now"
    assert h.hisparse.residency.host_pool.num_referenced == 0
    next_turn = [*first_turn, *h.requests["T1"].output_token_ids, *prompt(2, 60)]
    h.add_request(next_turn, max_tokens=4, request_id="T2")
    h.run_until_done()
    assert h.requests["T2"].status is RequestStatus.FINISHED_ERROR
    stats = h.hisparse.stats()
    assert stats["requests_failed"] == 1
    assert held_at_fault and held_at_fault[0] > 0, "the turn held host pages when the fault hit"
    h.hisparse.check_ownership()
    assert h.hisparse.residency.host_pool.num_referenced == 0
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1


# -------------------------------------------------------------------- negative controls


def pressured(model: str) -> SchedulerHarness:
    """Eight requests in a pool that holds three: demoted pages, hot leases, copies in flight."""
    h = SchedulerHarness.create(model=model, memory_bytes=20 << 20, attention_config=HISPARSE, report_delay=1)
    for i in range(8):
        h.add_request(prompt(i, 512), max_tokens=64)
    for _ in range(60):
        h.step()
        if h.hisparse.stats()["hot_leases"] and h.hisparse.residency.num_copies_in_flight():
            return h
    raise AssertionError("no step had both a hot lease and a copy in flight")


def test_the_ownership_check_sees_a_table_block_that_is_also_leased(model):
    h = pressured(model)
    req = next(r for r in h.hisparse.residency.requests.values() if r.hot_blocks)
    victim = next(r for r in h.hisparse.residency.requests.values() if r is not req and r.pages)
    stolen = victim.pages[-1].block_ids[0]
    h.hisparse.blocks.give_back([req.hot_blocks[0]])
    h.hisparse.blocks.hold([stolen])  # the lease now reads another request's table block
    req.hot_blocks[0] = stolen
    with pytest.raises(OwnershipError, match=f"block {stolen} is in the block table of .* and in a lease"):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_pending_hit_block_in_a_lease(model):
    h = pressured(model)
    req = next(r for r in h.hisparse.residency.requests.values() if r.hot_blocks)
    record = h.hisparse.admissions.begin(h.requests["req-7"], h.kv_cache_manager.empty_kv_cache_blocks)
    record.hit = [h.block_pool.blocks[req.hot_blocks[0]]]
    with pytest.raises(OwnershipError, match="leased or staged and a pending admission's prefix hit"):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_host_page_read_without_a_reference(model):
    h = pressured(model)
    pool = h.hisparse.residency.host_pool
    requests = h.hisparse.residency.requests.values()
    page = next(p.host_page for r in requests for p in r.pages if p.state.value == "both")
    record = h.hisparse.admissions.begin(h.requests["req-7"], h.kv_cache_manager.empty_kv_cache_blocks)
    record.host_pages[0] = page  # read by the admission, never retained
    with pytest.raises(OwnershipError, match=f"host page {page}: .* references"):
        h.hisparse.check_ownership()
    pool.retain(page)
    h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_copy_whose_host_page_has_a_second_holder(model):
    h = pressured(model)
    copy = h.hisparse.residency.copies_in_flight()[0]
    h.hisparse.residency.host_pool.retain(copy.host_page)
    written = f"host page {copy.host_page} is being written and has 2 references"
    with pytest.raises(OwnershipError, match=written):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_reference_nobody_holds(model):
    h = pressured(model)
    block = next(b for b in h.block_pool.blocks if b.ref_cnt == 1 and not b.is_null)
    h.block_pool.touch([block])
    with pytest.raises(OwnershipError, match=f"block {block.block_id}: 2 references, 1 holders"):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_held_history_block_that_is_also_leased(model):
    """A finished session's held history block (histories.py) handed out as a hot lease
    too: two holders of one reference."""
    h = pressured(model)
    req = next(r for r in h.hisparse.residency.requests.values() if r.hot_blocks)
    leased = req.hot_blocks[0]
    h.hisparse.histories._holder[leased] = "an ended turn"
    h.hisparse.histories._by_request["an ended turn"] = {leased: None}
    with pytest.raises(OwnershipError, match=f"block {leased} is leased or staged and also held"):
        h.hisparse.check_ownership()
    h.hisparse.blocks.hold([leased])  # the history's own reference, as `hold` takes it
    with pytest.raises(OwnershipError, match=f"block {leased} is leased or staged and also held"):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_block_table_that_disagrees_with_residency(model):
    """Residency records other blocks for a resident page than its block table holds: the
    check names the request, the page and both."""
    h = pressured(model)
    h.hisparse.check_ownership()
    req = next(r for r in h.hisparse.residency.requests.values() if len(r.pages) > 1)
    index = next(i for i, p in enumerate(req.pages) if p.block_ids is not None and not p.copying)
    other = next(p.block_ids for p in req.pages if p.block_ids not in (None, req.pages[index].block_ids))
    req.pages[index].block_ids = other
    state = req.pages[index].state.value
    with pytest.raises(OwnershipError, match=rf"{req.request_id} page {index} \({state}\): table holds"):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_an_unreferenced_block_missing_from_the_free_queue(model):
    h = pressured(model)
    block = next(b for b in h.block_pool.free_block_queue.get_all_free_blocks() if not b.is_null)
    h.block_pool.free_block_queue.remove(block)
    with pytest.raises(OwnershipError, match=rf"the free queue holds \[{block.block_id}\] wrongly"):
        h.hisparse.check_ownership()


def test_the_ownership_check_sees_a_host_page_both_free_and_referenced(model):
    """A referenced host page put back among the never-used ones in place of a free one:
    every count still adds up, but one page has two states."""
    h = pressured(model)
    pool = h.hisparse.residency.host_pool
    referenced = next(iter(pool._refs))
    pool._never_used[-1] = referenced
    with pytest.raises(OwnershipError, match="a host page is in two of free, cached and referenced"):
        h.hisparse.check_ownership()


def offloading_harness(
    model: str, engine_id: str, report_delay: int, mode: str = "hybrid", beside: tuple[str, ...] | None = None
) -> SchedulerHarness:
    """HiSparse with the OffloadingConnector (a 32 MiB CPU tier) in a 20 MiB device pool;
    with `beside`, inside a MultiConnector, after the connectors named there."""
    offloading = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 32 << 20},
    }  # fmt: skip
    if beside is None:
        transfer = KVTransferConfig(**offloading, engine_id=engine_id)
    else:
        connectors = [{"kv_connector": name, "kv_role": "kv_both"} for name in beside] + [offloading]
        transfer = KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", engine_id=engine_id,
            kv_connector_extra_config={"connectors": connectors},
        )  # fmt: skip
    return SchedulerHarness.create(
        model=model, memory_bytes=20 << 20, max_model_len=1024,
        attention_config={"hisparse_config": {**HISPARSE["hisparse_config"], "mode": mode}},
        max_num_batched_tokens=1024, kv_transfer_config=transfer, report_delay=report_delay,
    )  # fmt: skip


@pytest.mark.parametrize("beside", [None, (), ("NixlConnector",)], ids=["alone", "multi", "multi-nixl"])
def test_a_restore_planned_before_a_connectors_load_stays_the_requests_own(model, beside):
    """An OffloadingConnector hit with room on the device: its sparse-MLA pages are restored
    into the hit's blocks, planned with the request's first allocation, while the connector
    loads the indexer's pages asynchronously. Allocated again for its first compute, the
    request keeps those restores: the pages register as BOTH (durable on the host), and
    nothing copies them to the host again. Inside a MultiConnector (beside a P/D
    connector, as the docs' P/D with a CPU tier) the same: HiSparse took a MultiConnector
    for one that loads every group, and its hit ran over sparse-MLA blocks nothing wrote."""
    h = offloading_harness(model, f"restore-test-{uuid.uuid4().hex}", report_delay=2, beside=beside)
    first_turn = prompt(1, 400)
    h.add_request(first_turn, max_tokens=2, request_id="A1")
    h.run_until_done()
    assert h.kv_cache_manager.reset_prefix_cache(), "only the connector and the host pool hold A1 now"
    copied = h.hisparse.stats()["pages_copied_to_host"]
    second_turn = [*first_turn, *h.requests["A1"].output_token_ids, *prompt(2, 60)]
    h.add_request(second_turn, max_tokens=4, request_id="A2")
    loading = False
    while "A2" not in h.hisparse.residency.requests:
        h.step()
        loading |= h.requests["A2"].status.name == "WAITING_FOR_REMOTE_KVS"
    assert loading, "the connector loaded the hit asynchronously"
    restored = h.hisparse.stats()["pages_restored"]
    assert restored == 6
    pages = h.hisparse.residency.requests["A2"].pages
    assert [p.state.value for p in pages[:restored]] == ["both"] * restored
    h.run_until_done()
    plans = [o.hisparse_plan for o in h.observations if o.hisparse_plan is not None]
    copies = [c for plan in plans for c in plan.copies if c.request_id == "A2"]
    assert copies and all(c.page_index >= restored for c in copies), "a restored page was copied again"
    assert h.hisparse.stats()["pages_copied_to_host"] - copied == len(copies)


def test_a_connector_hit_whose_tail_left_the_host_pool_keeps_the_pages_the_pool_holds(model):
    """A session's next turn hits the OffloadingConnector's indexer pages for its whole
    history, but the host pool holds only the first pages' sparse-MLA content (the rest
    were never copied before the turn ended, and the device has evicted them). The hit is
    cut to the pages the host pool holds, at a connector chunk boundary; the turn does
    not recompute its whole history."""
    h = offloading_harness(model, "partial-host-hit", report_delay=1)
    h.hisparse.residency.max_copies_per_step = 1  # copies lag the prefill
    first_turn = prompt(3, 400)
    h.add_request(first_turn, max_tokens=2, request_id="B1")
    h.run_until_done()
    assert h.kv_cache_manager.reset_prefix_cache(), "only the connector and the host pool hold B1 now"
    pool = h.hisparse.residency.host_pool
    in_pool = [pool.lookup(block_hash) is not None for block_hash in h.requests["B1"].block_hashes[:6]]
    held = in_pool.index(False) if False in in_pool else len(in_pool)
    assert 0 < held < 6, f"the host pool holds {held} of B1's 6 whole pages"
    second_turn = [*first_turn, *h.requests["B1"].output_token_ids, *prompt(4, 60)]
    h.add_request(second_turn, max_tokens=4, request_id="B2")
    while "B2" not in h.hisparse.residency.requests:
        h.step()
    started = h.observations[-1].num_computed_tokens["B2"] - h.observations[-1].num_scheduled_tokens["B2"]
    assert started == held * BLOCK, f"B2 started at token {started}, not after the {held} host-held pages"
    h.run_until_done()
    h.hisparse.check_ownership()


def next_turn_without_room_for_a_lease(
    h: SchedulerHarness, monkeypatch, previous: str, seed: int, request_id: str
) -> list[int]:
    """With no room for any hot lease and another request running (so the next turn's hit
    is not capped as a lone request's is), `previous`'s session sends its next turn."""
    admissions = h.hisparse.admissions
    monkeypatch.setattr(admissions, "_lease_blocks_for", lambda request: h.block_pool.num_gpu_blocks + 1)
    h.add_request(prompt(seed + 100, 100), max_tokens=60, request_id=f"{request_id}-other")
    h.step()
    turn = [*h.requests[previous].prompt_token_ids, *h.requests[previous].output_token_ids, *prompt(seed, 60)]
    h.add_request(turn, max_tokens=4, request_id=request_id)
    return turn


def test_a_connector_hit_without_room_for_its_lease_takes_no_host_reference(model, monkeypatch):
    """A session's next turn whose history only the OffloadingConnector (indexer pages) and
    the host pool (sparse-MLA pages) hold, with no room for a hot lease, recomputes it. The
    hit's host pages are looked up and never retained: a turn that waits for room tries again
    every step, over a history of thousands of pages, and taking and giving back each
    page's reference every time changes nothing. They end as the host pool's most recently
    used, in page order, as if taken and given back, so they outlast the others while it
    waits. With room (the next turn), the same hit is taken, each page retained once."""
    # Mode "always" never restores a connector hit's pages instead of leasing for them.
    h = offloading_harness(model, "no-lease-hit", report_delay=1, mode="always")
    first_turn = prompt(5, 400)
    h.add_request(first_turn, max_tokens=2, request_id="C1")
    h.run_until_done()
    assert h.kv_cache_manager.reset_prefix_cache(), "only the connector and the host pool hold C1 now"
    pool = h.hisparse.residency.host_pool
    wanted = [pool.lookup(block_hash) for block_hash in h.requests["C1"].block_hashes[:6]]
    assert None not in wanted and pool.num_referenced == 0
    pool.touch(reversed(wanted))
    admissions = h.hisparse.admissions
    cap, retain, retain_all = admissions.cap_external_hit, pool.retain, pool.retain_all
    retained, seen = [], []

    def counted_retain(page):
        retained.append(page)
        retain(page)

    def counted_retain_all(pages):
        pages = list(pages)
        retained.extend(pages)
        retain_all(pages)

    def observed_cap(request, *args, **kwargs):
        retained.clear()
        hit = cap(request, *args, **kwargs)
        seen.append((hit[1], list(retained), list(pool._evictable)))
        return hit

    monkeypatch.setattr(pool, "retain", counted_retain)
    monkeypatch.setattr(pool, "retain_all", counted_retain_all)
    lease_blocks = admissions._lease_blocks_for
    second_turn = next_turn_without_room_for_a_lease(h, monkeypatch, "C1", 6, "C2")
    monkeypatch.setattr(admissions, "cap_external_hit", observed_cap)
    admitted = h.step()
    assert admitted.new_request_cached_tokens["C2"] == 0, "no lease: recomputed"
    ((hit_tokens, taken, evictable),) = seen
    assert hit_tokens == 0 and taken == [], f"the refused hit took host references {taken}"
    assert evictable[-len(wanted) :] == wanted
    assert h.hisparse.stats()["host_hits_without_lease"] == 1
    h.run_until_done()
    h.hisparse.check_ownership()

    monkeypatch.setattr(admissions, "_lease_blocks_for", lease_blocks)
    assert h.kv_cache_manager.reset_prefix_cache()
    third_turn = [*second_turn, *h.requests["C2"].output_token_ids, *prompt(7, 60)]
    seen.clear()
    h.add_request(third_turn, max_tokens=4, request_id="C3")
    while "C3" not in h.hisparse.residency.requests:
        h.step()
    hit_tokens, taken, _ = seen[-1]
    assert hit_tokens > 0 and sorted(taken) == sorted(set(taken)), "each page of the hit retained once"
    assert len(taken) == hit_tokens // BLOCK
    h.run_until_done()
    h.hisparse.check_ownership()


def test_a_turn_whose_walk_found_no_room_for_its_lease_does_not_ask_again_for_a_connector_hit(
    model, monkeypatch
):
    """The device still caches a finished turn's indexer pages, the host pool its sparse-MLA
    pages, and the OffloadingConnector the indexer pages too. The next turn's walk reaches
    the first host page, finds no room for a hot lease (demotion made none) and ends there;
    the connector then offers the same history. The lease is not tried a second time in that
    step: nothing that could make room has happened since, and a second relief would only
    mark more pages for demotion for the same turn."""
    # Mode "always" never restores a connector hit's pages instead of leasing for them.
    h = offloading_harness(model, "no-second-lease", report_delay=1, mode="always")
    first_turn = a_finished_turn_whose_latent_pages_only_the_host_pool_holds(h, prompt(8, 400), "D1")
    next_turn_without_room_for_a_lease(h, monkeypatch, "D1", 9, "D2")
    admissions = h.hisparse.admissions
    calls = record_lease_attempts(monkeypatch, admissions)
    # The connector's hit reads the host copies the walk found (no page looked up twice in
    # the step), and the pages left out for want of the lease count once.
    pool = h.hisparse.residency.host_pool
    looked_up, unleased = record_host_lookups(monkeypatch, pool), []
    waits_for_lease = admissions.waits_for_lease

    def observed_waits_for_lease(request, num_computed_tokens):
        if (record := admissions._records.get(request.request_id)) is not None:
            unleased.append(record.unleased_pages)
        return waits_for_lease(request, num_computed_tokens)

    monkeypatch.setattr(admissions, "waits_for_lease", observed_waits_for_lease)
    while "D2" not in h.hisparse.residency.requests:
        admitted = h.step()
    assert admitted.new_request_cached_tokens["D2"] == 0, "no lease: recomputed"
    assert calls == ["walk"], f"lease attempts in D2's admission: {calls}"
    assert h.hisparse.stats()["host_hits_without_lease"] == 1, "one try, counted once"
    history_pages = len(first_turn) // BLOCK
    assert looked_up and max(looked_up.values()) == 1, f"looked up twice: {looked_up.most_common(2)}"
    assert unleased == [history_pages], f"pages left out for want of the lease: {unleased}"
    h.run_until_done()
    h.hisparse.check_ownership()


def test_the_offloading_connector_gets_no_block_id_snapshot_and_other_connectors_do(model, monkeypatch):
    """vLLM 0.29's OffloadingConnector reads only the boundary-state handoffs of the
    scheduler's per-step block state, so under HiSparse the scheduler leaves out the
    per-request block ids (every KV cache group's, for each new or grown request). Any other
    connector, a subclass of it included, still gets them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    h = offloading_harness(model, "snapshot-test", report_delay=1)
    assert type(h.scheduler.connector) is OffloadingConnector
    h.add_request(prompt(5, 300), max_tokens=3, request_id="S1")
    states = []  # what the connector reads while it builds each step's metadata
    connector = h.scheduler.connector
    real = connector.build_connector_meta

    def build_connector_meta(scheduler_output):
        if scheduler_output.num_scheduled_tokens:
            states.append(scheduler_output.kv_connector_block_state)
        return real(scheduler_output)

    monkeypatch.setattr(connector, "build_connector_meta", build_connector_meta)
    h.run_until_done()
    assert states and all(s is not None and s.block_ids == {} for s in states), states
    assert h.requests["S1"].num_output_tokens == 3

    from vllm.v1.hisparse.kv_import import reads_block_id_snapshot

    class ReadsBlockIds(OffloadingConnector):
        pass

    assert not reads_block_id_snapshot(h.scheduler.connector)
    assert reads_block_id_snapshot(object.__new__(ReadsBlockIds))
    assert reads_block_id_snapshot(object())


# ---------------------------------------------- OffloadingConnector stores and block reuse


@pytest.mark.parametrize("hisparse", [False, True])
def test_a_block_an_offloading_store_still_reads_is_fenced_whoever_takes_it_next(model, hisparse):
    """R's prompt is stored to the OffloadingConnector's CPU tier, its jobs completing thirty
    steps late; R finishes and its blocks go back to the pool (the connector holds none: it
    flushes a pending store before the forward of a step that allocates one of its blocks).
    Y's long prompt then takes them. KV cache groups share block ids, and with HiSparse
    the connector sees its own groups only, so it missed R's indexer blocks coming back
    as Y's sparse-MLA blocks or a hot lease, and Y's forward overwrote what the store was
    still reading: the tier would serve Y's bytes as R's indexer keys. The harness checks
    every step that a block taken while a store reads it has that store flushed."""
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=f"fence-{uuid.uuid4().hex}",
        kv_connector_extra_config={"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 32 << 20},
    )  # fmt: skip
    h = SchedulerHarness.create(
        model=model, memory_bytes=(6 if hisparse else 8) << 20, max_model_len=1024,
        max_num_batched_tokens=256, kv_transfer_config=transfer, report_delay=30,
        attention_config={"hisparse_config": {"host_pool_gib": 400.5 * PAGE_GIB}} if hisparse else None,
    )  # fmt: skip
    assert (h.scheduler.connector.hisparse_group_ids is not None) == hisparse
    connector = h.scheduler.connector.connector_scheduler
    h.add_request(prompt(1, 300), max_tokens=1, request_id="R")
    while not h.requests["R"].is_finished():
        h.step()
    stored = set(connector._block_id_to_pending_jobs)
    assert stored, "R's stores are still running when it finishes"
    reused: set[int] = set()
    check = h._check_store_fence

    def recorded(stores, free_before, output):
        free_after = {b.block_id for b in h.block_pool.free_block_queue.get_all_free_blocks()}
        reused.update((free_before - free_after) & stored & stores.keys())
        check(stores, free_before, output)

    h._check_store_fence = recorded  # the harness checks the fence as each step is scheduled
    for y in range(3):
        h.add_request(prompt(2 + y, 300), max_tokens=4, request_id=f"Y{y}")
    h.run_until_done()
    assert reused, "the pool gave out blocks whose stores were still pending (the case under test)"


# ------------------------------------------- host copies name the whole prefix of their page


def test_a_host_copy_is_found_only_by_its_pages_whole_prefix_with_a_finer_hash_block(model):
    """With `--prefix-match-unit 16` vLLM hashes every 16 tokens, four hashes a page. A's
    pages are copied to the host pool; B shares only A's first 48 tokens. B's pages must
    not be backed by A's copies (the first 16-token hash of page i names only tokens
    [0, 16 (i + 1)), which B shares up to page 2), and once demoted B reads only its own
    KV. C repeats A's prompt and is served A's copies: the key still works."""
    h = SchedulerHarness.create(
        model=model, num_blocks=400, attention_config=HISPARSE, max_model_len=1024,
        max_num_batched_tokens=512, prefix_match_unit=16,
    )  # fmt: skip
    assert (h.block_size, h.hash_block_size) == (BLOCK, 16)
    residency = h.hisparse.residency
    common = prompt(1, 48)
    a = h.add_request(common + prompt(2, 300), max_tokens=1, request_id="A")
    h.run_until_done()
    a_copies = {residency.host_pool.lookup(a.block_hashes[4 * i + 3]) for i in range(5)} - {None}
    assert len(a_copies) == 5, "A's complete pages are in the host pool"
    h.add_request(common + prompt(3, 300), max_tokens=30, request_id="B")
    b_pages: set[int] = set()
    for _ in range(12):
        h.step()
        req = residency.requests.get("B")
        if req is not None:
            b_pages.update(p for p in req.pages.host_page if p is not None)
    assert residency.counters.copies_avoided == 0
    assert b_pages and not b_pages & a_copies, "B's pages are backed by copies of A's KV"
    h.run_until_done()
    h.add_request(common + prompt(2, 300), max_tokens=30, request_id="C")
    for _ in range(4):
        h.step()
    assert residency.counters.copies_avoided > 0, "A's copies serve A's prompt"


def test_resetting_the_prefix_cache_forgets_the_host_pools_copies(model):
    """vLLM resets its prefix cache and its connectors' tiers after a weight update (RLHF's
    `pause_generation(clear_cache=True)`; the endpoint's `reset_external`). The host pool
    kept its copies indexed, so the same prompt afterwards, computed with the new weights,
    was made BOTH with copies of the old KV and read them once demoted."""
    h = SchedulerHarness.create(
        model=model, num_blocks=400, attention_config=HISPARSE, max_model_len=1024, max_num_batched_tokens=512
    )
    residency = h.hisparse.residency
    tokens = prompt(1, 330)
    a = h.add_request(tokens, max_tokens=1, request_id="A")
    h.run_until_done()
    old = {residency.host_pool.lookup(a.block_hashes[i]) for i in range(5)}
    assert None not in old, "A's pages were copied to the host pool"
    # A reset of the device's prefix cache alone keeps the offload tiers, as upstream's
    # keeps its connectors': the host pool is one.
    assert h.scheduler.reset_prefix_cache()
    assert residency.host_pool.lookup(a.block_hashes[0]) is not None
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    assert all(residency.host_pool.lookup(x) is None for x in a.block_hashes)
    h.add_request(tokens, max_tokens=30, request_id="B")
    for _ in range(6):
        h.step()
    assert residency.counters.copies_avoided == 0, "B's pages were made BOTH with copies of the old KV"
    b_pages = residency.requests["B"].pages.host_page[:5]
    assert None not in b_pages, "B's own pages are copied"
    residency.host_pool.check()
    h.run_until_done()


def failing_once(h: SchedulerHarness, request_id: str) -> list[bool]:
    """Make the harness's workers report `request_id` failed in the next step that schedules
    it once True is put in the returned list."""
    make_output = h.model_runner_output
    report: list[bool] = []

    def output(scheduler_output):
        out = make_output(scheduler_output)
        if report and request_id in scheduler_output.num_scheduled_tokens:
            out.hisparse_failed = {request_id: "its selections were not in the host pool"}
            report.clear()
        return out

    h.model_runner_output = output
    return report


def failing_late(h: SchedulerHarness, request_id: str, delay: int) -> list[int]:
    """Make the harness's workers report `request_id`'s last step failed `delay` steps after
    it; the returned list gets that step's number."""
    make_output = h.model_runner_output
    failed_at: list[int] = []

    def output(scheduler_output):
        out = make_output(scheduler_output)
        step = len(h.observations)
        request = h.requests[request_id]
        if (
            request_id in scheduler_output.num_scheduled_tokens
            and request.num_computed_tokens >= request.num_tokens
        ):
            failed_at.append(step)
        if failed_at and step == failed_at[0] + delay:
            out.hisparse_failed = {request_id: "its selections were not in the host pool"}
        return out

    h.model_runner_output = output
    return failed_at


def after_a_shared_prefix(model: str, report_delay: int) -> tuple[SchedulerHarness, list[int]]:
    """A harness whose workers report every step `report_delay` steps late, after S computed
    a two-page prefix; and a prompt of that prefix and 202 tokens more."""
    h = SchedulerHarness.create(
        model=model, num_blocks=400, attention_config=HISPARSE, max_model_len=1024,
        max_num_batched_tokens=128, report_delay=report_delay,
    )  # fmt: skip
    shared = prompt(1, 2 * BLOCK)
    h.add_request(shared, max_tokens=1, request_id="S")
    h.run_until_done()
    return h, shared + prompt(2, 202)


@pytest.mark.parametrize("report_delay", [0, 2])
def test_what_a_request_wrote_before_it_failed_on_the_workers_is_neither_cached_nor_published(
    model, report_delay
):
    """A worker reports that R's attention read wrong rows in a step (its resolver's error
    bits): the KV R wrote from then on is wrong past the first layer that did. R ended
    with an error, but the page that step completed was still copied and published in the
    host pool, and its blocks stayed in the prefix cache: the next request of the prompt
    took them as its hit. Now R's pages from its first own step on leave both (which
    step failed is not known when reports come late), and the pages of its prefix hit
    stay."""
    h, tokens = after_a_shared_prefix(model, report_delay)
    make_output = h.model_runner_output
    failed_in: list[int] = []

    def output(scheduler_output):
        out = make_output(scheduler_output)
        r_tokens = scheduler_output.num_scheduled_tokens.get("R", 0)
        if r_tokens and h.requests["R"].num_computed_tokens > 4 * BLOCK:
            out.hisparse_failed = {"R": "its selections were not in the host pool"}
            failed_in.append(h.requests["R"].num_computed_tokens)
        return out

    h.model_runner_output = output
    r = h.add_request(tokens, max_tokens=5, request_id="R")
    h.run_until_done()
    assert failed_in and r.status == RequestStatus.FINISHED_ERROR
    pool = h.hisparse.residency.host_pool
    assert [i for i in range(5) if pool.lookup(r.block_hashes[i]) is not None] == [0, 1], (
        "only the pages of R's prefix hit stay published"
    )
    h.model_runner_output = make_output
    h.add_request(tokens, max_tokens=2, request_id="B")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["B"] == 2 * BLOCK, "B's hit is S's pages alone"
    h.run_until_done()
    assert h.hisparse.pages_withdrawn > 0


def test_a_failure_reported_after_its_request_finished_still_withdraws_what_it_wrote(model):
    """On CUDA a step's report comes a step or more late (two here, for every step), so R
    may have finished before the report of its failed last step arrives: what it wrote
    was left cached and published. HiSparse keeps an ended request's writes until every
    step it was scheduled in is reported, and withdraws them then."""
    h, tokens = after_a_shared_prefix(model, report_delay=2)
    make_output = h.model_runner_output
    failed_at = failing_late(h, "R", delay=2)
    r = h.add_request(tokens, max_tokens=1, request_id="R")
    h.run_until_done()
    h.step()
    h.step()
    assert failed_at and r.status == RequestStatus.FINISHED_LENGTH_CAPPED, "R finished before the report"
    pool = h.hisparse.residency.host_pool
    assert [i for i in range(5) if pool.lookup(r.block_hashes[i]) is not None] == [0, 1]
    h.model_runner_output = make_output
    h.add_request(tokens, max_tokens=2, request_id="B")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["B"] == 2 * BLOCK, "B's hit is S's pages alone"
    h.run_until_done()
    for _ in range(3):  # an idle engine's steps, until B's reports are in
        h.step()
    assert not h.hisparse._ended_writes, "kept only until the workers reported their steps"


@pytest.mark.parametrize("report_delay", [0, 2])
def test_a_request_whose_prefix_hit_took_a_failed_requests_kv_fails_with_it(model, report_delay):
    """F arrives while R decodes and takes R's prompt pages as its prefix hit; then the
    workers report that a step of R read wrong rows. R's pages left the prefix cache, but
    F already held them: it went on answering from KV that R wrote wrong. F fails with R,
    and a request after both hits only the pages from before R's own steps."""
    h, tokens = after_a_shared_prefix(model, report_delay)
    make_output = h.model_runner_output
    report_failure = failing_once(h, "R")
    r = h.add_request(tokens, max_tokens=20, request_id="R")
    while r.num_computed_tokens < len(tokens):
        h.step()
    f = h.add_request(tokens, max_tokens=20, request_id="F")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["F"] == 5 * BLOCK, "F's hit takes R's pages"
    report_failure.append(True)
    h.run_until_done()
    assert r.status == RequestStatus.FINISHED_ERROR
    assert f.status == RequestStatus.FINISHED_ERROR, "F answered from the KV R wrote wrong"
    assert h.hisparse.stats()["requests_failed"] == 2
    h.model_runner_output = make_output
    h.add_request(tokens, max_tokens=2, request_id="G")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["G"] == 2 * BLOCK, "G's hit is S's pages alone"
    h.run_until_done()


def test_a_request_that_took_an_ended_requests_kv_before_its_late_failure_fails_with_it(model):
    """R finishes; F takes R's pages as its prefix hit; two steps after R's last step its
    report says that step read wrong rows. What R wrote leaves the prefix cache and the
    host pool, and F, which holds R's blocks, fails too."""
    h, tokens = after_a_shared_prefix(model, report_delay=2)
    failed_at = failing_late(h, "R", delay=2)
    r = h.add_request(tokens, max_tokens=1, request_id="R")
    while not r.is_finished():
        h.step()
    f = h.add_request(tokens, max_tokens=8, request_id="F")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["F"] == 5 * BLOCK, "F's hit takes R's pages"
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(h.observations) <= failed_at[0] + 2, (
        "R finished, and F took its pages, before the report"
    )
    h.run_until_done()
    assert f.status == RequestStatus.FINISHED_ERROR, "F answered from the KV R wrote wrong"
    pool = h.hisparse.residency.host_pool
    assert [i for i in range(5) if pool.lookup(r.block_hashes[i]) is not None] == [0, 1]


def copied_and_evicted(h: SchedulerHarness, tokens: list[int], request_id: str):
    """A request of `tokens` (after S's two-page prefix) run until its pages' copies are in
    the host pool, its own blocks then evicted from the device's prefix cache (as after
    demotion): a later request of the prompt computes those pages again. The request."""
    request = h.add_request(tokens, max_tokens=30, request_id=request_id)
    pool = h.hisparse.residency.host_pool
    while request.num_computed_tokens < len(tokens) or pool.lookup(request.block_hashes[4]) is None:
        h.step()
    h.kv_cache_manager.evict_blocks({b for table in h.block_ids(request_id) for b in table[2:]})
    return request


def test_a_request_backed_by_a_failed_requests_host_copies_fails_with_it(model):
    """R's own pages are in the host pool and no longer in the device's prefix cache, so F
    computes them again and takes R's copies as theirs in the host pool (no copy of its
    own is made). Then the workers report that a step of R read wrong rows: F, which
    would read those copies once its pages are demoted, fails with R. (F shares no device
    block with R here.)"""
    h, tokens = after_a_shared_prefix(model, report_delay=0)
    report_failure = failing_once(h, "R")
    r = copied_and_evicted(h, tokens, "R")
    pool = h.hisparse.residency.host_pool
    r_copies = {pool.lookup(r.block_hashes[i]) for i in range(2, 5)}
    f = h.add_request(tokens, max_tokens=20, request_id="F")
    while "F" not in h.hisparse.residency.requests or not r_copies <= set(
        h.hisparse.residency.requests["F"].pages.host_page
    ):
        h.step()
        assert f.num_computed_tokens < len(tokens) + 2, "F's pages are not backed by R's copies"
    r_own = {b for table in h.block_ids("R") for b in table[2:]}
    assert not {b for table in h.block_ids("F") for b in table} & r_own, "F shares no block R wrote"
    report_failure.append(True)
    h.run_until_done()
    assert r.status == RequestStatus.FINISHED_ERROR
    assert f.status == RequestStatus.FINISHED_ERROR, "F answered from copies of the KV R wrote wrong"
    assert [i for i in range(5) if pool.lookup(r.block_hashes[i]) is not None] == [0, 1]
    assert pool.num_referenced == 0


def test_a_connector_hit_stops_before_the_pages_a_failed_request_stored_in_its_tier(model):
    """R1's prefill step fails on the workers. HiSparse withdraws its sparse-MLA pages, but
    the OffloadingConnector beside it had stored R1's indexer keys of those pages, and its
    tier never overwrites a key it holds. R2 computes the prompt again (its pages reach
    the host pool, the tier keeps R1's keys); R3's connector hit then paired R1's wrong
    indexer keys with R2's sparse-MLA pages. Now the hit stops before R1's pages."""
    h = offloading_harness(model, f"withdrawn-tier-{uuid.uuid4().hex}", report_delay=1)
    tokens = prompt(11, 400)
    make_output = h.model_runner_output
    failed: list[int] = []

    def output(scheduler_output):
        out = make_output(scheduler_output)
        r1 = h.requests.get("R1")
        if (
            "R1" in scheduler_output.num_scheduled_tokens
            and r1.num_computed_tokens >= r1.num_tokens
            and not failed
        ):
            out.hisparse_failed = {"R1": "its selections were not in the host pool"}
            failed.append(len(h.observations))
        return out

    h.model_runner_output = output
    r1 = h.add_request(tokens, max_tokens=3, request_id="R1")
    h.run_until_done()
    h.model_runner_output = make_output
    assert failed and r1.status == RequestStatus.FINISHED_ERROR
    for _ in range(3):
        h.step()
    assert h.kv_cache_manager.reset_prefix_cache(), "only the tiers hold the prompt now"
    h.add_request(tokens, max_tokens=2, request_id="R2")
    h.run_until_done()
    for _ in range(3):
        h.step()
    pool = h.hisparse.residency.host_pool
    assert all(pool.lookup(r1.block_hashes[i]) is not None for i in range(6)), (
        "R2's pages are in the host pool"
    )
    assert h.kv_cache_manager.reset_prefix_cache()
    h.add_request([*tokens, *prompt(12, 30)], max_tokens=2, request_id="R3")
    h.step()
    while "R3" not in h.observations[-1].new_request_cached_tokens:
        h.step()
    assert h.observations[-1].new_request_cached_tokens["R3"] == 0, "R3's hit took the keys R1 stored"
    assert h.hisparse.stats()["connector_hits_refused"] == 2, "R2's hit and R3's"
    h.run_until_done()
    # A turn refused in every step it tries (it waits for room) is one refused hit.
    assert h.kv_cache_manager.reset_prefix_cache()
    r4 = h.add_request([*tokens, *prompt(13, 30)], max_tokens=2, request_id="R4")
    admissions = h.hisparse.admissions
    for _ in range(3):
        hit = admissions.cap_external_hit(
            r4, h.kv_cache_manager.empty_kv_cache_blocks, 0, 6 * BLOCK, executable=True
        )
        assert hit[1] == 0, "R4's hit takes the keys R1 stored"
        admissions.release("R4")
    assert h.hisparse.stats()["connector_hits_refused"] == 3
    h.run_until_done()


def test_spare_staging_blocks_go_straight_to_the_pool_while_frees_are_deferred(model, tmp_path):
    """A KV consumer with asynchronous scheduling defers frees while a step is in flight.
    Spare staging blocks went to that deferred queue too, though no step in flight holds
    them (a step's staging comes back only once its output is in): relief counted them
    free, then found none, and demoted or preempted for blocks it had."""
    h = example_consumer(model, tmp_path, memory_mib=8, host_pages=2000, async_scheduling=True)
    request = h.add_request(prompt(1, 300), max_tokens=20)
    h.step()
    blocks = h.hisparse.blocks
    assert blocks.frees_are_deferred(), "a step is in flight"
    spare = blocks.take(3)
    blocks.keep_spare(spare)
    free_before = h.block_pool.get_num_free_blocks()
    assert h.hisparse.relieve_pressure(request, 3), "the spare blocks cover the need"
    assert h.block_pool.get_num_free_blocks() - free_before == 3
    assert set(spare) <= set(blocks.free_queue_ids())
    assert h.hisparse.stats()["pages_demoted"] == 0
    h.run_until_done()


def test_on_the_page_layout_a_follower_is_withdrawn_from_the_page_it_took_not_its_resident_blocks_first(
    model,
):
    """The page layout: a resident block holds eight pages of the indexer. F took R's pages
    as its prefix hit, R's resident block among them, whose first page is page 0: F was
    withdrawn from page 0, so S's shared prefix pages left the cache, and A, which shares
    only S's prefix, failed as F's follower."""
    h = SchedulerHarness.create(
        model=model, num_blocks=600, max_model_len=2048, max_num_batched_tokens=1024,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05, "kv_layout": "page"}},
    )  # fmt: skip
    assert h.hisparse.blocks.resident_multiple > 1
    shared = prompt(1, 2 * BLOCK)
    s = h.add_request(shared + prompt(5, 10), max_tokens=1, request_id="S")
    h.run_until_done()
    report = failing_once(h, "R")
    a = h.add_request(shared + prompt(3, 300), max_tokens=50, request_id="A")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["A"] == 2 * BLOCK, "A shares S's prefix alone"
    tokens = shared + prompt(2, 10 * BLOCK)
    r = h.add_request(tokens, max_tokens=50, request_id="R")
    while r.num_computed_tokens < len(tokens):
        h.step()
    f = h.add_request(tokens, max_tokens=50, request_id="F")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["F"] > 2 * BLOCK, "F took R's pages"
    report.append(True)
    h.run_until_done()
    assert r.status == f.status == RequestStatus.FINISHED_ERROR
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED, "A shares nothing R wrote"
    pool = h.hisparse.residency.host_pool
    assert not any(pool.is_withdrawn(s.block_hashes[i]) for i in range(2)), "S's prefix is not R's"
    assert h.hisparse.stats()["requests_failed"] == 2


def test_a_request_whose_copies_a_failed_request_only_reused_is_not_failed_with_it(model):
    """G computes its pages and copies them to the host pool; R computes the same pages
    again and backs them with G's copies (no copy of its own). R fails on the workers: G,
    whose KV is its own, failed as R's follower, and G's good copies were forgotten."""
    h, tokens = after_a_shared_prefix(model, report_delay=0)
    report = failing_once(h, "R")
    g = copied_and_evicted(h, tokens, "G")
    pool = h.hisparse.residency.host_pool
    g_copies = [pool.lookup(g.block_hashes[i]) for i in range(5)]
    r = h.add_request(tokens, max_tokens=20, request_id="R")
    while "R" not in h.hisparse.residency.requests or not set(g_copies[2:]) <= set(
        h.hisparse.residency.requests["R"].pages.host_page
    ):
        h.step()
        assert r.num_computed_tokens < len(tokens) + 2, "R's pages are not backed by G's copies"
    report.append(True)
    h.run_until_done()
    assert r.status == RequestStatus.FINISHED_ERROR
    assert g.status == RequestStatus.FINISHED_LENGTH_CAPPED, "G failed for copies R only read"
    assert [pool.lookup(g.block_hashes[i]) for i in range(5)] == g_copies, "G's copies stay findable"


def finished_before_its_failure_report(model: str):
    """R (S's prefix and 202 tokens more) run to its end, the report that its last step
    failed due four steps after that step: (harness, R's tokens, R, the workers' output
    before the failure was arranged)."""
    h, tokens = after_a_shared_prefix(model, report_delay=4)
    make_output = h.model_runner_output
    failing_late(h, "R", delay=4)
    r = h.add_request(tokens, max_tokens=1, request_id="R")
    while not r.is_finished():
        h.step()
    return h, tokens, r, make_output


def test_a_follower_that_ended_before_the_report_does_not_publish_the_failed_requests_pages_again(model):
    """R finishes; F takes R's pages as its prefix hit and finishes too, its copies of them
    in flight; then R's failure is reported (four steps late). R's pages left the host
    pool's index, but F's copies of the same blocks landed after and were published under
    R's hashes, and G's prefix hit took them."""
    h, tokens, r, make_output = finished_before_its_failure_report(model)
    f = h.add_request([*tokens, *prompt(9, 2 * BLOCK + 10)], max_tokens=1, request_id="F")
    for _ in range(8):
        h.step()
    assert f.is_finished() and h.hisparse.stats()["requests_failed"] == 1
    pool = h.hisparse.residency.host_pool
    assert [i for i in range(5) if pool.lookup(r.block_hashes[i]) is not None] == [0, 1], (
        "a copy of R's wrong KV is published under its hashes"
    )
    h.model_runner_output = make_output
    h.run_until_done()


def test_what_a_follower_that_ended_before_the_report_wrote_past_the_pages_it_took_is_withdrawn(model):
    """R finishes; F takes R's pages as its prefix hit, computes two pages of its own past
    them (attending over R's) and finishes before R's late failure report. F could not be
    failed, and its own pages stayed in the prefix cache and the host pool, where the
    next request of F's prompt took them."""
    h, tokens, r, make_output = finished_before_its_failure_report(model)
    f_tokens = [*tokens, *prompt(9, 2 * BLOCK + 10)]
    f = h.add_request(f_tokens, max_tokens=1, request_id="F")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["F"] == 5 * BLOCK, "F's hit takes R's pages"
    h.run_until_done()
    assert r.status == f.status == RequestStatus.FINISHED_LENGTH_CAPPED, "both ended before the report"
    assert h.hisparse.stats()["pages_withdrawn"] > 0
    h.model_runner_output = make_output
    for _ in range(4):
        h.step()
    pool = h.hisparse.residency.host_pool
    assert [i for i in range(7) if pool.lookup(f.block_hashes[i]) is not None] == [0, 1]
    h.add_request(f_tokens, max_tokens=1, request_id="G")
    h.step()
    assert h.observations[-1].new_request_cached_tokens["G"] == 2 * BLOCK, "G's hit is S's pages alone"
    h.run_until_done()
