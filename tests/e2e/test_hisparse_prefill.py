# SPDX-License-Identifier: Apache-2.0
"""Prefill over host pages keeps its chunks whole, and its tokens exact.

One long request in a KV pool far smaller than its context, through the real engine on
CPU (in-process, float32, a six-layer tiny GLM-5 with index top-K 64): once its early
pages have moved to the host pool, every later prefill chunk selects rows from them.
Staging is sized by a budget (`hisparse_config.staging_rows`), not by tokens x top-K,
and a chunk whose selections exceed its hot and staging rows attends in passes, so the
chunks stay at the token budget and the prefill takes as many steps as it does with
everything resident. The tokens equal an all-resident run that computes the prompt in
the same chunks.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from engine import model_dir, running_llm, scheduled_chunks
from oracle_runs import SIX_LAYERS, alike, multiprocessing_off

from vllm import SamplingParams

pytestmark = pytest.mark.slow_test

TOP64 = dataclasses.replace(SIX_LAYERS, index_topk=64)
PROMPT_TOKENS = 3000
CHUNK = 512


@pytest.fixture(scope="module")
def model():
    return model_dir(TOP64)


def long_request(model, **overrides) -> tuple[list[int], dict | None]:
    prompt = [random.Random(3).randrange(3, 512) for _ in range(PROMPT_TOKENS)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with running_llm(model, dtype="float32", max_model_len=4096, **overrides) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
    return list(out.outputs[0].token_ids), stats


def test_a_long_prefill_over_host_pages_keeps_whole_chunks_and_exact_tokens(model, monkeypatch):
    monkeypatch.setenv("VLLM_HISPARSE_CHECK_OWNERSHIP", "1")
    # 30 pages: a 3000-token context (47 pages) does not fit, 4096 tokens would not start.
    pressure = dict(
        num_gpu_blocks_override=30 * 7 + 1,
        max_num_batched_tokens=CHUNK,
        attention_config={"hisparse_config": {"host_pool_gib": 0.1}},
    )
    recorded: dict = {}
    pressed, resident = alike(
        multiprocessing_off(lambda: long_request(model, **pressure)),
        multiprocessing_off(lambda: long_request(model, max_num_batched_tokens=CHUNK)),
        recorded=recorded,
    )
    tokens, stats = pressed
    ref_tokens, _ = resident
    (chunks,) = scheduled_chunks(recorded).values()
    whole = [CHUNK] * (PROMPT_TOKENS // CHUNK) + [PROMPT_TOKENS % CHUNK]
    assert chunks == whole, "no chunk was shortened: the prefill took as many steps as all resident"
    assert stats["pages_demoted"] > 0 and stats["request_steps_mixed"] > 0, "its early pages left the device"
    assert stats["extra_attention_passes"] > 0, "chunks whose selections exceeded their rows took passes"
    assert stats["partitioned_plans"] > 0, "only such steps read their run boundaries back"
    assert stats["prefill_restores"] == 0, "no room to restore its host pages"
    assert stats["max_resolver_calls_per_layer_step"] > 1
    assert stats["staging_rows_leased"] > 0
    # The plans held only the chunk's tokens (the request has host pages; 42 bytes per
    # token x top-K, and 40 bytes of counters and error words per pass).
    passes = stats["max_resolver_calls_per_layer_step"]
    assert 0 < stats["max_plan_bytes"] <= 42 * CHUNK * TOP64.index_topk + 40 * passes
    assert tokens == ref_tokens


def second_turn_over_host_pages(model, **overrides) -> tuple[list[int], list[int], dict | None]:
    """A 1,500-token first turn, its device copies evicted once the host pool holds them, and
    a second turn of 600 new tokens over it: the second turn starts from its host pages."""
    from oracle_runs import evict_device_sparse_mla_copies

    rng = random.Random(11)
    first = [rng.randrange(3, 512) for _ in range(1500)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with running_llm(model, dtype="float32", max_model_len=4096, **overrides) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        (out,) = llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
        if scheduler.hisparse is not None:
            assert evict_device_sparse_mla_copies(scheduler) > 0
        tokens = list(out.outputs[0].token_ids)
        second = first + tokens + [rng.randrange(3, 512) for _ in range(600)]
        (out2,) = llm.generate([{"prompt_token_ids": second}], greedy, use_tqdm=False)
        stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
    return tokens, list(out2.outputs[0].token_ids), stats


def test_a_chunk_that_restores_its_host_pages_keeps_the_tokens_exact(model, monkeypatch):
    # The second turn's first chunk stages (its host pages came with its admission); the
    # next finds the pool with room and restores them: from then on the request is FULL
    # and reads them in place. Its tokens equal an all-resident run chunked alike.
    monkeypatch.setenv("VLLM_HISPARSE_CHECK_OWNERSHIP", "1")
    hybrid = dict(max_num_batched_tokens=128, attention_config={"hisparse_config": {"host_pool_gib": 0.1}})
    pressed, resident = alike(
        multiprocessing_off(lambda: second_turn_over_host_pages(model, **hybrid)),
        multiprocessing_off(lambda: second_turn_over_host_pages(model, max_num_batched_tokens=128)),
    )
    first, second, stats = pressed
    assert stats["host_prefix_pages_reused"] > 0, "the second turn started from its host pages"
    assert stats["prefill_restores"] == 1, "one chunk restored them; the request was FULL after"
    assert stats["pages_restored_for_prefill"] == stats["host_prefix_pages_reused"]
    assert stats["bytes_from_host"] > 0
    # The staged first chunk's rows covered every host row it could select (the pool had
    # them free), so its plans needed no passes and read nothing back from the device.
    assert stats["staging_rows_leased"] > 0 and stats["partitioned_plans"] == 0
    assert stats["max_resolver_calls_per_layer_step"] == 1
    assert (first, second) == resident[:2]
