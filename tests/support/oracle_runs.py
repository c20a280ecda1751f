# SPDX-License-Identifier: Apache-2.0
"""Runs the token-exact oracles compare: two agent turns through an in-process engine on CPU,
under pressure with Hybrid HiSparse or all resident, and the replay that makes a reference
compute every prompt in the same prefill chunks as the run it is compared with."""

from __future__ import annotations

import dataclasses
import random

import pytest
import tiny_models
from engine import metric_total, prefill_chunks, running_llm, scheduled_chunks, scheduled_steps

from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

SIX_LAYERS = tiny_models.TinyModelSpec(arch="glm5", init_std=0.2, index_topk=32, num_hidden_layers=6)
# IndexCache as GLM-5.x ships it: layers 2 and 4 reuse the top-K of layers 1 and 3.
SIX_LAYERS_SHARED_INDEXERS = dataclasses.replace(SIX_LAYERS, index_topk_freq=2, seed=1)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# 110 blocks: about 16 pages of the sessions' ~45 pages fit resident.
PRESSURE = dict(num_gpu_blocks_override=110, max_num_batched_tokens=128)


def hisparse(mode: str = "hybrid") -> dict:
    return {"hisparse_config": {"host_pool_gib": 0.05, "mode": mode}}


def first_turns(lengths: tuple[int, ...] = (300, 360, 420)) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def evict_device_sparse_mla_copies(scheduler) -> int:
    """Churn between turns: free sparse-MLA blocks whose pages the host pool holds leave the
    device prefix cache; the indexer's blocks, and each request's resident tail, stay."""
    block_pool = scheduler.kv_cache_manager.block_pool
    host_pool = scheduler.hisparse.residency.host_pool
    mla_groups = set(scheduler.hisparse.mla_group_ids)
    evict = {
        b.block_id
        for b in block_pool.blocks
        if b.block_hash is not None
        and b.ref_cnt == 0
        and get_group_id(b.block_hash) in mla_groups
        and host_pool.lookup(get_block_hash(b.block_hash)) is not None
    }
    scheduler.kv_cache_manager.evict_blocks(evict)
    return len(evict)


# Counters as the engine's Prometheus registry exports them.
EXPORTED_COUNTERS = (
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_load_bytes",
    "vllm:hisparse_pages_copied_to_host",
    "vllm:hisparse_pages_demoted",
    "vllm:hisparse_rows_loaded",
    "vllm:hisparse_rows_hit",
    "vllm:hisparse_host_prefix_pages_reused",
    "vllm:hisparse_resident_blocks_copied",
    "vllm:hisparse_bytes_to_host",
    "vllm:hisparse_bytes_from_host",
)


def two_turns(
    model,
    churn: bool = False,
    reset: bool = False,
    between_turns=None,
    lengths: tuple[int, ...] = (300, 360, 420),
    **overrides,
):
    """Tokens of both turns, and (with HiSparse) the scheduler's counters and preemptions.
    The first turns' prompts have `lengths` tokens.

    Between turns, `churn` evicts device copies of host-held sparse-MLA pages and `reset`
    drops the whole device prefix cache (so only a KV connector can serve the prefixes);
    `between_turns()`, if given, is called there too, while the engine serves.
    """
    with running_llm(model, dtype="float32", **overrides) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        prompts = first_turns(lengths)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if churn:
            assert evict_device_sparse_mla_copies(scheduler) > 0
        if reset:
            assert llm.reset_prefix_cache()
        if between_turns is not None:
            between_turns()
        rng = random.Random(9)
        second = [
            p + t + [rng.randrange(3, 512) for _ in range(24)] for p, t in zip(prompts, tokens, strict=True)
        ]
        outs2 = llm.generate([{"prompt_token_ids": p} for p in second], GREEDY, use_tqdm=False)
        tokens2 = [list(o.outputs[0].token_ids) for o in outs2]
        cached2 = [o.num_cached_tokens for o in outs2]
        stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
        preemptions = metric_total(llm, "vllm:num_preemptions")
        offload = {name: metric_total(llm, name) for name in EXPORTED_COUNTERS}
    return tokens, tokens2, cached2, stats, preemptions, offload


# Prefill budget of a reference that replays another run's chunks: never the shorter cap.
REPLAY_BUDGET = dict(max_num_batched_tokens=1024)


def alike(
    under_pressure,
    reference,
    recorded: dict | None = None,
    same_steps: bool = False,
    recorded_steps: list | None = None,
):
    """Run `under_pressure()`, then `reference()` computing every prompt in the same prefill
    chunks; returns both results, having checked that the chunks were the same. The chunks
    recorded go into `recorded` when given. With `same_steps`, each of the reference's
    forwards also holds the same requests as the first run's (`scheduled_steps`), checked
    too; a KV connector's loads are waited for, not let move requests between forwards.
    The steps recorded go into `recorded_steps` when given."""
    recorded = {} if recorded is None else recorded
    replayed: dict = {}
    steps: list | None = ([] if recorded_steps is None else recorded_steps) if same_steps else None
    replayed_steps: list | None = [] if same_steps else None
    loads: set | None = set() if same_steps else None
    with prefill_chunks(record=recorded), scheduled_steps(record=steps, loads=loads):
        pressed = under_pressure()
    with (
        prefill_chunks(record=replayed, replay=recorded),
        scheduled_steps(record=replayed_steps, replay=steps, loads=loads),
    ):
        resident = reference()
    assert scheduled_chunks(replayed) == scheduled_chunks(recorded), "the reference chunked alike"
    if same_steps:
        assert [s for s in replayed_steps if s] == [s for s in steps if s], "the reference stepped alike"
    return pressed, resident


def multiprocessing_off(run):
    """`run` as a callable with the engine core in this process (to read its scheduler)."""

    def in_process():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            return run()

    return in_process
