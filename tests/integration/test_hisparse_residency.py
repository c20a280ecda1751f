# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse residency in vLLM's real Scheduler and KVCacheManager.

A six-layer tiny GLM-5 model (six sparse-MLA KV cache groups of one layer plus one
indexer group of six; a page is 64 tokens and seven blocks, the indexer's one of
them; a hot lease is one page of every sparse-MLA group, six blocks) scheduled by
the patched scheduler, step by step, through ``tests/support/scheduler_harness.py``.
Comparisons with and without HiSparse give both the same KV cache memory.
The harness plays the worker's part of the residency protocol: it reports every
copy of a step's plan as done. No model runs and no bytes move, so these tests
check the plans and the bookkeeping; the worker side (copies, resolver, tokens)
is checked end to end elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import tiny_models
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import HISPARSE, SchedulerHarness, record_host_lookups, tiny_glm5_dir

from vllm.v1.core.kv_cache_utils import get_block_hash
from vllm.v1.hisparse.plan import HISPARSE_PLAN_VERSION
from vllm.v1.hisparse.residency import PageState

BLOCK = 64
NULL_BLOCK_ID = 0
MLA_GROUPS = 6
MiB = 1 << 20
SIX_LAYERS = tiny_models.TinyModelSpec(arch="glm5", index_topk=32, num_hidden_layers=6)


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_glm5_dir(SIX_LAYERS))


def harness(model: str, memory_mib: float, attention_config=HISPARSE, **kwargs) -> SchedulerHarness:
    return SchedulerHarness.create(
        model=model, memory_bytes=int(memory_mib * MiB), attention_config=attention_config, **kwargs
    )


def hisparse_config(**fields) -> dict:
    return {"hisparse_config": {**HISPARSE["hisparse_config"], **fields}}


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 10 for i in range(length)]


def check_block_accounting(h: SchedulerHarness) -> None:
    """Every block reference is owned once: block tables, hot leases, held copies, staging
    (a plan's in flight, or spare for the next step's takes), held histories."""
    expected: Counter[int] = Counter()
    managers = h.kv_cache_manager.coordinator.single_type_managers
    for manager in managers:
        for blocks in manager.req_to_blocks.values():
            expected.update(b.block_id for b in blocks if not b.is_null)
    residency = h.hisparse.residency
    expected.update(residency.leased_blocks())
    expected.update(residency.held_blocks())
    expected.update(h.hisparse.staging_blocks())
    expected.update(h.hisparse.histories.held_references())
    for block in h.block_pool.blocks:
        if block.is_null:
            continue
        assert block.ref_cnt == expected[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, owners {expected[block.block_id]}"
        )
    residency.check()


def run_checked(h: SchedulerHarness, max_steps: int = 400):
    observations = []
    for _ in range(max_steps):
        if not h.busy():
            return observations
        observations.append(h.step())
        check_block_accounting(h)
    raise AssertionError(f"unfinished after {max_steps} steps: {h.unfinished()}")


def states_seen(observations) -> set[str]:
    return {state for o in observations for state in o.hisparse_states.values()}


def test_no_pressure_keeps_every_request_full_and_copies_ahead(model):
    h = harness(model, 64)
    for i in range(3):
        h.add_request(prompt(i, 300), max_tokens=40)
    observations = run_checked(h)
    stats = observations[-1].hisparse_stats
    assert states_seen(observations) == {"full"}
    assert stats["pages_demoted"] == 0 and stats["hot_leases"] == 0
    assert h.total_preemptions == 0
    # Proactive copies: every completed page went to the host while served from the GPU.
    assert stats["pages_copied_to_host"] == 3 * (340 // BLOCK)
    for o in observations:
        plan = o.hisparse_plan
        assert not plan.block_table_updates and not plan.host_pages and not plan.leases and not plan.staging


def test_proactive_copies_keep_pace_with_a_whole_token_budget_of_prefill(model):
    """A step that prefills max_num_batched_tokens completes that many tokens' pages; the
    step's copy budget covers them and a backlog besides, so when a long prompt's prefill
    ends no more than one step's pages wait for their copy (a turn that ends with pages
    never copied loses them to the device's eviction, and its next turn recomputes them)."""
    budget = 8192
    long_model = str(tiny_glm5_dir(dataclasses.replace(SIX_LAYERS, max_position_embeddings=4 * budget)))
    h = harness(long_model, 512, max_model_len=4 * budget, max_num_batched_tokens=budget)
    request = h.add_request(prompt(1, 3 * budget + 100), max_tokens=2).request_id
    while not h.observations or h.requests[request].num_output_tokens == 0:
        h.step()
    pages_per_step = budget // BLOCK
    uncopied = len(h.hisparse.residency.requests[request].uncopied)
    assert uncopied <= pages_per_step, f"{uncopied} complete pages wait for a copy after the prefill"
    run_checked(h)


def test_pressure_turns_requests_mixed_instead_of_preempting_and_runs_more_of_them(model):
    def run(attention_config):
        h = harness(model, 20, attention_config)
        for i in range(8):
            h.add_request(prompt(i, 512), max_tokens=64)
        observations = run_checked(h) if attention_config else h.run_until_done()
        return h, observations

    _, base_obs = run(None)
    hisparse, obs = run(HISPARSE)
    stats = obs[-1].hisparse_stats
    assert "mixed" in states_seen(obs)
    assert stats["pages_demoted"] > 0 and stats["hot_leases"] > 0
    assert stats["host_pages_used"] == 0, "finished requests return their host references"
    assert hisparse.total_preemptions == 0, "the host pool had room, so nobody was preempted"
    assert stats["preemptions_avoided"] > 0
    most_running = max(o.num_running for o in obs)
    assert most_running == 8
    assert most_running > max(o.num_running for o in base_obs)
    mean = sum(o.num_running for o in obs) / len(obs)
    base_mean = sum(o.num_running for o in base_obs) / len(base_obs)
    assert mean > base_mean
    assert len(obs) < len(base_obs)


def test_the_cached_token_estimate_scans_only_the_tail_and_equals_a_full_scan(model):
    """Patch 0007's `estimate_cached_tokens` reads each group's blocks from the end and stops
    where no earlier block can cover more tokens; under pressure (null placeholders for HOST
    pages, a later turn's device hit) it equals the scan of every block."""
    h = harness(model, 20)
    manager = h.kv_cache_manager

    def full_scan(request) -> int:
        per_group = [
            max((b.block_hash_num_tokens or 0 for b in blocks), default=0)
            for blocks in manager.get_blocks(request.request_id).blocks
        ]
        return min(per_group, default=0)

    requests = [h.add_request(prompt(i, 512), max_tokens=64) for i in range(8)]
    checked = set()
    while h.busy():
        obs = h.step()
        check_block_accounting(h)
        for request in requests:
            live = h.scheduler.requests.get(request.request_id)
            if live is not None and manager.get_blocks(request.request_id).blocks[0]:
                assert manager.estimate_cached_tokens(live) == full_scan(live)
                checked.add(obs.hisparse_states.get(request.request_id))
    assert {"full", "mixed"} <= checked


def test_demotion_plans_null_block_updates_and_host_page_deltas_for_the_resolver(model):
    h = harness(model, 20)
    for i in range(8):
        h.add_request(prompt(i, 512), max_tokens=64)
    demoted_seen = False
    leased: set[str] = set()
    for _ in range(400):
        if not h.scheduler.has_requests():
            break
        observation = h.step()
        plan = observation.hisparse_plan
        assert plan.version == HISPARSE_PLAN_VERSION and plan.mla_group_ids == tuple(range(MLA_GROUPS))
        for update in plan.block_table_updates:
            assert update.block_ids == (NULL_BLOCK_ID,) * len(plan.mla_group_ids)
        for lease in plan.leases:
            assert lease.request_id not in leased, "a lease crosses once"
            leased.add(lease.request_id)
            assert len(lease.block_ids) == MLA_GROUPS and all(len(ids) == 1 for ids in lease.block_ids)
        for run in plan.host_pages:
            assert run.request_id in leased, "a request with HOST pages has its lease"
            req = h.hisparse.residency.requests.get(run.request_id)
            if req is None:
                continue  # ended after the plan was made
            demoted_seen = True
            for page_index, host_page in run.pages():
                assert req.pages[page_index].host_page == host_page
                for group_id in plan.mla_group_ids:
                    table = h.kv_cache_manager.coordinator.single_type_managers[group_id].req_to_blocks
                    assert table[run.request_id][page_index].is_null
        for copy in plan.copies:
            assert len(copy.block_ids) == MLA_GROUPS
    assert demoted_seen


def test_copies_reported_a_step_late_stay_in_flight_and_none_is_cancelled(model):
    # A CUDA worker reports a copy once the event recorded after it has passed, a step
    # or more after the step that planned it: until then the page is still in flight.
    h = harness(model, 20, report_delay=1)
    for i in range(8):
        h.add_request(prompt(i, 512), max_tokens=64)
    obs = run_checked(h)
    stats = obs[-1].hisparse_stats
    assert all(req.num_output_tokens == 64 for req in h.requests.values())
    assert stats["copies_cancelled"] == 0 and stats["pages_demoted"] > 0 and h.total_preemptions == 0
    assert max(o.hisparse_stats["copies_in_flight"] for o in obs) > 0, "copies outlived their step"
    # The engine kept stepping after the last request finished until the last step's
    # copies were reported (a plan without work of its own carries them back).
    last_request_step = max(o.step for o in obs if o.finished)
    assert obs[-1].step > last_request_step and not obs[-1].num_scheduled_tokens
    assert stats["copies_in_flight"] == 0
    assert not h.hisparse.residency.held_blocks(), "blocks held for those copies return once reported"


def test_a_context_larger_than_the_gpu_pool_is_admitted_and_runs(model):
    config = dict(max_model_len=1280, max_num_batched_tokens=256)
    memory_mib = 5
    with pytest.raises(ValueError, match="max seq len"):
        harness(model, memory_mib, None, **config)  # without HiSparse the engine refuses to start

    h = harness(model, memory_mib, **config)
    pages_needed = -(-(1000 + 16) // BLOCK)
    assert (MLA_GROUPS + 1) * pages_needed > h.kv_cache_config.num_blocks, "the context cannot fit"
    rid = h.add_request(prompt(1, 1000), max_tokens=16).request_id
    obs = run_checked(h)
    assert h.requests[rid].num_output_tokens == 16
    assert "mixed" in states_seen(obs)
    assert obs[-1].hisparse_stats["pages_demoted"] > 0
    assert h.total_preemptions == 0
    assert sum(o.num_scheduled_tokens.get(rid, 0) for o in obs) == 1000 + 15, "nothing recomputed"


def a_prefix_only_the_host_pool_holds(model: str):
    """A finished request's 640-token prefix (ten pages) whose sparse-MLA blocks churn has
    evicted from the device prefix cache; its indexer blocks are still cached there, and
    the host pool holds its pages. (harness, the prefix, the finished request)"""
    h = harness(model, 64)
    shared = prompt(3, 640)
    first = h.add_request(shared + prompt(4, 20), max_tokens=8)
    h.step()
    mla_blocks = {b for g in range(MLA_GROUPS) for b in h.block_ids(first.request_id)[g]}
    run_checked(h)
    assert h.hisparse.stats()["pages_copied_to_host"] == 10
    h.kv_cache_manager.evict_blocks(mla_blocks)
    return h, shared, first


def test_a_walks_batched_prefix_cache_lookups_equal_page_by_page_ones(model, monkeypatch):
    """`KVCacheBlockAccess.pages_cached`, the walk's lookup of many pages at once, finds what
    `page_lookup` finds page by page, in the sparse-MLA groups (six here, one page evicted
    from only some of them) and the indexer's; like it, a group is not asked for a page an
    earlier group lacks (and no group lacks a page: no group is asked)."""
    h, _, first = a_prefix_only_the_host_pool_holds(model)
    blocks = h.hisparse.blocks
    # A second request's prefix, cached in every group, then evicted from the last three
    # sparse-MLA groups for one page: it is cached in some groups, not all.
    second = h.add_request(prompt(7, 640) + prompt(8, 20), max_tokens=8)
    h.step()
    partly = {h.block_ids(second.request_id)[g][3] for g in blocks.mla_group_ids[3:]}
    run_checked(h)
    h.kv_cache_manager.evict_blocks(partly)
    hashes = [*first.block_hashes[:10], *second.block_hashes[:10], *first.block_hashes[10:12]]
    prefix_cache = h.block_pool.cached_block_hash_to_block
    get_one_block, asked = prefix_cache.get_one_block, []

    def counted_get_one_block(key):
        asked.append(key)
        return get_one_block(key)

    monkeypatch.setattr(prefix_cache, "get_one_block", counted_get_one_block)
    for group_ids in (blocks.mla_group_ids, blocks.other_group_ids, ()):
        asked.clear()
        one_by_one = [blocks.page_lookup(group_ids)(block_hash) for block_hash in hashes]
        asked_one_by_one = sorted(asked)
        asked.clear()
        assert blocks.pages_cached(group_ids, hashes) == one_by_one
        assert sorted(asked) == asked_one_by_one, "the same groups asked for the same pages"
    found = blocks.pages_cached(blocks.mla_group_ids, hashes)
    assert found[:10] == [None] * 10 and found[13] is None, "evicted from every group, or from some"
    assert all(found[10 + i] is not None for i in (0, 1, 2, 4)), "cached in every group"
    assert all(b is not None for b in blocks.pages_cached(blocks.other_group_ids, hashes[:20]))


def test_a_prefix_only_the_host_pool_holds_starts_the_next_request_none(model):
    h, shared, _ = a_prefix_only_the_host_pool_holds(model)
    second = h.add_request(shared + prompt(5, 30), max_tokens=8)
    obs = run_checked(h)
    admitted = obs[0]
    assert admitted.new_request_cached_tokens[second.request_id] == 640
    assert admitted.num_scheduled_tokens[second.request_id] == 30, "the host-only prefix is not recomputed"
    assert admitted.hisparse_states[second.request_id] == "none"
    stats = obs[-1].hisparse_stats
    assert stats["host_prefix_pages_reused"] == 10 and stats["hot_leases"] == 1
    assert h.total_preemptions == 0
    runs = [u for u in admitted.hisparse_plan.host_pages if u.request_id == second.request_id]
    assert len(runs) == 1, "the hit's pages cross as one run"
    assert [index for index, _ in runs[0].pages()] == list(range(10))


def test_a_host_prefix_hit_without_room_for_its_lease_ends_at_its_first_host_page(model, monkeypatch):
    """A waiting request whose hit reaches host copies but finds no room for a hot lease,
    here one the pool could not hold even empty, recomputes its prefix. Its walk stops at
    the first host page (a turn waiting for room does not look its whole history up every
    step), it holds no host reference, and the copies it wanted become the host pool's most
    recently used, in page order (as if taken and given back), so they outlast the others
    while it waits."""
    h, shared, first = a_prefix_only_the_host_pool_holds(model)
    pool = h.hisparse.residency.host_pool
    wanted = [pool.lookup(block_hash) for block_hash in first.block_hashes[:10]]
    assert None not in wanted and pool.num_referenced == 0
    pool.touch(reversed(wanted))
    admissions = h.hisparse.admissions
    monkeypatch.setattr(admissions, "_lease_blocks_for", lambda request: h.block_pool.num_gpu_blocks + 1)
    extend, after_hit = admissions.extend_prefix_hit, []
    prefix_cache = h.block_pool.cached_block_hash_to_block
    get_one_block, lookups = prefix_cache.get_one_block, Counter()

    def counted_get_one_block(key):
        lookups[get_block_hash(key)] += 1
        return get_one_block(key)

    def observed_extend(request, device_hit, num_tokens):
        hit = extend(request, device_hit, num_tokens)
        after_hit.append((hit[1], sum(admissions.host_references().values()), list(pool._evictable)))
        return hit

    h.add_request(prompt(9, 100), max_tokens=50)  # one runs: the hit is not capped
    h.step()
    monkeypatch.setattr(prefix_cache, "get_one_block", counted_get_one_block)
    monkeypatch.setattr(admissions, "extend_prefix_hit", observed_extend)
    second = h.add_request(shared + prompt(5, 30), max_tokens=8)
    admitted = h.step()
    assert admitted.new_request_cached_tokens[second.request_id] == 0, "no lease: recomputed"
    assert admitted.hisparse_states[second.request_id] == "full"
    ((hit_tokens, referenced, evictable),) = after_hit
    assert hit_tokens == 0 and referenced == 0, "the failed hit holds no host page"
    assert evictable[-len(wanted) :] == wanted
    walked = set(lookups) & set(second.block_hashes)
    assert walked == {second.block_hashes[0]}, "the walk ends at the first host page"
    assert h.hisparse.stats()["host_hits_without_lease"] == 1
    run_checked(h)


def a_next_turn_behind_runners_that_fill_the_pool(model: str, history_tokens: int, turn_tokens: int):
    """A finished request's prefix only the host pool holds (its sparse-MLA blocks evicted
    from the device prefix cache, its indexer blocks still cached), eight requests that fill
    the device pool and cannot be demoted (a hot buffer as large as their contexts), then
    the next turn of that prefix with `turn_tokens` new tokens, and one more request behind
    it. (harness, the next turn, the one behind)"""
    h = harness(model, 64, hisparse_config(device_buffer_size=1024), max_num_batched_tokens=256)
    shared = prompt(3, history_tokens)
    first = h.add_request(shared + prompt(4, 20), max_tokens=8)
    h.step()
    mla_blocks = {b for g in range(MLA_GROUPS) for b in h.block_ids(first.request_id)[g]}
    run_checked(h)
    h.kv_cache_manager.evict_blocks(mla_blocks)
    for i in range(8):
        h.add_request(prompt(20 + i, 950), max_tokens=40)
    for _ in range(8):
        h.step()
    turn = h.add_request(shared + prompt(5, turn_tokens), max_tokens=8)
    behind = h.add_request(prompt(6, 40), max_tokens=4)
    return h, turn, behind


def test_a_turn_without_room_for_its_lease_waits_for_it_while_others_run(model):
    """The next turn of a session whose history the host pool holds finds no room for a hot
    lease while other requests fill the pool. It waits for room instead of recomputing the
    history (which would take the blocks of every page again and preempt a runner), and no
    request behind it is admitted meanwhile; when runners finish, it is admitted with the
    whole history as its hit and computes only its new tokens."""
    h, turn, behind = a_next_turn_behind_runners_that_fill_the_pool(model, 640, 30)
    observations = run_checked(h)
    admitted = next(o for o in observations if turn.request_id in o.num_scheduled_tokens)
    waited = observations[: observations.index(admitted)]
    assert admitted.new_request_cached_tokens[turn.request_id] == 640, "the whole history is the hit"
    assert admitted.num_scheduled_tokens[turn.request_id] == 30
    assert admitted.hisparse_states[turn.request_id] == "none"
    assert all(behind.request_id not in o.num_scheduled_tokens for o in waited)
    # Each step it was tried, it waited (counted once as a try without a lease).
    waits = [o.hisparse_stats["lease_waits"] for o in waited]
    assert waits[-1] >= 2 and waits == [o.hisparse_stats["host_hits_without_lease"] for o in waited]
    assert admitted.hisparse_stats["lease_waits"] == waits[-1]
    assert h.total_preemptions == 0
    assert turn.num_output_tokens == 8 and behind.num_output_tokens == 4


def test_a_turn_waiting_for_its_lease_looks_its_history_up_in_the_host_pool_once(model, monkeypatch):
    """The turn of `test_a_turn_without_room_for_its_lease_waits_for_it_while_others_run`
    walks its history every step it waits. With no host page evicted meanwhile, the copies
    its first walk found are still the pool's: later walks look up only the first page (where
    the lease is tried) and the one past the copies (a copy published since would lengthen
    the run), not every page again. The outcome is the same."""
    h, turn, behind = a_next_turn_behind_runners_that_fill_the_pool(model, 640, 30)
    pool = h.hisparse.residency.host_pool
    looked_up = record_host_lookups(monkeypatch, pool)
    walks, evictions = [], pool.evictions
    while turn.request_id not in h.hisparse.residency.requests:
        before = looked_up.copy()
        observation = h.step()
        walks.append({h_: n - before[h_] for h_, n in looked_up.items() if n > before[h_]})
        check_block_accounting(h)
    assert pool.evictions == evictions, "no host page was evicted while the turn waited"
    waited = observation.hisparse_stats["lease_waits"]
    assert waited >= 2, f"the turn waited {waited} steps"
    history = turn.block_hashes[:10]  # 640 tokens: ten pages, all in the host pool
    first_walk, *later_walks = [w for w in walks if history[0] in w]
    assert set(history) <= set(first_walk), "the first walk finds every copy"
    for walk in later_walks[: waited - 1]:
        assert set(walk) & set(history) == {history[0]}, f"a later walk looked up {len(walk)} pages again"
    assert observation.new_request_cached_tokens[turn.request_id] == 640, "the whole history is the hit"
    run_checked(h)
    assert turn.num_output_tokens == 8 and behind.num_output_tokens == 4


def test_a_turn_whose_lease_would_not_halve_its_prefill_recomputes_instead_of_waiting(model):
    """A turn with more new tokens (400) than its history holds (320): the lease would save
    less than half its prefill, so the turn does not wait for it. It recomputes the history
    with its new tokens as soon as vLLM finds blocks for its first chunk."""
    h, turn, _ = a_next_turn_behind_runners_that_fill_the_pool(model, 320, 400)
    observations = run_checked(h)
    admitted = next(o for o in observations if turn.request_id in o.num_scheduled_tokens)
    assert admitted.new_request_cached_tokens[turn.request_id] == 0, "recomputed"
    stats = observations[-1].hisparse_stats
    assert stats["lease_waits"] == 0 and stats["host_hits_without_lease"] > 0
    assert turn.num_output_tokens == 8


def test_a_lone_turn_without_a_lease_recomputes_instead_of_waiting(model, monkeypatch):
    """With no other request running, nothing would make room for a lease the turn waited
    for: a turn whose lease fails then recomputes its history at once."""
    h, shared, _ = a_prefix_only_the_host_pool_holds(model)
    monkeypatch.setattr(h.hisparse.admissions, "_take_lease", lambda request: [])
    turn = h.add_request(shared + prompt(5, 30), max_tokens=8)
    admitted = h.step()
    assert admitted.new_request_cached_tokens[turn.request_id] == 0, "recomputed"
    assert admitted.hisparse_stats["host_hits_without_lease"] == 1
    assert admitted.hisparse_stats["lease_waits"] == 0
    run_checked(h)


def test_without_a_device_copy_of_the_indexer_cache_the_prefix_is_recomputed(model):
    h = harness(model, 64)
    shared = prompt(3, 640)
    h.add_request(shared + prompt(4, 20), max_tokens=8)
    run_checked(h)
    h.kv_cache_manager.reset_prefix_cache()
    second = h.add_request(shared + prompt(5, 30), max_tokens=8)
    obs = run_checked(h)
    assert obs[0].new_request_cached_tokens[second.request_id] == 0
    assert states_seen(obs) == {"full"}


def test_always_mode_demotes_without_pressure(model):
    h = harness(model, 64, hisparse_config(mode="always"))
    for i in range(2):
        h.add_request(prompt(i, 400), max_tokens=80)
    hybrid = harness(model, 64)
    for i in range(2):
        hybrid.add_request(prompt(i, 400), max_tokens=80)
    obs = run_checked(h)
    hybrid_obs = run_checked(hybrid)
    stats = obs[-1].hisparse_stats
    # Every complete page but the resident tail's last one.
    assert stats["pages_demoted"] == 2 * ((400 + 79) // BLOCK - 1)
    assert "none" in states_seen(obs), "everything but the tail leaves the device"
    assert h.total_preemptions == 0
    assert hybrid_obs[-1].hisparse_stats["pages_demoted"] == 0
    # Demoted pages leave the device: more of the pool stays free than when resident.
    assert min(o.num_free_blocks for o in obs) > min(o.num_free_blocks for o in hybrid_obs)


def test_aborting_mid_copy_holds_the_blocks_until_the_copy_lands(model):
    h = harness(model, 64)
    request = h.add_request(prompt(2, 300), max_tokens=20)
    scheduler_output = h.schedule()
    copies = scheduler_output.hisparse_plan.copies
    assert len(copies) == 4
    from vllm.v1.request import RequestStatus

    h.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    held = set(h.hisparse.residency.held_blocks())
    assert held == {b for c in copies for b in c.block_ids}
    assert all(h.block_pool.blocks[b].ref_cnt == 1 for b in held), "the worker still reads them"
    check_block_accounting(h)
    h.scheduler.update_from_output(scheduler_output, h.model_runner_output(scheduler_output))
    assert not h.hisparse.residency.held_blocks()
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1
    assert h.hisparse.stats()["host_pages_used"] == 0
    check_block_accounting(h)


def test_a_worker_that_runs_no_plans_leaves_every_page_resident(model):
    h = harness(model, 20, runs_hisparse_plans=False)
    for i in range(8):
        h.add_request(prompt(i, 512), max_tokens=64)
    obs = run_checked(h)
    stats = obs[-1].hisparse_stats
    assert stats["pages_copied_to_host"] == 0 and stats["pages_demoted"] == 0
    assert stats["copies_cancelled"] > 0 and stats["host_pages_used"] == 0
    assert not h.hisparse.issue_plans
    assert states_seen(obs) == {"full"}
    assert max(o.num_running for o in obs) < 8, "without the worker side nothing makes room"


@pytest.mark.parametrize("mode", ["hybrid", "always"])
def test_preempting_a_mixed_request_keeps_its_host_pages_for_resumption(model, mode):
    # A pool too small for five growing requests even with their pages demoted:
    # preemption stays the last resort, and a preempted request resumes from the
    # host copies of its pages instead of recomputing them.
    h = harness(model, 3.5, hisparse_config(mode=mode), max_model_len=1024, max_num_batched_tokens=128)
    for i in range(5):
        h.add_request(prompt(i, 400), max_tokens=150)
    obs = run_checked(h, max_steps=3000)
    assert all(req.num_output_tokens == 150 for req in h.requests.values())
    stats = obs[-1].hisparse_stats
    assert h.total_preemptions > 0
    assert stats["host_prefix_pages_reused"] > 0
    assert stats["host_pages_used"] == 0 and stats["hot_leases"] > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    memory_mib=st.sampled_from([4, 6, 10, 24]),
    mode=st.sampled_from(["hybrid", "always"]),
    proactive=st.booleans(),
    workload=st.lists(
        st.tuples(st.integers(0, 2), st.integers(40, 500), st.integers(1, 90), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    abort_at=st.integers(0, 40),
)
def test_random_workloads_keep_every_block_owned_once_and_return_everything(
    model, memory_mib, mode, proactive, workload, abort_at
):
    """Random requests (shared prefixes, lengths, aborts) under random pools, checked every step."""
    from vllm.v1.request import RequestStatus

    h = harness(
        model,
        memory_mib,
        hisparse_config(mode=mode, proactive_copy=proactive),
        max_model_len=1024,
        max_num_batched_tokens=128,
    )
    to_abort = []
    for i, (prefix, length, max_tokens, abort) in enumerate(workload):
        request = h.add_request(prompt(100 + prefix, 256) + prompt(i, length), max_tokens=max_tokens)
        if abort:
            to_abort.append(request.request_id)
    for step in range(3000):
        if not h.scheduler.has_requests():
            break
        if step == abort_at and to_abort:
            h.scheduler.finish_requests(to_abort, RequestStatus.FINISHED_ABORTED)
        h.step()
        check_block_accounting(h)
    assert not h.scheduler.has_requests()
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1, "every block returns"
    residency = h.hisparse.residency
    assert not residency.requests and not residency.held_blocks()
    assert residency.host_pool.num_referenced == 0, "every host reference returns"


def first_turn_moved_to_the_host(h: SchedulerHarness) -> list[int]:
    """Run a first turn over a 640-token prompt, then leave its sparse-MLA pages on the host
    only; the shared prompt, for a second turn that starts NONE from it."""
    shared = prompt(3, 640)
    first = h.add_request(shared + prompt(4, 20), max_tokens=8)
    h.step()
    mla_blocks = {b for g in range(MLA_GROUPS) for b in h.block_ids(first.request_id)[g]}
    run_checked(h)
    h.kv_cache_manager.evict_blocks(mla_blocks)
    return shared


def test_a_chunk_whose_staging_left_no_room_for_its_blocks_runs_next_without_staging(model, monkeypatch):
    # Staging is leased before a waiting request's blocks are allocated, from an estimate
    # of them. If that estimate misses (the allocation refuses the request once, as a pool
    # short of upstream's admission headroom would), the staging goes back and the
    # request's next chunk takes none, so it runs instead of failing the same way again.
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    allocate_slots = KVCacheManager.allocate_slots
    refused: list[str] = []

    def refuse_once_after_staging(self, request, *args, **kwargs):
        if not refused and request.request_id in self.pressure_relief.__self__._staging:
            refused.append(request.request_id)
            return None
        return allocate_slots(self, request, *args, **kwargs)

    h = harness(model, 64)
    shared = first_turn_moved_to_the_host(h)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", refuse_once_after_staging)
    second = h.add_request(shared + prompt(5, 30), max_tokens=8).request_id
    refused_step = h.step()
    assert refused == [second] and second not in refused_step.num_scheduled_tokens
    assert not h.hisparse.staging_blocks(), "the refused chunk's staging went back"
    admitted = h.step()
    assert admitted.num_scheduled_tokens[second] == 30 and admitted.hisparse_states[second] == "none"
    assert not admitted.hisparse_plan.staging, "the next chunk took no staging"
    run_checked(h)
    assert h.requests[second].num_output_tokens == 8


@pytest.mark.parametrize("memory_mib", [256, 16])
def test_a_chunk_stages_what_it_may_select_from_free_blocks_beyond_its_budget(model, memory_mib):
    # A 30-token chunk over a 640-token host-only prefix may select all 640 host rows; its
    # hot buffer holds 64 and the budget stages 64 more. Blocks the pool has free beyond
    # the step's reserve stage the rest (no passes); only a pool without them (16 MiB
    # here) leaves the chunk its budget and passes.
    h = harness(model, memory_mib)
    shared = first_turn_moved_to_the_host(h)
    second = h.add_request(shared + prompt(5, 30), max_tokens=8).request_id
    admitted = h.step()
    assert admitted.num_scheduled_tokens[second] == 30 and admitted.hisparse_states[second] == "none"
    (staging,) = admitted.hisparse_plan.staging
    hot_rows, budget = 2 * SIX_LAYERS.index_topk, h.hisparse.staging_budget
    selectable = 640 - hot_rows
    if memory_mib == 256:
        assert staging.num_slots == selectable > budget, "free blocks staged every selectable row"
    else:
        assert budget <= staging.num_slots < selectable, "no free blocks beyond the reserve: the budget"
    run_checked(h)
    assert h.requests[second].num_output_tokens == 8


def test_without_proactive_copies_pressure_waits_for_the_copies_instead_of_preempting(model):
    # Nothing is on the host when the pool runs short: relief marks pages for
    # copy-then-free, and the scheduler waits a step for the copies to land.
    h = harness(
        model, 4, hisparse_config(proactive_copy=False), max_model_len=1024, max_num_batched_tokens=128
    )
    rid = h.add_request(prompt(100, 256) + prompt(0, 104), max_tokens=90).request_id
    obs = run_checked(h)
    assert h.requests[rid].num_output_tokens == 90
    assert h.total_preemptions == 0
    assert any(not o.num_scheduled_tokens and o.hisparse_plan.copies for o in obs), "a copy-only step"
    assert obs[-1].hisparse_stats["pages_demoted"] > 0


def test_the_step_plan_pickles_to_an_equal_plan_of_plain_values(model):
    import pickle

    h = harness(model, 20)
    for i in range(8):
        h.add_request(prompt(i, 512), max_tokens=64)
    plans = [h.step().hisparse_plan for _ in range(6)]
    busiest = max(plans, key=lambda p: len(p.copies) + len(p.block_table_updates) + len(p.host_pages))
    assert busiest.copies and busiest.block_table_updates and busiest.host_pages
    data = pickle.dumps(busiest)
    assert pickle.loads(data) == busiest
    # Plain values only: nothing of the scheduler (blocks, requests) rides along.
    entries = len(busiest.copies) + len(busiest.block_table_updates) + len(busiest.host_pages)
    assert len(data) < 400 * entries


def test_a_full_host_pool_falls_back_to_preemption_and_loses_nothing(model):
    # Twelve host pages for four requests of ten pages: the host pool fills, nothing more
    # can be demoted, and the scheduler preempts as it would without HiSparse.
    page_gib = MLA_GROUPS * BLOCK * 576 * 2 / (1 << 30)  # bf16 latent rows of six layers
    config = hisparse_config(host_pool_gib=12.5 * page_gib)
    h = harness(model, 6, config, max_model_len=640, max_num_batched_tokens=128)
    assert h.hisparse.residency.host_pool.num_pages == 12
    for i in range(4):
        h.add_request(prompt(i, 400), max_tokens=200)
    obs = run_checked(h, max_steps=3000)
    assert all(req.num_output_tokens == 200 for req in h.requests.values())
    assert max(o.hisparse_stats["host_pages_used"] for o in obs) == 12, "the host pool filled up"
    assert h.total_preemptions > 0
    assert obs[-1].hisparse_stats["host_pages_used"] == 0


def test_a_finished_sessions_indexer_pages_outlive_pages_the_host_pool_already_holds(model):
    """Under pressure the device evicts prefix-cache blocks oldest first. A finished
    request's sparse-MLA pages whose copies the host pool holds are worth nothing on the
    device that the pool cannot give back, while its indexer pages exist nowhere else
    (without a connector): they go to the front of the eviction order. A's session ends,
    then C's; B's allocation then evicts C's host-backed sparse-MLA blocks, not A's indexer
    pages, so A's next turn starts from the host pool instead of recomputing."""
    h = SchedulerHarness.create(model=model, num_blocks=101, attention_config=HISPARSE, max_model_len=768)
    first = prompt(1, 640)
    h.add_request(first, max_tokens=1, request_id="A1")
    h.run_until_done()
    h.add_request(prompt(2, 640), max_tokens=1, request_id="C1")
    h.run_until_done()
    h.add_request(prompt(3, 448), max_tokens=1, request_id="B1")
    h.run_until_done()
    second = [*first, *h.requests["A1"].output_token_ids, *prompt(4, 60)]
    h.add_request(second, max_tokens=2, request_id="A2")
    h.step()
    started = h.observations[-1].new_request_cached_tokens.get("A2")
    assert started == len(first), f"A2 started at token {started}, not after A1's {len(first) // BLOCK} pages"
    run_checked(h)


@pytest.mark.parametrize("mode", ["hybrid", "always"])
def test_a_released_requests_host_backed_blocks_lead_the_eviction_order_under_pressure(model, mode):
    """Under pressure, a released request's BOTH pages' sparse-MLA blocks go to the front of
    the pool's eviction order once it is freed, in page order, ahead of its own uncached
    blocks and every older cached block; each release under pressure is checked against the
    free queue as upstream's free left it."""
    h = harness(model, 3.5, hisparse_config(mode=mode), max_model_len=1024, max_num_batched_tokens=128)
    hisparse = h.hisparse
    expected: list[int] = []
    checked = []
    release, after_free = hisparse.release, hisparse.after_free

    def recording_release(request):
        req = hisparse.residency.requests.get(request.request_id)
        pool = hisparse.blocks.pool_blocks()
        expected[:] = [
            b
            for page in (req.pages if req is not None else ())
            if page.state is PageState.BOTH
            for b in page.block_ids
            if pool[b].ref_cnt == 1
        ]
        release(request)

    def checking_after_free():
        before = hisparse.blocks_evicted_first
        after_free()
        if hisparse.blocks_evicted_first > before:
            front = hisparse.blocks.free_queue_ids()[: len(expected)]
            assert front == expected, f"the free queue starts {front}, not the released BOTH blocks"
            checked.append(len(expected))

    hisparse.release, hisparse.after_free = recording_release, checking_after_free
    for i in range(5):
        h.add_request(prompt(i, 400), max_tokens=150)
    run_checked(h, max_steps=3000)
    assert checked and all(checked), "no release under pressure moved its host-backed blocks"


def test_a_device_prefix_hit_whose_pages_the_host_pool_holds_is_not_copied_again(model):
    """A session's next turn finds its history on the device (no pressure) and runs FULL.
    The host pool still holds the copies the first turn made: the hit's pages are BOTH at
    once, with those copies, and only the turn's new pages cross to the host."""
    h = harness(model, 64)
    first = prompt(1, 640)
    h.add_request(first, max_tokens=1, request_id="A1")
    h.run_until_done()
    copied = h.hisparse.stats()["pages_copied_to_host"]
    assert copied == len(first) // BLOCK
    second = [*first, *h.requests["A1"].output_token_ids, *prompt(2, 200)]
    h.add_request(second, max_tokens=2, request_id="A2")
    observations = run_checked(h)
    assert observations[0].new_request_cached_tokens["A2"] == len(first), "a device prefix hit"
    copies = [c for o in observations if o.hisparse_plan for c in o.hisparse_plan.copies]
    assert all(c.page_index >= len(first) // BLOCK for c in copies), "a page the pool holds was copied again"
    assert h.hisparse.stats()["pages_copied_to_host"] - copied == len(copies) == (len(second) // BLOCK) - 10
    assert h.hisparse.stats()["copies_avoided"] == len(first) // BLOCK


def test_a_chunk_restores_its_host_pages_when_the_pool_has_room_for_them(model):
    # A long prompt's early pages move to the host under pressure (relief, as an allocation
    # short of blocks calls it). Its next chunk (64 tokens x top-K 32 may select every host
    # row) finds the pool with room for them, so it restores them instead of staging: new
    # blocks in its table, filled from their host copies before the forward, each page BOTH
    # (durable at once); the request is FULL again and its hot lease goes back.
    h = harness(model, 64, max_model_len=2048, max_num_batched_tokens=64)
    rid = h.add_request(prompt(2, 1200), max_tokens=4).request_id
    for _ in range(8):
        h.step()
        check_block_accounting(h)
    h.hisparse._relieve(4 * MLA_GROUPS)
    req = h.hisparse.residency.requests[rid]
    host = {i: page.host_page for i, page in enumerate(req.pages) if page.block_ids is None}
    assert host and req.hot_blocks, "its early pages are on the host only, with a hot lease"
    o = h.step()
    check_block_accounting(h)
    assert o.num_scheduled_tokens[rid] == 64 and o.hisparse_states[rid] == "full"
    assert not o.hisparse_plan.staging, "restored instead of staged"
    restores = {r.page_index: r for r in o.hisparse_plan.restores}
    assert {i: r.host_page for i, r in restores.items()} == host
    tables = h.block_ids(rid)
    for i, restore in restores.items():
        assert restore.block_ids == tuple(tables[g][i] for g in range(MLA_GROUPS)), "the table holds them"
        assert req.pages[i].state.name == "BOTH" and req.pages[i].block_ids == restore.block_ids
    updates = [page for u in o.hisparse_plan.host_pages if u.request_id == rid for page in u.pages()]
    assert updates[-len(host) :] == [(index, -1) for index in sorted(host)], (
        "the workers' map drops them, after the demotion that put them there"
    )
    points = {u.position: u.block_ids for u in o.hisparse_plan.block_table_updates}
    assert all(points[i] == tuple(tables[g][i] for g in range(MLA_GROUPS)) for i in host)
    assert not req.hot_blocks and o.hisparse_stats["hot_lease_blocks"] == 0, "its lease went back"
    assert o.hisparse_stats["prefill_restores"] == 1
    assert o.hisparse_stats["pages_restored_for_prefill"] == len(host)
    obs = run_checked(h)
    assert all(not x.hisparse_plan.staging and not x.hisparse_plan.restores for x in obs)
    assert h.requests[rid].num_output_tokens == 4
    assert h.hisparse.residency.host_pool.num_referenced == 0


def test_a_chunk_stages_when_the_pool_has_no_room_for_its_host_pages(model):
    # The same chunk in a pool without the blocks for its host pages beyond the step's
    # reserve: it stages, as before, and nothing is restored.
    h = harness(model, 8, max_model_len=2048, max_num_batched_tokens=64)
    rid = h.add_request(prompt(2, 1200), max_tokens=4).request_id
    obs = run_checked(h)
    assert any(o.hisparse_states.get(rid) == "mixed" for o in obs)
    assert obs[-1].hisparse_stats["prefill_restores"] == 0
    assert any(o.hisparse_plan.staging for o in obs)
    assert not any(o.hisparse_plan.restores for o in obs)


def test_copies_reported_with_a_step_that_has_no_plan_are_durable(model):
    # A worker reports copies with the first step's output that follows their work, which
    # need not carry a plan: the scheduler takes them from any output.
    from types import SimpleNamespace

    h = harness(model, 64, report_delay=1000)
    rid = h.add_request(prompt(1, 300), max_tokens=50).request_id
    while h.requests[rid].num_output_tokens < 4:
        h.step()
        check_block_accounting(h)
    in_flight = [c.copy_id for c in h.hisparse.residency.copies_in_flight()]
    assert in_flight, "copies planned, none reported yet"
    no_plan = SimpleNamespace(hisparse_plan=None)
    h.hisparse.on_model_output(no_plan, SimpleNamespace(hisparse_copied=in_flight))
    assert not h.hisparse.residency.copies_in_flight()
    assert h.hisparse.residency.counters.pages_copied_to_host == len(in_flight)
    req = h.hisparse.residency.requests[rid]
    assert req.count(PageState.BOTH) == len(in_flight), "the pages are durable on the host"


def test_consecutive_staged_chunks_reuse_the_staging_blocks_without_the_pool(model, monkeypatch):
    # A 1200-token prompt in 64-token chunks, in a pool too small for it: once its early
    # pages are on the host, every chunk stages. The staging a step's output gives up stays
    # with HiSparse for the next steps' takes, so chunks after the first take their
    # staging without a round trip through the pool's free queue (each block one pop and
    # one free of upstream's pool per step before). Nothing is preempted, every block is
    # owned once after every step, and the spare blocks return once no request has HOST
    # pages.
    h = harness(model, 8, max_model_len=2048, max_num_batched_tokens=64)
    hisparse, pool = h.hisparse, h.block_pool
    staging_pops = []
    in_fit = []
    real_fit, real_pop = hisparse.fit_chunk, pool.get_new_blocks

    def fit_chunk(*args, **kwargs):
        in_fit.append(True)
        try:
            return real_fit(*args, **kwargs)
        finally:
            in_fit.pop()

    def get_new_blocks(num_blocks):
        if in_fit:
            staging_pops.append(num_blocks)
        return real_pop(num_blocks)

    monkeypatch.setattr(hisparse, "fit_chunk", fit_chunk)
    monkeypatch.setattr(pool, "get_new_blocks", get_new_blocks)
    rid = h.add_request(prompt(2, 1200), max_tokens=4).request_id
    obs = []
    while h.scheduler.has_unfinished_requests():
        obs.append(h.step())
        check_block_accounting(h)
    # The request's end leaves nothing to stage: no spare block outlives it, even before
    # another step (an idle engine's reset_prefix_cache needs every block free).
    assert not hisparse.blocks.num_spare()
    obs += run_checked(h)
    assert h.requests[rid].num_output_tokens == 4 and h.total_preemptions == 0
    staged = [sum(len(group) for s in o.hisparse_plan.staging for group in s.block_ids) for o in obs]
    staged_steps = [n for n in staged if n]
    assert len(staged_steps) >= 3, f"consecutive chunks stage: {staged}"
    assert obs[-1].hisparse_stats["prefill_restores"] == 0
    assert sum(staging_pops) < sum(staged_steps) / 2, (
        f"staging took {sum(staging_pops)} blocks from the pool for {sum(staged_steps)} staged: {staged}"
    )
    assert not hisparse.blocks.num_spare() and h.num_free_blocks() == h.kv_cache_config.num_blocks - 1


def test_a_take_skips_the_guarded_blocks_it_reaches_and_leaves_the_others_in_place(model):
    """Blocks a pending admission guards are never taken. A take holds out of the free queue
    only the guarded blocks before its last block (they go back as upstream frees them);
    guarded blocks further back keep their place in the eviction order."""
    h = harness(model, 64)
    blocks = h.hisparse.blocks
    queue = blocks.free_queue_ids()
    pool = blocks.pool_blocks()
    guarded = [pool[queue[0]], pool[queue[2]], pool[queue[40]]]
    blocks.guard_with(lambda: guarded)
    taken = blocks.take(5)
    assert taken == [queue[1], *queue[3:7]], "the front's unguarded blocks, in order"
    after = blocks.free_queue_ids()
    assert {queue[0], queue[2]} <= set(after), "the guarded blocks it reached are free again"
    at = after.index(queue[40])
    assert after[at - 1 : at + 2] == queue[39:42], "a guarded block it did not reach kept its place"
    blocks.give_back(taken)
    blocks.guard_with(tuple)
    assert sorted(blocks.free_queue_ids()) == sorted(queue)


def test_a_streaming_input_sessions_lease_covers_the_input_that_comes_after_its_first_chunk(model):
    """A streaming-input session (`resumable`: AsyncLLM fed an async generator, the realtime
    API) stops after each chunk and takes the next one in the same request. Its hot lease
    was sized at registration from its first chunk (100 tokens and 4 more: two pages of
    a four-page buffer), so once the session grew and was demoted under pressure its HOST
    rows outnumbered the lease's rows, which the resolver fills past the lease's real
    blocks. The lease is sized for the model's length instead."""
    from vllm.v1.hisparse.capacity.engine import make_request
    from vllm.v1.request import Request, RequestStatus

    h = harness(
        model, 20, hisparse_config(device_buffer_size=256), max_model_len=4096, max_num_batched_tokens=512
    )
    residency = h.hisparse.residency

    def chunk(seed: int, length: int) -> Request:
        request = make_request(prompt(seed, length), 4, "S", h.block_hasher)
        request.resumable = True
        return request

    session = chunk(1, 100)
    h.scheduler.add_request(session)
    h.requests["S"] = session
    while session.status is not RequestStatus.WAITING_FOR_STREAMING_REQ:
        h.step()
    for seed in (2, 3, 4):
        h.scheduler.add_request(chunk(seed, 700))
        for _ in range(10):
            h.step()
    assert session.status is RequestStatus.WAITING_FOR_STREAMING_REQ and session.num_tokens > 2000
    for seed in range(50, 56):
        h.add_request(prompt(seed, 900), max_tokens=30)
    h.run_until_done()
    assert residency.requests["S"].num_host_pages > 4, "the session was demoted under pressure"
    assert residency.requests["S"].lease_blocks == residency.hot_lease_blocks
    h.scheduler.add_request(chunk(9, 40))
    h.scheduler.finish_requests("S", RequestStatus.FINISHED_ABORTED)
    h.run_until_done()


@pytest.mark.parametrize("connector", [None, "NixlConnector"])
def test_a_prompt_longer_than_the_device_that_asks_for_a_remote_decode_still_finishes(connector):
    """`do_remote_decode` comes from the client. A request carrying it was held on the device
    from its registration: one longer than the device was never demoted, was preempted over
    and over and never finished. Relief demotes it as any other; a producer then declines
    its send (pages in its host pool only), and the decode instance computes the prompt."""
    from vllm.config import KVTransferConfig
    from vllm.v1.request import RequestStatus

    transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_producer") if connector else None
    h = harness(
        str(tiny_glm5_dir()), 6, max_model_len=4096, max_num_batched_tokens=128, kv_transfer_config=transfer
    )
    request = h.add_request(
        prompt(1, 2000), max_tokens=4, request_id="long",
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )  # fmt: skip
    for _ in range(300):
        if request.is_finished():
            break
        h.step()
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.hisparse.stats()["pages_demoted"] > 0
