# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse at the released models' index top-K (2048), through the real engine on CPU.

At top-K 2048 a request of under 2 x top-K tokens selects nearly every token it
holds: demoting its pages frees less than its hot lease takes, so relief must
leave it alone and preemption must stay as it would be without HiSparse. A
request longer than its lease is where demotion pays. One workload holds both:
two long sessions (past the hot buffer) and six short ones (shorter than it),
in a block pool that admits every prompt but cannot hold their growth. The hot
buffer is the smallest allowed (device_buffer_size = top-K) so the long
contexts stay affordable on CPU; the default lease is the same rule at twice
the rows.

Three runs, fp32 so a token difference means a bug: all-resident (a pool that
holds everything, no HiSparse), the small pool without HiSparse, and the small
pool with it. Preempted requests are recorded per run; wherever a request was
not preempted its greedy tokens must equal the all-resident run's.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import tiny_models
from engine import SPARSE_GLM5, metric_total, model_dir, running_llm

from vllm import SamplingParams

pytestmark = pytest.mark.slow_test

# One decoder layer: the selections, residency and resolver are the same per layer, and
# prefill at top-K 2048 costs the CPU reference attention about a GB per layer and 1K tokens.
PRODUCTION_GLM5 = tiny_models.production_topk(dataclasses.replace(SPARSE_GLM5, num_hidden_layers=1))
TOPK = tiny_models.PRODUCTION_INDEX_TOPK
BLOCK = 64
HOT_ROWS = TOPK  # the smallest hot buffer allowed: one lease is TOPK / BLOCK = 32 pages
LONG = (2500,)  # past the hot buffer: demoting pays for the lease
SHORT = (420, 520, 640, 760)  # whole contexts shorter than the hot buffer
OUTPUT_TOKENS = 40
GREEDY = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=8)


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (*LONG, *SHORT)]


def pages(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


# The pool holds every prompt and 2 pages of headroom, short of the requests' growth
# (each crosses a page boundary in its 40 output tokens).
PRESSURED_PAGES = sum(pages(n + 1) for n in (*LONG, *SHORT)) + 2
# KV cache groups (checked below): upstream keeps this model's latent and indexer caches
# in one group; HiSparse splits the sparse-MLA cache into a group of its own, so a page
# holds a block in each. Both runs get the same pages.
KV_CACHE_GROUPS = {False: 1, True: 2}


def run(hisparse: bool, num_pages: int | None) -> dict:
    """Tokens per prompt, preempted prompts, preemptions and (with HiSparse) the counters."""
    overrides = dict(ENGINE)
    if num_pages is not None:
        overrides["num_gpu_blocks_override"] = num_pages * KV_CACHE_GROUPS[hisparse]
    if hisparse:
        overrides["attention_config"] = {
            "hisparse_config": {"host_pool_gib": 0.25, "device_buffer_size": HOT_ROWS}
        }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with running_llm(model_dir(PRODUCTION_GLM5), **overrides) as llm:
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            residency = scheduler.hisparse.residency if scheduler.hisparse is not None else None
            preempted: set[str] = set()
            preempt = scheduler._preempt_request

            def recording_preempt(request, *args, **kwargs):
                preempted.add(request.request_id)
                return preempt(request, *args, **kwargs)

            mp.setattr(scheduler, "_preempt_request", recording_preempt)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
            result = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "preempted": {i for i, o in enumerate(outs) if o.request_id in preempted},
                "preemptions": metric_total(llm, "vllm:num_preemptions"),
                "stats": scheduler.hisparse.stats() if scheduler.hisparse is not None else None,
                "groups": len(scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups),
                "lease": residency and (residency.hot_lease_blocks, residency.blocks_per_page),
            }
    return result


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {
        "resident": run(hisparse=False, num_pages=None),
        "plain": run(hisparse=False, num_pages=PRESSURED_PAGES),
        "hisparse": run(hisparse=True, num_pages=PRESSURED_PAGES),
    }


def test_the_workload_has_contexts_on_both_sides_of_the_lease_and_is_under_pressure(runs):
    assert max(SHORT) + OUTPUT_TOKENS < HOT_ROWS < min(LONG)
    for name, result in runs.items():
        assert result["groups"] == KV_CACHE_GROUPS[name == "hisparse"], name
    assert runs["resident"]["preemptions"] == 0
    assert runs["plain"]["preemptions"] > 0, "without HiSparse the small pool must preempt"


def test_every_request_finishes(runs):
    for name, result in runs.items():
        assert [len(t) for t in result["tokens"]] == [OUTPUT_TOKENS] * len(prompts()), name


def test_hisparse_never_preempts_more_than_the_same_run_without_it(runs):
    assert runs["hisparse"]["preemptions"] <= runs["plain"]["preemptions"]


def test_tokens_equal_the_all_resident_run_wherever_no_preemption_happened(runs):
    for name in ("plain", "hisparse"):
        result = runs[name]
        compared = [i for i in range(len(prompts())) if i not in result["preempted"]]
        assert compared, f"{name}: every request was preempted; nothing left to compare"
        for i in compared:
            assert result["tokens"][i] == runs["resident"]["tokens"][i], f"{name}: prompt {i}"


def test_counters_show_long_contexts_demoted_and_short_ones_left_alone(runs):
    stats = runs["hisparse"]["stats"]
    lease_blocks, blocks_per_page = runs["hisparse"]["lease"]
    assert lease_blocks == HOT_ROWS // BLOCK * blocks_per_page
    # Long contexts took leases and their demoted pages were read back row by row.
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0
    assert 0 < stats["hot_leases"] <= len(LONG), "only requests longer than the lease are demoted"
    # Demotion paid for its leases: more blocks left the device than the leases took.
    assert stats["pages_demoted"] * blocks_per_page > stats["hot_leases"] * lease_blocks
    # Everything returned once the requests ended.
    assert stats["host_pages_used"] == 0 and stats["hot_lease_blocks"] == 0
    assert stats["requests_mixed"] == stats["requests_none"] == 0
