# SPDX-License-Identifier: Apache-2.0
"""KV offloading (OffloadingConnector) through the real engine on vLLM's CPU platform.

For each offloading spec (``CPUOffloadingSpec`` and ``TieringOffloadingSpec``) the engine
runs the same prompts twice with the GPU prefix cache reset in between, so the second
pass can only reuse KV that the connector stored on the first pass and loads back. The
tiny GLM-5 DSA model has one KV cache group holding both the sparse-MLA latent cache and
the indexer key cache (different page sizes), so both kinds of pages travel.

Checks: the engine's Prometheus counters show bytes stored and loaded and external prefix
hits, the second pass reports cached tokens, and greedy tokens are identical to a run with
the connector off (whose second pass recomputes everything). The weights are sharp
(init_std=0.2), so a wrong loaded page changes the greedy tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine import metric_total, offloading_connector, running_llm

from vllm import SamplingParams

pytestmark = pytest.mark.slow_test

CPU_BYTES_TO_USE = 64 << 20
SPEC_NAMES = ("CPUOffloadingSpec", "TieringOffloadingSpec")
BLOCK_SIZE = 64  # DSA page size on CPU
PROMPT_LENGTHS = (200, 450, 700)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
COUNTERS = ("vllm:kv_offload_store_bytes", "vllm:kv_offload_load_bytes", "vllm:external_prefix_cache_hits")


def prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(20260401)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def counters(llm) -> dict[str, float]:
    return {name: metric_total(llm, name) for name in COUNTERS}


@dataclass(frozen=True)
class TwoPasses:
    first_tokens: list[list[int]]
    second_tokens: list[list[int]]
    second_cached_tokens: list[int]
    reset_ok: bool
    counter_deltas: dict[str, float]


def run_two_passes(model: Path, kv_transfer_config: dict[str, Any] | None) -> TwoPasses:
    """Start an engine, run the prompts, reset the GPU prefix cache, run them again, shut down."""
    # float32: batch shapes differ between recompute and load; keep rounding out of it.
    with running_llm(model, dtype="float32", kv_transfer_config=kv_transfer_config) as llm:
        before = counters(llm)
        batch = [{"prompt_token_ids": ids} for ids in prompts()]
        first = llm.generate(batch, GREEDY, use_tqdm=False)
        reset_ok = llm.reset_prefix_cache()
        second = llm.generate(batch, GREEDY, use_tqdm=False)
        after = counters(llm)
    return TwoPasses(
        first_tokens=[list(o.outputs[0].token_ids) for o in first],
        second_tokens=[list(o.outputs[0].token_ids) for o in second],
        second_cached_tokens=[o.num_cached_tokens or 0 for o in second],
        reset_ok=reset_ok,
        counter_deltas={name: after[name] - before[name] for name in COUNTERS},
    )


@pytest.fixture(scope="module")
def without_connector(sparse_glm5_dir) -> TwoPasses:
    return run_two_passes(sparse_glm5_dir, kv_transfer_config=None)


@pytest.fixture(scope="module", params=SPEC_NAMES)
def with_connector(request, sparse_glm5_dir) -> Iterator[TwoPasses]:
    with offloading_connector(request.param, CPU_BYTES_TO_USE, "test-cpu-offloading") as config:
        yield run_two_passes(sparse_glm5_dir, kv_transfer_config=config)


def test_without_connector_the_second_pass_recomputes(without_connector):
    assert without_connector.reset_ok
    assert without_connector.second_cached_tokens == [0] * len(PROMPT_LENGTHS)
    assert without_connector.counter_deltas["vllm:external_prefix_cache_hits"] == 0


def test_blocks_are_stored_and_loaded(with_connector):
    run = with_connector
    assert run.reset_ok, "reset_prefix_cache refused: GPU prefix hits would hide the connector"
    deltas = run.counter_deltas
    assert deltas["vllm:kv_offload_store_bytes"] > 0, deltas
    assert deltas["vllm:kv_offload_load_bytes"] > 0, deltas
    # Every full prompt page was offloaded on the first pass, so the second pass loads each
    # prompt's full pages except one holding the last prompt token (always recomputed).
    expected = [(length - 1) // BLOCK_SIZE * BLOCK_SIZE for length in PROMPT_LENGTHS]
    assert run.second_cached_tokens == expected
    # The GPU prefix cache was reset, so every cached token is an external (connector) hit.
    assert deltas["vllm:external_prefix_cache_hits"] == sum(expected), deltas


def test_greedy_tokens_match_without_connector(with_connector, without_connector):
    assert with_connector.first_tokens == without_connector.first_tokens
    assert with_connector.second_tokens == without_connector.second_tokens
    for tokens in with_connector.second_tokens:
        assert len(tokens) == GREEDY.max_tokens
        assert len(set(tokens)) > 3, f"degenerate greedy output: {tokens}"
