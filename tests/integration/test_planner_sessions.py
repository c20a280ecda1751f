# SPDX-License-Identifier: Apache-2.0
"""The capacity planner's session counts hold in vLLM's real scheduler.

A six-layer tiny GLM-5 (six sparse-MLA groups of one layer and one indexer group
with HiSparse on) gets a KV cache of a few dozen blocks; the planner counts how
many sessions of a given size run at once in each configuration, and that many
sessions are then driven through the real Scheduler and KVCacheManager
(tests/support/scheduler_harness.py: no model, the harness plays the worker's
part of HiSparse's residency protocol). They must all run together without a
preemption: wholly resident with plain preemption (after which the pool has no
room for one more), FULL and MIXED/NONE with Hybrid HiSparse, which demotes
pages instead of preempting. The counts are of sessions holding their KV at
once; under that pressure a MIXED session's prefill advances in short chunks.
"""

from __future__ import annotations

import pytest
import tiny_models
from scheduler_harness import SchedulerHarness, tiny_glm5_dir

from vllm.v1.hisparse.capacity.planner import Plan, PlanRequest, plan

SIX_LAYERS = tiny_models.TinyModelSpec(arch="glm5", index_topk=32, num_hidden_layers=6)
SESSION_TOKENS = 1024
# Each session's prompt leaves room for its output in the same pages.
OUTPUT_TOKENS = 64
MAX_MODEL_LEN = 2048
MAX_NUM_BATCHED_TOKENS = 256
HISPARSE = {"host_pool_gib": 1}
# One block of every layer: a 64-token page of the bf16 latent (576 values) and of the
# indexer's fp8 keys with their scales (128 + 4 bytes).
BLOCK_BYTES = SIX_LAYERS.num_hidden_layers * 64 * ((512 + 64) * 2 + 128 + 4)
# Fifty-five such blocks: three sessions wholly resident and a few blocks to spare.
KV_BYTES = 55 * BLOCK_BYTES


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_glm5_dir(SIX_LAYERS))


def plan_for(model: str, hisparse: dict) -> Plan:
    return plan(
        PlanRequest(
            model=model,
            kv_cache_memory_bytes=KV_BYTES,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            hisparse_config=hisparse,
            session_tokens=SESSION_TOKENS,
        )
    )


@pytest.fixture(scope="module")
def planned(model) -> Plan:
    return plan_for(model, HISPARSE)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 10 for i in range(length)]


def run_sessions(model: str, sessions: int, attention_config: dict | None) -> SchedulerHarness:
    h = SchedulerHarness.create(
        model=model,
        memory_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        attention_config=attention_config,
    )
    for seed in range(sessions):
        h.add_request(prompt(seed, SESSION_TOKENS - OUTPUT_TOKENS), max_tokens=OUTPUT_TOKENS)
    return h


def step_until(h: SchedulerHarness, sessions: int, decoding: bool, max_steps: int = 400) -> None:
    """Step until all `sessions` are running together (and, with `decoding`, all past their
    prefill), with no preemption on the way."""
    for _ in range(max_steps):
        observation = h.step()
        assert observation.total_preemptions == 0, f"preempted at step {observation.step}"
        if observation.num_running == sessions and (
            not decoding or all(n >= 1 for n in observation.num_output_tokens.values())
        ):
            return
    raise AssertionError(f"the {sessions} sessions never all ran together")


def test_the_planned_pool_is_the_schedulers(model, planned):
    for name, attention_config in (("none", None), ("hybrid", {"hisparse_config": HISPARSE})):
        h = run_sessions(model, 0, attention_config)
        assert h.kv_cache_config.num_blocks == planned.configuration(name).num_blocks
        assert h.num_free_blocks() == planned.configuration(name).usable_blocks


def test_full_residency_runs_the_planned_sessions_and_has_no_room_for_another(model, planned):
    none = planned.configuration("none")
    assert none.full_sessions >= 2
    h = run_sessions(model, none.full_sessions, None)
    step_until(h, none.full_sessions, decoding=True)
    assert h.num_free_blocks() < none.session_blocks_full
    h.run_until_done()
    assert h.total_preemptions == 0


@pytest.mark.parametrize(("host_pool_gib", "limit"), [(1, "device"), (0.03, "host pool")])
def test_hybrid_runs_the_planned_sessions_without_preempting(model, host_pool_gib, limit):
    hisparse = {"host_pool_gib": host_pool_gib}
    planned = plan_for(model, hisparse)
    hybrid = planned.configuration("hybrid")
    assert hybrid.limited_by == limit
    assert hybrid.leased_sessions >= 1
    assert hybrid.running_sessions > planned.configuration("none").running_sessions
    h = run_sessions(model, hybrid.running_sessions, {"hisparse_config": hisparse})
    # Admitted and holding their KV together; the last one's prefill runs in short chunks
    # while the pool is full (its top-K rows are staged from the host pool).
    step_until(h, hybrid.running_sessions, decoding=False)
    h.run_until_done()
    assert h.total_preemptions == 0
    leased = max(sum(state != "full" for state in o.hisparse_states.values()) for o in h.observations)
    assert leased >= hybrid.leased_sessions
