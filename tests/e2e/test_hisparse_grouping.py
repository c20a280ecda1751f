# SPDX-License-Identifier: Apache-2.0
"""With hisparse_config set, a DSA model's KV cache is split so sparse-MLA pages can move alone.

Through the real engine (in-process, to read the scheduler's KV cache config):
separate sparse-MLA and indexer groups over one block pool in a block-outermost
layout, greedy tokens identical to the ungrouped run, prefix caching intact.
"""

from __future__ import annotations

import random

import pytest
from engine import running_llm

from vllm import SamplingParams
from vllm.config.hisparse import HISPARSE_KV_CACHE_LAYOUT
from vllm.v1.hisparse.kv_grouping import INDEXER_LAYER_SUFFIX

pytestmark = pytest.mark.slow_test

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
HISPARSE = {"hisparse_config": {"host_pool_gib": 1}}


def prompts() -> list[list[int]]:
    rng = random.Random(77)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (150, 300)]


def two_passes(model, **overrides):
    with running_llm(model, dtype="float32", **overrides) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        groups = [(g.layer_names, g.kv_cache_spec) for g in scheduler.kv_cache_config.kv_cache_groups]
        layout = llm.llm_engine.vllm_config.cache_config.kv_cache_layout
        batch = [{"prompt_token_ids": ids} for ids in prompts()]
        first = llm.generate(batch, GREEDY, use_tqdm=False)
        second = llm.generate(batch, GREEDY, use_tqdm=False)
    return groups, layout, first, second


@pytest.fixture(scope="module")
def runs(sparse_glm5_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return two_passes(sparse_glm5_dir), two_passes(sparse_glm5_dir, attention_config=HISPARSE)


def test_upstream_keeps_one_group(runs):
    (groups, _, _, _), _ = runs
    assert len(groups) == 1


def test_hisparse_separates_sparse_mla_from_indexer_groups(runs):
    _, (groups, layout, _, _) = runs
    assert layout == HISPARSE_KV_CACHE_LAYOUT
    *mla_groups, indexer_group = groups
    assert mla_groups, "at least one sparse-MLA group"
    assert all(name.endswith(INDEXER_LAYER_SUFFIX) for name in indexer_group[0])
    for names, _ in mla_groups:
        assert not any(name.endswith(INDEXER_LAYER_SUFFIX) for name in names)
    assert {spec.block_size for _, spec in groups} == {64}


def test_grouping_changes_no_token_and_keeps_prefix_caching(runs):
    (_, _, plain_first, _), (_, _, first, second) = runs
    tokens = [list(o.outputs[0].token_ids) for o in first]
    assert tokens == [list(o.outputs[0].token_ids) for o in plain_first]
    assert [list(o.outputs[0].token_ids) for o in second] == tokens
    assert all(o.num_cached_tokens >= 128 for o in second), [o.num_cached_tokens for o in second]
