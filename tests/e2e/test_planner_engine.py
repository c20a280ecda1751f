# SPDX-License-Identifier: Apache-2.0
"""The capacity planner's KV cache config is the one the engine builds.

For tiny GLM-5 and DeepSeek-V3.2 checkpoints (and GLM-5 with an MTP layer, and
with shared indexers), the real engine is started on CPU, in-process, with a
small KV cache in each configuration the planner reports; its scheduler's KV
cache config (groups, specs, block count, tensors) must equal the planner's.
The longest context the planner reports must start, and one token more must be
refused at start-up.
"""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models
from engine import SPARSE_GLM5, model_dir, offloading_connector, running_llm

from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.hisparse.capacity.planner import Plan, PlanRequest, plan

pytestmark = pytest.mark.slow_test

# Small enough that the longest contexts stay inside the tiny models' 4096 positions.
KV_BYTES = 5 << 20
MAX_NUM_BATCHED_TOKENS = 256
HISPARSE = {"host_pool_gib": 1}
CONNECTOR_BYTES = 64 << 20
MAX_MODEL_LEN = 1024

MODELS = {
    "glm5": SPARSE_GLM5,
    "deepseek_v32": dataclasses.replace(SPARSE_GLM5, arch="deepseek_v32"),
    "glm5_mtp": dataclasses.replace(SPARSE_GLM5, num_nextn_predict_layers=1),
    "glm5_shared_indexers": dataclasses.replace(SPARSE_GLM5, num_hidden_layers=5, index_topk_freq=2),
}
MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module", autouse=True)
def in_process_engine():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


def planned(model: str, **request) -> Plan:
    return plan(
        PlanRequest(
            model=str(model_dir(MODELS[model])),
            kv_cache_memory_bytes=KV_BYTES,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            hisparse_config=HISPARSE,
            session_tokens=512,
            **request,
        )
    )


def engine_kv_cache_config(model: str, configuration: str, max_model_len: int = MAX_MODEL_LEN, **overrides):
    """The scheduler's KV cache config of the engine started in `configuration`."""
    if configuration == "hybrid":
        overrides["attention_config"] = {"hisparse_config": HISPARSE}
    with running_llm(
        model_dir(MODELS[model]),
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=max_model_len,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        **overrides,
    ) as llm:
        return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config


def assert_same_kv_cache_config(planned_plan: Plan, configuration: str, engine_config) -> None:
    mine = generate_scheduler_kv_cache_config([planned_plan.configuration(configuration).kv_cache_config])
    assert [g.layer_names for g in mine.kv_cache_groups] == [
        g.layer_names for g in engine_config.kv_cache_groups
    ]
    assert [g.kv_cache_spec for g in mine.kv_cache_groups] == [
        g.kv_cache_spec for g in engine_config.kv_cache_groups
    ]
    assert mine.num_blocks == engine_config.num_blocks
    assert mine == engine_config


@pytest.mark.parametrize(
    ("model", "configuration", "request_extra", "engine_extra"),
    [
        ("deepseek_v32", "none", {}, {}),
        ("deepseek_v32", "hybrid", {}, {}),
        ("glm5_mtp", "hybrid", {"speculative_config": MTP}, {"speculative_config": MTP}),
        ("glm5_shared_indexers", "hybrid", {}, {}),
    ],
)
def test_planned_kv_cache_config_is_the_engines(model, configuration, request_extra, engine_extra):
    assert_same_kv_cache_config(
        planned(model, **request_extra),
        configuration,
        engine_kv_cache_config(model, configuration, **engine_extra),
    )


def test_planned_kv_cache_config_with_the_offloading_connector_is_the_engines():
    result = planned("glm5", offload_baseline_bytes=CONNECTOR_BYTES)
    with offloading_connector("TieringOffloadingSpec", CONNECTOR_BYTES, label="planner") as kv_transfer:
        engine = engine_kv_cache_config("glm5", "offload", kv_transfer_config=kv_transfer)
    assert_same_kv_cache_config(result, "offload", engine)


@pytest.mark.parametrize("configuration", ["none", "hybrid"])
def test_the_longest_planned_context_starts_and_one_token_more_does_not(configuration):
    result = planned("glm5")
    longest = result.configuration(configuration).longest_context
    assert MAX_MODEL_LEN < longest < SPARSE_GLM5.max_position_embeddings
    assert_same_kv_cache_config(result, configuration, engine_kv_cache_config("glm5", configuration, longest))
    with pytest.raises(ValueError, match="max_model_len|max seq len"):
        engine_kv_cache_config("glm5", configuration, longest + 1)


def test_the_planner_reports_the_built_models_layers():
    """A sanity check of the fixtures: the shared-indexer model really shares."""
    spec = MODELS["glm5_shared_indexers"]
    result = planned("glm5_shared_indexers")
    assert result.num_layers == spec.num_hidden_layers
    assert 0 < result.num_indexer_layers < spec.num_hidden_layers
    assert tiny_models.build_config(spec).indexer_types.count("full") == result.num_indexer_layers
