# SPDX-License-Identifier: Apache-2.0
"""The core oracle: greedy tokens with Hybrid HiSparse under pressure equal the all-resident run.

Through the real engine on CPU (in-process, to read the scheduler's residency
counters): three concurrent two-turn sessions of a six-layer tiny GLM-5 with
sharp weights (a wrong attention row changes tokens) and index top-K 32, so
every step selects sparsely. The HiSparse runs get a block pool far too small
for the sessions' KV: pages are copied to the host pool, demoted, read back row
by row through the resolver (hot-buffer misses), and the second turns start
from host-only prefixes. The reference runs the same requests with a pool that
holds everything and no HiSparse. Pressure is asserted, so the test fails if it
never happened; preemption is asserted absent because a preempted request
recomputes its prefix, which is not the resident run's arithmetic.

Like is compared with like: under pressure, staging and hot leases shorten
prefill chunks, and a chunk of another length alone changes the shapes of the
indexer's matmuls, which (even in fp32) can move an fp8 score across a near-tie
and swap a token on one CPU and not on another; so can a forward whose batch holds
other requests. So each reference replays the HiSparse run's prefill chunks and the
requests of each of its forwards (`alike`, `same_steps`; a KV connector's loads are
waited for), and the test checks that it did.
"""

from __future__ import annotations

import random

import pytest
import tiny_models
from engine import metric_total, model_dir, offloading_connector, running_llm
from oracle_runs import (
    GREEDY,
    PRESSURE,
    REPLAY_BUDGET,
    SIX_LAYERS,
    SIX_LAYERS_SHARED_INDEXERS,
    alike,
    first_turns,
    hisparse,
    multiprocessing_off,
    two_turns,
)

from vllm import SamplingParams

pytestmark = pytest.mark.slow_test


@pytest.fixture(scope="module")
def model():
    return model_dir(SIX_LAYERS)


@pytest.fixture(scope="module")
def resident(model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return two_turns(model)


@pytest.mark.parametrize("mode", ["hybrid", "always"])
def test_tokens_under_pressure_equal_the_all_resident_run(model, mode):
    pressed, resident = alike(
        multiprocessing_off(
            lambda: two_turns(model, churn=True, attention_config=hisparse(mode), **PRESSURE)
        ),
        multiprocessing_off(lambda: two_turns(model, **REPLAY_BUDGET)),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, exported = pressed
    ref_tokens, ref_tokens2, ref_cached2, *_ = resident
    # Pressure happened, and every kind of residency was exercised.
    assert stats["pages_demoted"] > 0 and stats["pages_copied_to_host"] > 0
    assert stats["request_steps_mixed"] > 0, "some request ran with pages in the host pool"
    assert stats["request_steps_none"] > 0, "a second turn started from a host-only prefix"
    assert stats["host_prefix_pages_reused"] > 0
    assert stats["rows_loaded"] > 0, "the resolver loaded rows from the host pool"
    assert preemptions == 0
    # Step-granular: each layer attends once per step, resolving once per pass (a chunk whose
    # selections outgrew its hot and staging rows takes more than one).
    assert stats["attention_calls"] == 6 * stats["forward_steps"]
    assert stats["resolver_calls"] == 6 * stats["resolving_steps"] + stats["extra_attention_passes"]
    # The engine's Prometheus metrics show the same counts.
    counted = ("pages_copied_to_host", "pages_demoted", "rows_loaded", "rows_hit", "host_prefix_pages_reused")
    for name in counted:
        assert exported[f"vllm:hisparse_{name}"] == stats[name]
    assert stats["rows_hit"] > 0, "hot buffers served rows again on later steps"
    assert exported["vllm:hisparse_bytes_to_host"] > 0 and exported["vllm:hisparse_bytes_from_host"] > 0
    # The second turns reused their prefixes as the resident run did: nothing recomputed.
    assert cached2 == ref_cached2
    assert tokens == ref_tokens
    assert tokens2 == ref_tokens2


def test_async_scheduling_under_pressure_keeps_the_tokens(model):
    """vLLM schedules the next step while the last one runs (CUDA's default; the CPU
    platform turns it off, so the test turns it back on): plans and copy reports
    then trail the scheduler by a step."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    check_and_update_config = CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config):
        check_and_update_config(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    scheduled = []

    def under_pressure():
        schedule = AsyncScheduler.schedule  # as the chunk recorder left it

        def counted_schedule(self, *args, **kwargs):
            scheduled.append(1)
            return schedule(self, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async_scheduling))
            mp.setattr(AsyncScheduler, "schedule", counted_schedule)
            return two_turns(model, churn=True, attention_config=hisparse(), **PRESSURE)

    pressed, resident = alike(
        multiprocessing_off(under_pressure),
        multiprocessing_off(lambda: two_turns(model, **REPLAY_BUDGET)),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, _ = pressed
    ref_tokens, ref_tokens2, ref_cached2, *_ = resident
    assert scheduled, "the asynchronous scheduler ran"
    assert stats["pages_demoted"] > 0 and stats["request_steps_none"] > 0 and stats["rows_loaded"] > 0
    assert preemptions == 0
    assert (tokens, tokens2, cached2) == (ref_tokens, ref_tokens2, ref_cached2)


def test_without_pressure_hybrid_keeps_every_request_full(model, resident):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        tokens, tokens2, _, stats, *_ = two_turns(model, attention_config=hisparse())
    assert stats["pages_demoted"] == 0 and stats["hot_leases"] == 0 and stats["rows_loaded"] == 0
    assert stats["request_steps_mixed"] == 0 and stats["request_steps_none"] == 0
    assert stats["pages_copied_to_host"] > 0, "proactive copies ran ahead of any pressure"
    assert (tokens, tokens2) == resident[:2]


def offloading_turns(model, spec_name: str, **overrides):
    """two_turns with the OffloadingConnector, the device prefix cache dropped between turns."""
    with offloading_connector(spec_name, label="test-hisparse-offloading") as kv_transfer:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            return two_turns(model, reset=True, kv_transfer_config=kv_transfer, **overrides)


@pytest.mark.parametrize(
    ("spec_name", "mode"),
    [("CPUOffloadingSpec", "hybrid"), ("TieringOffloadingSpec", "hybrid"), ("CPUOffloadingSpec", "always")],
)
def test_both_announcement_flags_under_pressure_keep_the_tokens(model, spec_name, mode):
    """HiSparse demotes under pressure while the OffloadingConnector stores the indexer K
    cache; after the device prefix cache is dropped between turns, the connector loads the
    indexer blocks and HiSparse serves the sparse-MLA pages of the same hit from its host
    pool: restored into the hit's blocks where the pool has room (hybrid), or left on the
    host with the request starting NONE (always). Tokens and loaded prefixes equal the
    connector-only run with a pool that holds everything, computed in the same chunks and
    steps (the connector's loads are waited for), and the connector never stored a
    sparse-MLA page."""
    pressed, reference = alike(
        lambda: offloading_turns(model, spec_name, attention_config=hisparse(mode), **PRESSURE),
        lambda: offloading_turns(model, spec_name, **REPLAY_BUDGET),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, offload = pressed
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert offload["vllm:kv_offload_store_bytes"] > 0 and offload["vllm:kv_offload_load_bytes"] > 0
    if mode == "hybrid":
        assert stats["pages_restored"] > 0, "a connector hit took its sparse-MLA pages back to the device"
    else:
        assert stats["pages_restored"] == 0 and stats["request_steps_none"] > 0
        assert stats["host_prefix_pages_reused"] > 0, "connector hits started NONE on host pages"
    # The connector-only run stores every layer of a page; this one only the indexer's
    # group, one block (a sparse-MLA layer's width here) per page instead of all six layers.
    store = "vllm:kv_offload_store_bytes"
    assert offload[store] < reference[5][store] / 2
    assert sum(cached2) > 0, "the second turns loaded their prefixes"
    assert cached2 == reference[2]
    assert (tokens, tokens2) == reference[:2]


def test_layers_that_share_an_indexer_share_one_resolution_and_keep_the_tokens():
    """With index_topk_freq=2 four of the six layers run an indexer and the other two reuse
    the previous one's top-K: each step plans one resolution per indexer and replays it for
    the layers that share it (only the row copies repeat), and the tokens equal the
    all-resident run's."""
    model = model_dir(SIX_LAYERS_SHARED_INDEXERS)
    pressed, reference = alike(
        multiprocessing_off(lambda: two_turns(model, churn=True, attention_config=hisparse(), **PRESSURE)),
        multiprocessing_off(lambda: two_turns(model, **REPLAY_BUDGET)),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, _ = pressed
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert stats["request_steps_none"] > 0 and stats["resolving_steps"] > 0
    # Layers 2 and 4 replay the plans of layers 1 and 3: in every resolving step, two of the
    # six layers' calls (per pass) make no plan of their own.
    assert stats["resolution_plans"] >= 4 * stats["resolving_steps"]
    assert stats["resolver_calls"] - stats["resolution_plans"] >= 2 * stats["resolving_steps"], (
        "one plan per indexer, step and pass"
    )
    assert stats["attention_calls"] == 6 * stats["forward_steps"], "each layer attends once per step"
    assert cached2 == reference[2]
    assert (tokens, tokens2) == reference[:2]


def test_where_plans_do_not_run_hisparse_stays_off_and_the_connector_keeps_every_group(model, monkeypatch):
    """Where the sparse-MLA backends do not resolve (GPUs other than Hopper and
    Blackwell data-centre parts), a valid hisparse_config changes nothing: upstream's
    KV cache grouping and layout, no residency, and a connector that stores and loads
    every group, so the run is the connector-only run byte for byte. Played on CPU by
    declaring that workers do not execute plans."""
    from vllm.config import hisparse as hisparse_config

    reference = offloading_turns(model, "CPUOffloadingSpec")
    monkeypatch.setattr(hisparse_config, "workers_execute_plans", False)
    tokens, tokens2, cached2, stats, _, offload = offloading_turns(
        model, "CPUOffloadingSpec", attention_config=hisparse()
    )
    assert stats is None, "no residency state was attached"
    assert offload == reference[5], "the connector moved exactly what it moves without HiSparse"
    assert sum(cached2) > 0 and cached2 == reference[2]
    assert (tokens, tokens2) == reference[:2]


def test_a_connector_hit_keeps_its_host_pages_until_its_request_is_scheduled(model, monkeypatch):
    """Six agent sessions, three turns each, on the 110-block pool with both announcement
    flags: a connector hit that finishes loading in a step that cannot schedule its
    request (the pool refuses the request's first allocation after its load once, as a
    full pool would) must keep its sparse-MLA pages as host placeholders, and its
    admission everything it holds, until the request runs; registering the
    placeholders' null block as the pages' device copy sent the resolver to rows that
    exist nowhere."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.hisparse.scheduling import HiSparseScheduling
    from vllm.v1.request import RequestStatus

    waited: list[str] = []
    finish_step = HiSparseScheduling.finish_step
    allocate_slots = KVCacheManager.allocate_slots
    refused: set[str] = set()

    def refused_once_after_a_load(self, request, *args, **kwargs):
        admissions = self.pressure_relief.__self__.admissions
        loaded = request.status == RequestStatus.WAITING and request.num_computed_tokens > 0
        pending = any(r.request_id == request.request_id and r.allocated for r in admissions.records())
        if loaded and pending and request.request_id not in refused:
            refused.add(request.request_id)
            return None
        return allocate_slots(self, request, *args, **kwargs)

    def checked_finish_step(self, scheduler, scheduler_output):
        for record in self.admissions.records():
            request_id = record.request_id
            request = scheduler.requests.get(request_id)
            if not record.allocated:
                continue  # looked up this step and not admitted: released below
            loading = request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request_id not in scheduler_output.num_scheduled_tokens and not loading:
                waited.append(request_id)
        finish_step(self, scheduler, scheduler_output)
        self.check_ownership()
        null_block = scheduler.kv_cache_manager.block_pool.null_block.block_id
        for req in self.residency.requests.values():
            for i, page in enumerate(req.pages):
                assert page.block_ids is None or null_block not in page.block_ids, (req.request_id, i)

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(360 + 40 * s)] for s in range(6)]
    answer = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(HiSparseScheduling, "finish_step", checked_finish_step)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", refused_once_after_a_load)
    with offloading_connector("TieringOffloadingSpec", label="test-hisparse-waiting-hit") as kv_transfer:
        with running_llm(
            model, kv_transfer_config=kv_transfer, attention_config=hisparse(), **PRESSURE
        ) as llm:
            for _ in range(3):
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], answer, use_tqdm=False)
                assert [len(o.outputs[0].token_ids) for o in outs] == [24] * len(prompts)
                prompts = [
                    p + list(o.outputs[0].token_ids) + [rng.randrange(3, 512) for _ in range(60)]
                    for p, o in zip(prompts, outs, strict=True)
                ]
            stats = llm.llm_engine.engine_core.engine_core.scheduler.hisparse.stats()
    assert waited, "a connector hit waited for its request's turn after its load"
    assert stats["request_steps_none"] > 0 and stats["rows_loaded"] > 0


def test_under_pressure_a_session_turn_takes_its_history_from_the_host_pool(model, monkeypatch):
    """Four agent sessions, each sending its next turn as soon as the last one ends, in a
    KV pool far smaller than their histories, with both announcement flags. A turn whose
    history the host pool holds starts NONE from it even when the pool is short of the
    hot lease that costs: other requests' BOTH pages are demoted for the lease, as for
    any allocation, instead of the turn recomputing its whole history."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rngs = [random.Random(70 + s) for s in range(4)]
    prompts = [[rng.randrange(3, 512) for _ in range(900)] for rng in rngs]
    answer = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    histories: dict[str, int] = {}
    cached: dict[str, int] = {}
    with offloading_connector("TieringOffloadingSpec", label="test-hisparse-sessions") as kv_transfer:
        with running_llm(
            model,
            kv_transfer_config=kv_transfer,
            attention_config=hisparse(),
            kv_cache_memory_bytes=12 << 20,
            max_num_batched_tokens=128,
        ) as llm:
            engine = llm.llm_engine
            for s in range(4):
                engine.add_request(f"s{s}-t0", {"prompt_token_ids": prompts[s]}, answer)
                histories[f"s{s}-t0"] = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    cached[out.request_id] = out.num_cached_tokens
                    s, turn = (int(part[1:]) for part in out.request_id.split("-"))
                    if turn < 2:
                        history = len(prompts[s]) + len(out.outputs[0].token_ids)
                        prompts[s] = (
                            prompts[s]
                            + list(out.outputs[0].token_ids)
                            + [rngs[s].randrange(3, 512) for _ in range(20)]
                        )
                        histories[f"s{s}-t{turn + 1}"] = history
                        engine.add_request(f"s{s}-t{turn + 1}", {"prompt_token_ids": prompts[s]}, answer)
            stats = engine.engine_core.engine_core.scheduler.hisparse.stats()
    assert stats["pages_demoted"] > 0 and stats["request_steps_none"] > 0
    for request_id, history in histories.items():
        # Every complete page of the history but the last one, which may still be uncopied.
        assert cached[request_id] >= history // 64 * 64 - 64, (request_id, cached[request_id], history)


def repeated_prompt_run(model, **overrides):
    """A page-aligned prompt sent again after the device prefix cache was dropped: the
    connector hits all of it, and the engine recomputes the last prompt token."""
    rng = random.Random(3)
    prompt = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(6 * 64)]}]
    with offloading_connector("CPUOffloadingSpec", label="test-hisparse-full-hit") as kv_transfer:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            with running_llm(model, dtype="float32", kv_transfer_config=kv_transfer, **overrides) as llm:
                scheduler = llm.llm_engine.engine_core.engine_core.scheduler
                first = llm.generate(prompt, GREEDY, use_tqdm=False)
                # Another step lets the connector store the first request's last chunk.
                llm.generate([{"prompt_token_ids": [5] * 70}], SamplingParams(max_tokens=2), use_tqdm=False)
                assert llm.reset_prefix_cache()
                again = llm.generate(prompt, GREEDY, use_tqdm=False)
                stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
    tokens = [list(o.outputs[0].token_ids) for o in (first[0], again[0])]
    return tokens, again[0].num_cached_tokens, stats


def test_a_full_prompt_connector_hit_restores_the_page_it_recomputes(model):
    """Even where a connector hit leaves its pages on the host (mode always), the page
    holding the last prompt token, which the engine computes again, is restored: a
    placeholder there would be written through the null block."""
    reference, reference_cached, _ = repeated_prompt_run(model)
    tokens, cached, stats = repeated_prompt_run(model, attention_config=hisparse("always"))
    assert cached == reference_cached == 6 * 64
    assert stats["pages_restored"] == 1 and stats["host_prefix_pages_reused"] == 5
    assert tokens == reference


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repetitive_prompts() -> list[list[int]]:
    """Prompts made of a repeated phrase, so n-gram lookup proposes drafts."""
    rng = random.Random(5)
    phrases = [[rng.randrange(3, 512) for _ in range(n)] for n in (20, 24, 28)]
    return [(phrase * 20)[:length] for phrase, length in zip(phrases, (300, 360, 420), strict=True)]


def speculative_run(model, **overrides):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with running_llm(model, dtype="float32", speculative_config=NGRAM, **overrides) as llm:
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in repetitive_prompts()], GREEDY, use_tqdm=False
            )
            stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
            drafts = metric_total(llm, "vllm:spec_decode_num_draft_tokens")
            preemptions = metric_total(llm, "vllm:num_preemptions")
    return [list(o.outputs[0].token_ids) for o in outs], stats, drafts, preemptions


def test_draft_verification_under_pressure_equals_the_all_resident_run(model):
    """Multi-token decode (n-gram drafts verified by the target model) of requests with
    pages in the host pool resolves token by token over the request's hot state."""
    pressed, resident = alike(
        lambda: speculative_run(model, attention_config=hisparse(), **PRESSURE),
        lambda: speculative_run(model, **REPLAY_BUDGET),
        same_steps=True,
    )
    (tokens, stats, drafts, preemptions), (reference, _, reference_drafts, _) = pressed, resident
    assert reference_drafts > 0 and drafts > 0
    assert stats["speculative_steps_with_host_pages"] > 0, "drafts were verified for MIXED/NONE requests"
    assert stats["rows_loaded"] > 0 and preemptions == 0
    assert tokens == reference


SIX_LAYERS_MTP = tiny_models.TinyModelSpec(
    arch="glm5", init_std=0.2, index_topk=32, num_hidden_layers=6, num_nextn_predict_layers=1
)
MTP = {"method": "mtp", "num_speculative_tokens": 2}
# The MTP drafter's layers join the resident indexer group, so a page costs fewer blocks
# than without it: 66 blocks give about the pressure 110 give above.
MTP_PRESSURE = dict(num_gpu_blocks_override=66, max_num_batched_tokens=128)


def mtp_run(model, **overrides):
    """Greedy tokens and every draft the MTP layer proposed, keyed by (prompt length, tokens
    so far)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with running_llm(model, dtype="float32", speculative_config=MTP, **overrides) as llm:
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            drafts: dict[tuple[int, int], list[int]] = {}
            deliver = scheduler.update_draft_token_ids

            def recording(proposed):
                for request_id, ids in zip(proposed.req_ids, proposed.draft_token_ids, strict=True):
                    request = scheduler.requests.get(request_id)
                    if request is not None and not request.is_prefill_chunk:
                        drafts[(request.num_prompt_tokens, request.num_tokens)] = list(ids)
                return deliver(proposed)

            scheduler.update_draft_token_ids = recording
            outs = llm.generate([{"prompt_token_ids": p} for p in first_turns()], GREEDY, use_tqdm=False)
            stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
            preemptions = metric_total(llm, "vllm:num_preemptions")
    return [list(o.outputs[0].token_ids) for o in outs], drafts, stats, preemptions


@pytest.mark.parametrize("spec", [SIX_LAYERS_MTP, tiny_models.TINY_GLM53], ids=["glm-5", "glm-5.3"])
def test_mtp_drafts_and_tokens_under_pressure_equal_the_all_resident_run(spec):
    """The checkpoint's own MTP layer drafts while the target's pages move: its layers stay
    resident with the indexer, so every draft (not only the verified tokens) equals the
    all-resident run's. An MTP drafter's cache at a chunk boundary depends on where the
    boundary falls, which the reference's replay of the chunks makes the same. Also on the
    tiny GLM-5.3, whose layers 2-4 reuse layer 1's top-K and whose RoPE spans 1M positions."""
    model = model_dir(spec)
    pressed, resident = alike(
        lambda: mtp_run(model, attention_config=hisparse(), **MTP_PRESSURE),
        lambda: mtp_run(model, **REPLAY_BUDGET),
        same_steps=True,
    )
    (tokens, drafts, stats, preemptions), (reference, reference_drafts, *_) = pressed, resident
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert stats["speculative_steps_with_host_pages"] > 0, "drafts were verified for MIXED/NONE requests"

    assert len(drafts) > 0 and drafts == reference_drafts
    assert tokens == reference


def test_mtp_second_turns_start_from_host_prefixes_like_the_all_resident_run():
    """Host prefix reuse with an MTP drafter: its blocks, cached with the indexer's, stay
    on the device, so a second turn takes its host-only pages and computes nothing again."""
    model = model_dir(SIX_LAYERS_MTP)
    pressed, reference = alike(
        multiprocessing_off(
            lambda: two_turns(
                model, churn=True, speculative_config=MTP, attention_config=hisparse(), **MTP_PRESSURE
            )
        ),
        multiprocessing_off(lambda: two_turns(model, speculative_config=MTP, **REPLAY_BUDGET)),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, _ = pressed
    assert stats["request_steps_none"] > 0 and stats["host_prefix_pages_reused"] > 0
    assert preemptions == 0
    assert cached2 == reference[2]
    assert (tokens, tokens2) == reference[:2]
