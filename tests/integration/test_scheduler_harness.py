# SPDX-License-Identifier: Apache-2.0
"""The scheduler harness drives vLLM's real Scheduler the way a real engine would.

Pinned to a real in-process engine (a few seconds per configuration): the harness's
layer specs, KV cache groups and block sizes equal what the engine reports, with and
without ``hisparse_config``. Then, through the harness alone (fast): requests run to
completion with lockstep block tables across KV cache groups, a too-small pool makes the
real scheduler preempt and still finish, and prefix caching hits for a repeated prompt.
"""

from __future__ import annotations

import math
import random

import pytest
import scheduler_harness as sh
from engine import ENGINE_DEFAULTS, running_llm

from vllm.config.hisparse import HISPARSE_KV_CACHE_LAYOUT
from vllm.v1.hisparse.kv_grouping import INDEXER_LAYER_SUFFIX
from vllm.v1.kv_cache_interface import MLAAttentionSpec

BLOCK = 64  # DSA models on CPU: the sparse-MLA page size
NUM_LAYERS = sh.TINY_GLM5.num_hidden_layers
# Per configuration: attention_config and the expected number of KV cache groups
# (HiSparse: one group per sparse-MLA layer for the tiny model, plus the indexer group).
CONFIGS = {"plain": (None, 1), "hisparse": (sh.HISPARSE, NUM_LAYERS + 1)}
config_params = pytest.mark.parametrize("config", list(CONFIGS))


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, sh.TINY_GLM5.vocab_size) for _ in range(n)]


def assert_lockstep(harness: sh.SchedulerHarness, observations: list[sh.StepObservation]) -> None:
    """Every request's block table has the same length in every group, at every step, and
    covers exactly its computed tokens."""
    for obs in observations:
        for rid, lengths in obs.block_table_lengths.items():
            assert len(lengths) == harness.num_groups, (obs.step, rid, lengths)
            expected = math.ceil(obs.num_computed_tokens[rid] / BLOCK)
            assert set(lengths) == {expected}, (obs.step, rid, lengths, obs.num_computed_tokens[rid])


def assert_all_finished(harness: sh.SchedulerHarness, max_tokens: int) -> None:
    assert not harness.unfinished()
    assert not harness.scheduler.has_requests()
    for rid, request in harness.requests.items():
        assert list(request.output_token_ids) == [harness.sampled_token] * max_tokens, rid
        assert request.get_finished_reason() is not None, rid
    # Every block went back to the pool (cached ones stay evictable, so they count as free).
    assert harness.num_free_blocks() == harness.kv_cache_config.num_blocks - 1


# ----------------------------------------------------------------------------- harness alone


@config_params
def test_config_and_specs_shape(config):
    attention_config, num_groups = CONFIGS[config]
    harness = sh.SchedulerHarness.create(num_blocks=200, attention_config=attention_config)
    assert harness.block_size == harness.hash_block_size == BLOCK
    assert harness.num_groups == num_groups
    assert list(harness.specs) == [
        name
        for i in range(NUM_LAYERS)
        for name in (f"model.layers.{i}.self_attn.indexer.k_cache", f"model.layers.{i}.self_attn.attn")
    ]
    for name, spec in harness.specs.items():
        assert isinstance(spec, MLAAttentionSpec) and spec.block_size == BLOCK and spec.num_kv_heads == 1
        width = 128 + 4 if name.endswith(INDEXER_LAYER_SUFFIX) else 512 + 64
        assert spec.head_size == width, name
    assert harness.kv_cache_config.num_blocks == 200
    assert harness.vllm_config.cache_config.num_gpu_blocks == 200
    if attention_config is not None:
        assert harness.vllm_config.cache_config.kv_cache_layout == HISPARSE_KV_CACHE_LAYOUT


@config_params
def test_ample_blocks_finish_without_preemption_in_lockstep(config):
    attention_config, num_groups = CONFIGS[config]
    harness = sh.SchedulerHarness.create(
        num_blocks=400, attention_config=attention_config, max_num_batched_tokens=256, max_num_seqs=8
    )
    rng = random.Random(1)
    max_tokens = 24
    for n in (150, 300, 70, 500, 64):  # 300 and 500 are prefilled in chunks of <= 256 tokens
        harness.add_request(prompt(rng, n), max_tokens)
    prompt_lens = {rid: r.num_prompt_tokens for rid, r in harness.requests.items()}

    observations = harness.run_until_done(max_steps=200)

    assert harness.num_groups == num_groups
    assert observations[-1].total_preemptions == 0
    assert all(r.num_preemptions == 0 for r in harness.requests.values())
    assert max(obs.num_running for obs in observations) >= 3, "requests ran concurrently"
    chunks = [obs.num_scheduled_tokens.get("req-1", 0) for obs in observations]
    assert 0 < next(filter(None, chunks)) < 300, "the 300-token prompt was prefilled in chunks"
    # A token is sampled only once the prefill is complete, then one per step.
    previous = dict.fromkeys(prompt_lens, 0)
    for obs in observations:
        for rid, computed in obs.num_computed_tokens.items():
            sampled = obs.num_output_tokens[rid] - previous[rid]
            assert sampled == (rid in obs.num_scheduled_tokens and computed >= prompt_lens[rid]), (obs, rid)
        previous = obs.num_output_tokens
    assert_lockstep(harness, observations)
    assert_all_finished(harness, max_tokens)
    finished = [rid for obs in observations for rid in obs.finished]
    assert sorted(finished) == sorted(harness.requests)


@config_params
def test_small_pool_preempts_and_still_finishes(config):
    attention_config, num_groups = CONFIGS[config]
    # 9 usable blocks per group; max_model_len 512 needs 8 per group, so the engine's
    # start-up check passes. Four requests of 60 + 300 tokens want 6 blocks per group
    # each: all are admitted (1 block each) and the growing decodes must preempt.
    num_blocks = 1 + 9 * num_groups
    harness = sh.SchedulerHarness.create(
        num_blocks=num_blocks, attention_config=attention_config, max_model_len=512, max_num_seqs=8
    )
    rng = random.Random(2)
    max_tokens = 300
    for _ in range(4):
        harness.add_request(prompt(rng, 60), max_tokens)

    observations = harness.run_until_done(max_steps=3000)

    assert observations[-1].total_preemptions > 0
    assert observations[-1].total_preemptions == sum(obs.num_preempted for obs in observations)
    assert sum(r.num_preemptions for r in harness.requests.values()) == observations[-1].total_preemptions
    assert max(obs.num_running for obs in observations) == 4, "all four were admitted at once"
    assert any(obs.num_waiting > 0 for obs in observations[1:]), "a preempted request went back to waiting"
    assert min(obs.num_free_blocks for obs in observations) < num_groups
    assert_lockstep(harness, observations)
    assert_all_finished(harness, max_tokens)


@config_params
def test_prefix_cache_hit_for_a_repeated_prompt(config):
    attention_config, _ = CONFIGS[config]
    harness = sh.SchedulerHarness.create(num_blocks=100, attention_config=attention_config)
    rng = random.Random(3)
    shared, other = prompt(rng, 200), prompt(rng, 200)
    harness.add_request(shared, 4, request_id="first")
    harness.run_until_done(max_steps=50)

    harness.add_request(shared, 4, request_id="again")
    harness.add_request(other, 4, request_id="other")
    obs = harness.step()

    # The last prompt token is always recomputed: 3 full blocks of the 200-token prompt hit.
    assert obs.new_request_cached_tokens["again"] >= BLOCK
    assert obs.new_request_cached_tokens["again"] == 3 * BLOCK
    assert obs.new_request_cached_tokens["other"] == 0
    assert obs.num_computed_tokens["again"] == len(shared)  # the rest fit in this step
    assert_lockstep(harness, [obs])


def test_no_prefix_cache_hit_when_prefix_caching_is_off():
    harness = sh.SchedulerHarness.create(num_blocks=100, enable_prefix_caching=False)
    assert harness.block_hasher is None
    shared = prompt(random.Random(3), 200)
    harness.add_request(shared, 4, request_id="first")
    harness.run_until_done(max_steps=50)
    harness.add_request(shared, 4, request_id="again")
    assert harness.step().new_request_cached_tokens["again"] == 0


def test_run_until_done_reports_a_stall():
    harness = sh.SchedulerHarness.create(num_blocks=100)
    harness.add_request(prompt(random.Random(4), 100), max_tokens=50)
    with pytest.raises(RuntimeError, match="unfinished after 3 steps"):
        harness.run_until_done(max_steps=3)
    assert len(harness.run_until_done(max_steps=3, strict=False)) == 3


# ----------------------------------------------------------------------------- vs a real engine


@pytest.fixture(scope="module", params=list(CONFIGS))
def engine_report(request):
    """What a real in-process engine reports for the tiny GLM-5 model (engine shut down)."""
    attention_config, _ = CONFIGS[request.param]
    overrides = {} if attention_config is None else {"attention_config": attention_config}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with running_llm(sh.tiny_glm5_dir(), **overrides) as llm:
            core = llm.llm_engine.engine_core.engine_core
            report = dict(
                config=request.param,
                specs=core.model_executor.get_kv_cache_specs(),
                kv_cache_config=core.scheduler.kv_cache_config,
                layout=core.vllm_config.cache_config.kv_cache_layout,
                block_size=core.scheduler.block_size,
                hash_block_size=core.scheduler.hash_block_size,
            )
    return report


def harness_like_engine(config: str, **pool_size) -> sh.SchedulerHarness:
    attention_config, _ = CONFIGS[config]
    return sh.SchedulerHarness(
        sh.make_vllm_config(
            max_model_len=ENGINE_DEFAULTS["max_model_len"],
            enforce_eager=True,
            attention_config=attention_config,
        ),
        **(pool_size or {"memory_bytes": ENGINE_DEFAULTS["kv_cache_memory_bytes"]}),
    )


def test_specs_match_the_engine_workers(engine_report):
    harness = harness_like_engine(engine_report["config"])
    (worker_specs,) = engine_report["specs"]
    assert list(harness.specs) == list(worker_specs)
    assert harness.specs == worker_specs


def test_kv_cache_groups_match_the_engine(engine_report):
    harness = harness_like_engine(engine_report["config"])
    _, num_groups = CONFIGS[engine_report["config"]]
    engine_config = engine_report["kv_cache_config"]
    summary = sh.kv_cache_config_summary(harness.kv_cache_config)
    assert summary == sh.kv_cache_config_summary(engine_config)
    assert len(summary) == num_groups
    assert {block_size for *_, block_size in summary} == {BLOCK}
    if num_groups > 1:
        *mla_groups, (indexer_names, *_) = summary
        assert all(name.endswith(INDEXER_LAYER_SUFFIX) for name in indexer_names)
        assert not any(name.endswith(INDEXER_LAYER_SUFFIX) for names, *_ in mla_groups for name in names)
    # Everything else too: group specs, block count, tensor layout and strides.
    assert harness.kv_cache_config == engine_config
    assert harness.vllm_config.cache_config.kv_cache_layout == engine_report["layout"]
    assert (harness.block_size, harness.hash_block_size) == (
        engine_report["block_size"],
        engine_report["hash_block_size"],
    )
    # Sizing the pool by block count (what the other tests do) builds the same config.
    by_count = harness_like_engine(engine_report["config"], num_blocks=engine_config.num_blocks)
    assert by_count.kv_cache_config == engine_config


def test_the_scheduling_time_sweep_measures_a_batch_under_pressure():
    """benchmarks/scheduler_steps.py times decode steps of requests whose pages moved to the host."""
    import sys

    sys.path.insert(0, str(sh.REPO / "benchmarks"))
    import scheduler_steps

    row = scheduler_steps.measure(1024, batch=2, decode_steps=4)
    assert row["host_pages"] > 0, "the batch decodes with pages in the host pool"
    assert row["preemptions"] == 0 and row["mean_ms"] > 0
