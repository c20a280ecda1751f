# SPDX-License-Identifier: Apache-2.0
"""The capacity planner (`python -m vllm.v1.hisparse.capacity plan`) on GLM-5's published shapes.

Planning needs no engine: these build vLLM's configs and KV cache configs for the
full-size model in about a second each. Whether the numbers are the engine's is
pinned against real engines in tests/e2e/test_planner_engine.py.
"""

from __future__ import annotations

import json
import math

import pytest
from transformers import DeepseekV32Config, GlmMoeDsaConfig

from vllm.config.hisparse import FP8_SPARSE_MLA_BYTES_PER_TOKEN, RESIDENT_TAIL_PAGES, SPARSE_MLA_PAGE_TOKENS
from vllm.v1.hisparse.capacity import planner
from vllm.v1.hisparse.capacity.planner import (
    GLM5_PRESET,
    PlannerError,
    PlanRequest,
    estimate_weights,
    layer_has_indexer,
    main,
    plan,
)

GiB = 1 << 30
# The announcement's node: GLM-5 FP8 on 8 x H200 (141 GB) at TP=8, FP8 KV cache,
# a 384 GiB HiSparse pool and a 128 GiB OffloadingConnector tier.
ANNOUNCEMENT = dict(
    model=GLM5_PRESET,
    tensor_parallel_size=8,
    gpu_memory_gib=141,
    kv_cache_dtype="fp8",
    weights_dtype="fp8",
    hisparse_config={"host_pool_gib": 384},
    kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 128 * GiB},
    },
    max_num_batched_tokens=8192,
    max_num_seqs=1024,
)
MILLION = 1 << 20
# Far more blocks than any session here needs, so the session counts are not the limit.
KV_BYTES = 32 * GiB


@pytest.fixture(scope="module")
def announcement() -> planner.Plan:
    return plan(PlanRequest(**ANNOUNCEMENT))


def glm5(**changes) -> planner.Plan:
    return plan(
        PlanRequest(**{**ANNOUNCEMENT, "gpu_memory_gib": None, "kv_cache_memory_bytes": KV_BYTES, **changes})
    )


def usable_blocks(configuration: planner.ConfigurationPlan) -> int:
    return configuration.num_blocks - 1


# ----------------------------------------------------------------------------- the model


def test_the_glm5_preset_is_transformers_glm_moe_dsa_defaults():
    preset = planner.glm5_preset_config()
    defaults = GlmMoeDsaConfig().to_dict()
    assert preset["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert {k: v for k, v in preset.items() if k not in ("architectures", "dtype")} == {
        k: v for k, v in defaults.items() if k not in ("architectures", "dtype")
    }


def test_glm5_kv_per_token_is_fp8_ds_mla_latents_and_fp8_indexer_keys_on_every_layer(announcement):
    config = GlmMoeDsaConfig()
    layers = config.num_hidden_layers
    assert announcement.kv_cache_dtype == "fp8_ds_mla"
    assert announcement.sparse_mla_bytes_per_token == FP8_SPARSE_MLA_BYTES_PER_TOKEN * layers
    # fp8 keys plus one float32 scale per 128 values, one key per token and layer
    assert (
        announcement.indexer_bytes_per_token
        == (config.index_head_dim + config.index_head_dim // 128 * 4) * layers
    )
    assert announcement.num_indexer_layers == layers


@pytest.mark.parametrize(
    "shape",
    [
        {"index_topk_freq": 1},
        {"index_topk_freq": 2},
        {"index_topk_freq": 4},
        {"index_topk_freq": 3, "index_skip_topk_offset": 4},
        {"index_topk_pattern": "FSSFSFFS"},
    ],
)
def test_indexer_layers_follow_the_checkpoints_sharing_pattern(shape):
    config = GlmMoeDsaConfig(num_hidden_layers=8, **shape)
    assert [layer_has_indexer(config, i) for i in range(8)] == [t == "full" for t in config.indexer_types]
    assert layer_has_indexer(config, 8), "an MTP drafter's layer always has its own indexer"


def test_weights_estimate_matches_the_published_parameter_counts():
    # GLM-5: 744B parameters; DeepSeek-V3.2: 671B (without its MTP module).
    assert estimate_weights(GlmMoeDsaConfig(), 1, "bfloat16").total_params == pytest.approx(744e9, rel=0.01)
    assert estimate_weights(DeepseekV32Config(), 1, "bfloat16").total_params == pytest.approx(671e9, rel=0.01)


def test_tensor_parallelism_splits_weights_but_keeps_replicated_projections_whole():
    config = GlmMoeDsaConfig()
    one, eight = (estimate_weights(config, tp, "fp8").bytes_per_gpu for tp in (1, 8))
    assert one / 8 < eight < one / 4
    assert estimate_weights(config, 8, "bfloat16").bytes_per_gpu > 1.9 * eight


# ----------------------------------------------------------------------------- the plan


def test_tensor_parallelism_does_not_divide_the_kv_cache_per_token():
    """Under MLA every TP rank holds the whole latent cache: the same KV bytes per GPU hold
    the same blocks at TP 4 and 8. The node's TP ranks share one copy of a demoted page in
    HiSparse's host pool, so the pool holds as many pages at TP 8 as at TP 4."""
    tp4, tp8 = glm5(tensor_parallel_size=4), glm5(tensor_parallel_size=8)
    for name in planner.CONFIGURATIONS:
        assert tp4.configuration(name).num_blocks == tp8.configuration(name).num_blocks
        assert tp4.configuration(name).device_tokens == tp8.configuration(name).device_tokens
    for field in ("host_bytes_per_leased", "host_pool_bytes"):
        assert getattr(tp8.configuration("hybrid"), field) == getattr(tp4.configuration("hybrid"), field)


def test_sessions_fill_the_device_and_the_host_pool_without_overflowing_them(announcement):
    for c in announcement.configurations:
        usable = usable_blocks(c)
        assert (
            c.full_sessions * c.session_blocks_full <= usable < (c.full_sessions + 1) * c.session_blocks_full
        )
    hybrid = announcement.configuration("hybrid")
    leased, full = hybrid.session_blocks_leased, hybrid.session_blocks_full
    used = hybrid.leased_sessions * leased + hybrid.full_beside_leased * full
    assert used <= usable_blocks(hybrid) < used + full
    assert (
        hybrid.host_bytes_used
        == hybrid.leased_sessions * hybrid.host_bytes_per_leased
        <= hybrid.host_pool_bytes
    )
    one_more_fits_device = usable_blocks(hybrid) >= (hybrid.leased_sessions + 1) * leased
    one_more_fits_host = hybrid.host_pool_bytes >= (hybrid.leased_sessions + 1) * hybrid.host_bytes_per_leased
    assert not (one_more_fits_device and one_more_fits_host)


def test_a_leased_session_keeps_every_indexer_page_but_only_its_tail_and_hot_lease_of_latents(announcement):
    hybrid = announcement.configuration("hybrid")
    *mla_groups, _ = hybrid.group_layers
    pages = math.ceil(announcement.session_tokens / SPARSE_MLA_PAGE_TOKENS)
    lease_pages = math.ceil(announcement.hot_buffer_rows / SPARSE_MLA_PAGE_TOKENS)
    assert announcement.hot_buffer_rows == 2 * announcement.index_topk
    assert hybrid.session_blocks_full == pages * (len(mla_groups) + 1)
    # Every indexer page; per sparse-MLA group the hot lease, the resident tail and the
    # pages a decode step may write (the current one and the next).
    step_pages = 2
    assert hybrid.session_blocks_leased == pages + len(mla_groups) * (
        lease_pages + RESIDENT_TAIL_PAGES + step_pages
    )


def test_a_leased_session_needs_its_pages_but_the_tail_in_the_node_pool_once(announcement):
    hybrid = announcement.configuration("hybrid")
    page_bytes = FP8_SPARSE_MLA_BYTES_PER_TOKEN * SPARSE_MLA_PAGE_TOKENS * GlmMoeDsaConfig().num_hidden_layers
    complete_pages = announcement.session_tokens // SPARSE_MLA_PAGE_TOKENS
    assert hybrid.host_bytes_per_leased == (complete_pages - RESIDENT_TAIL_PAGES) * page_bytes
    pool_pages = int(ANNOUNCEMENT["hisparse_config"]["host_pool_gib"] * GiB) // page_bytes
    assert hybrid.host_pool_bytes == pool_pages * page_bytes


def test_hybrid_runs_more_agentic_sessions_than_full_residency(announcement):
    none, offload, hybrid = (announcement.configuration(n) for n in planner.CONFIGURATIONS)
    assert none.running_sessions == offload.running_sessions == none.full_sessions
    assert hybrid.leased_sessions > 0
    assert hybrid.running_sessions > none.running_sessions
    assert offload.connector_tokens and hybrid.connector_tokens and none.connector_tokens is None


def test_a_million_token_request_needs_hisparse_and_a_pool_of_one_copy_per_node():
    needed_pages = math.ceil(MILLION / SPARSE_MLA_PAGE_TOKENS)
    page_bytes = FP8_SPARSE_MLA_BYTES_PER_TOKEN * SPARSE_MLA_PAGE_TOKENS * GlmMoeDsaConfig().num_hidden_layers
    pool_gib = needed_pages * page_bytes / GiB
    short = glm5(max_model_len=MILLION, hisparse_config={"host_pool_gib": math.floor(pool_gib)})
    enough = glm5(max_model_len=MILLION, hisparse_config={"host_pool_gib": math.ceil(pool_gib)})
    for result in (short, enough):
        for name in ("none", "offload"):
            assert not result.configuration(name).starts
            assert "KV cache" in result.configuration(name).max_model_len_refusal
            assert result.configuration(name).longest_context < MILLION
    assert "host_pool_gib" in short.configuration("hybrid").max_model_len_refusal
    assert short.configuration("hybrid").longest_context < MILLION
    assert enough.configuration("hybrid").starts
    assert enough.configuration("hybrid").longest_context >= MILLION


def test_the_longest_context_is_the_start_up_checks_boundary():
    result = glm5(max_model_len=MILLION)
    for c in result.configurations:
        assert c.refusal_at(c.longest_context) is None
        assert c.refusal_at(c.longest_context + 1) is not None
        assert (c.refusal_at(MILLION) is None) == c.starts


def test_mode_always_keeps_no_session_fully_resident():
    result = glm5(hisparse_config={"host_pool_gib": 384, "mode": "always"})
    hybrid = result.configuration("hybrid")
    assert hybrid.full_sessions == hybrid.full_beside_leased == 0
    assert hybrid.running_sessions == hybrid.leased_sessions > 0


# ----------------------------------------------------------------------------- the command line


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


HISPARSE_FLAG = ("--attention-config", '{"hisparse_config":{"host_pool_gib":384}}')


def test_the_command_prints_every_configuration_as_json(capsys):
    code, out, _ = run(
        capsys,
        "--model",
        GLM5_PRESET,
        "-tp",
        "8",
        "--gpu-memory-gib",
        "141",
        "--kv-cache-dtype",
        "fp8",
        "--weights-dtype",
        "fp8",
        "--max-model-len",
        "200k",
        *HISPARSE_FLAG,
        "--kv-offloading-size",
        "128",
        "--format",
        "json",
    )
    assert code == 0
    result = json.loads(out)
    assert [c["name"] for c in result["configurations"]] == list(planner.CONFIGURATIONS)
    assert result["max_model_len"] == 200_000 and result["max_num_batched_tokens"] == 8192
    assert result["weights"]["dtype"] == "fp8"


def test_the_markdown_table_has_a_row_per_configuration(capsys):
    code, out, _ = run(
        capsys,
        GLM5_PRESET,
        "-tp",
        "8",
        "--kv-cache-memory-bytes",
        str(KV_BYTES),
        "--kv-cache-dtype",
        "fp8",
        *HISPARSE_FLAG,
        "--format",
        "markdown",
    )
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].removeprefix("| ").split()[0] for row in rows[1:]] == list(
        planner.CONFIGURATIONS
    )


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ("--model", "/nonexistent/model", *HISPARSE_FLAG),
            "--model /nonexistent/model: no config.json at /nonexistent/model",
        ),
        (
            ("--model", GLM5_PRESET, "--attention-config", "{hisparse_config: 1}"),
            "--attention-config is not valid JSON",
        ),
        (("--model", GLM5_PRESET, "--attention-config", "{}"), "has no hisparse_config with a host_pool_gib"),
        ((GLM5_PRESET, *HISPARSE_FLAG), "--kv-cache-memory-bytes"),
        (
            (
                GLM5_PRESET,
                *HISPARSE_FLAG,
                "--kv-cache-memory-bytes",
                "1G",
                "--kv-transfer-config",
                '{"kv_connector":"NixlConnector"}',
            ),
            "kv_connector 'NixlConnector'",
        ),
        (
            (GLM5_PRESET, *HISPARSE_FLAG, "--gpu-memory-gib", "141", "--weights-dtype", "bfloat16"),
            "raise --tensor-parallel-size",
        ),
        (
            (
                GLM5_PRESET,
                *HISPARSE_FLAG,
                "--kv-cache-memory-bytes",
                "1G",
                "--max-model-len",
                "100000",
                "--session-tokens",
                "142000",
            ),
            "--session-tokens 142,000 exceeds the max_model_len 100,000",
        ),
        (
            (
                GLM5_PRESET,
                "-tp",
                "8",
                *HISPARSE_FLAG,
                "--kv-cache-memory-bytes",
                "1G",
                "--speculative-config",
                '{"method":"mtp","num_speculative_tokens":3}',
            ),
            "no MTP layers",
        ),
    ],
)
def test_bad_input_names_the_value_and_the_fix(capsys, argv, named):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert named in err


def test_a_config_without_sparse_mla_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    code, _, err = run(capsys, "--model", str(tmp_path), *HISPARSE_FLAG, "--kv-cache-memory-bytes", "1G")
    assert code == 2
    assert "without sparse MLA" in err and "llama" in err


def test_a_config_that_is_not_json_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PlannerError, match="is not valid JSON"):
        planner.read_model_config(str(tmp_path))


def test_a_model_len_that_starts_nowhere_fails_naming_the_longest_that_does(capsys):
    code, out, err = run(
        capsys,
        GLM5_PRESET,
        "-tp",
        "8",
        "--kv-cache-memory-bytes",
        "4G",
        "--kv-cache-dtype",
        "fp8",
        "--attention-config",
        '{"hisparse_config":{"host_pool_gib":16}}',
        "--max-model-len",
        "1M",
    )
    assert code == 1
    assert "Hybrid HiSparse capacity plan" in out
    assert "--max-model-len 1,048,576 starts in no configuration" in err
    assert "Lower --max-model-len" in err


@pytest.mark.parametrize("preset", ["glm-5.3", "glm-5.2"])
def test_the_glm53_preset_shares_indexers_reaches_1m_positions_and_carries_mtp_and_fp8(preset):
    data, label = planner.read_model_config(preset)
    config = GlmMoeDsaConfig(**{k: v for k, v in data.items() if k != "quantization_config"})
    assert preset in label
    assert config.num_hidden_layers == 78 and config.index_topk == 2048
    assert data["max_position_embeddings"] == 1_048_576
    assert data["num_nextn_predict_layers"] == 1
    assert planner.weights_dtype_of(data, "auto") == "fp8"
    with_indexer = [i for i in range(78) if layer_has_indexer(config, i)]
    assert len(with_indexer) == 21, "one indexer per four layers: 21 of 78"
    assert with_indexer[:3] == [0, 1, 5] and with_indexer[-1] == 77
    # Everything else is GLM-5's.
    glm5, _ = planner.read_model_config(GLM5_PRESET)
    changed = {k for k in data if data[k] != glm5.get(k)}
    assert changed == {
        "index_topk_freq",
        "index_skip_topk_offset",
        "max_position_embeddings",
        "num_nextn_predict_layers",
        "quantization_config",
    }


def test_glm53_at_1m_on_the_announcements_node_starts_only_with_hybrid_and_pays_for_the_resolver():
    request = PlanRequest(
        **{
            **ANNOUNCEMENT,
            "model": "glm-5.3",
            "weights_dtype": "auto",
            "max_model_len": MILLION,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
        }
    )
    result = plan(request)
    assert result.num_indexer_layers == 21 and result.max_model_len == MILLION
    assert [c.starts for c in result.configurations] == [False, False, True]
    none, hybrid = result.configuration("none"), result.configuration("hybrid")
    # The memory profile holds the resolver's plans and state: hybrid's KV cache is that much smaller.
    assert hybrid.kv_cache_bytes < none.kv_cache_bytes
    assert any("the resolver's per-step plans" in note for note in result.notes)
    assert hybrid.running_sessions > 3 * none.running_sessions


def test_a_hugging_face_id_is_read_from_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    glm5, _ = planner.read_model_config(GLM5_PRESET)
    snapshot = tmp_path / "models--zai-org--GLM-5" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(glm5))
    (tmp_path / "models--zai-org--GLM-5" / "refs").mkdir()
    (tmp_path / "models--zai-org--GLM-5" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    data, label = planner.read_model_config("zai-org/GLM-5")
    assert data == json.loads(json.dumps(glm5)) and label == str(snapshot / "config.json")
    with pytest.raises(PlannerError, match="not in the local Hugging Face cache.*huggingface-cli download"):
        planner.read_model_config("zai-org/GLM-5.3")


def test_the_deploy_docs_capacity_plan_is_what_the_planner_prints_for_its_command(tmp_path):
    """docs/deploy.md shows a planner command and its output: they stay the same."""
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    section = doc[doc.index("## Capacity plan for the node") :]
    command = re.search(r"```bash\n(python -m vllm\.v1\.hisparse\.capacity plan .*?)\n```", section, re.S)
    assert command is not None, "the section shows the planner's command"
    argv = shlex.split(command[1].replace("\\\n", " "))[4:]
    out = tmp_path / "plan.md"
    assert main([*argv, "--output", str(out)]) == 0
    assert out.read_text().strip() in section, "docs/deploy.md shows what the command prints"


SERVE_LINE = (
    "vllm serve glm-5.3 --tensor-parallel-size 8 --max-model-len 1048576 --kv-cache-dtype fp8 "
    '--attention-config \'{"hisparse_config":{"host_pool_gib":384}}\' --kv-offloading-size 128 '
    "--served-model-name glm --enable-prefix-caching --max-num-seqs 64"
)


def test_a_whole_serve_line_plans_as_its_flags_do_and_lists_the_flags_it_does_not_use(capsys):
    flags = (
        "--model",
        "glm-5.3",
        "-tp",
        "8",
        "--max-model-len",
        "1048576",
        "--kv-cache-dtype",
        "fp8",
        *HISPARSE_FLAG,
        "--kv-offloading-size",
        "128",
        "--max-num-seqs",
        "64",
    )
    code, by_flags, _ = run(capsys, *flags, "--gpu-memory-gib", "141", "--format", "json")
    assert code == 0
    code, by_line, _ = run(
        capsys, "--serve-command", SERVE_LINE, "--gpu-memory-gib", "141", "--format", "json"
    )
    assert code == 0
    by_flags, by_line = json.loads(by_flags), json.loads(by_line)
    unused = [n for n in by_line["notes"] if n.startswith("not used by the plan")]
    assert unused == [
        "not used by the plan: --enable-prefix-caching, --served-model-name (from --serve-command)"
    ]
    by_line["notes"].remove(unused[0])
    assert by_line == by_flags


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--serve-command", SERVE_LINE, "-tp", "4"), "--tensor-parallel-size is given in --serve-command"),
        (("--serve-command", SERVE_LINE, "--model", "glm-5"), "give the model once"),
        (("--serve-command", "vllm serve --max-model-len 4096"), "give the model first"),
        (("--serve-command", "vllm serve glm-5.3 --no-such-flag 1"), "vllm serve does not accept it"),
        (("--serve-command", "vllm serve glm-5.3", "--gpu-memory-gib", "141"), "--attention-config is"),
    ],
)
def test_a_serve_line_that_cannot_be_planned_is_refused_by_name(capsys, argv, named):
    code, _, err = run(capsys, *argv)
    assert code == 2 and named in err


@pytest.mark.parametrize("preset", ["glm-5.3", GLM5_PRESET])
def test_the_plan_reports_what_hisparses_kv_cache_groups_cost_the_device(preset):
    """The grouping tax: tokens held with every page resident in the same KV cache bytes, in
    upstream's single group and in HiSparse's groups (no resolver reserve with an exact KV
    cache size, so the hybrid configuration's own figure is the grouped one)."""
    result = glm5(model=preset, max_model_len=200_000)
    none, hybrid = result.configuration("none"), result.configuration("hybrid")
    (note,) = [n for n in result.notes if n.startswith("grouping tax")]
    assert f"hold {hybrid.device_tokens:,} tokens where upstream's (1) hold {none.device_tokens:,}" in note
    assert 0 < hybrid.device_tokens < none.device_tokens
    assert len(hybrid.group_layers) > 1 == len(none.group_layers)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--session-tokens", "0"),
        ("--session-tokens", "-5"),
        ("--gpu-memory-utilization", "1.5"),
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-gib", "inf"),
        ("--gpu-memory-gib", "nan"),
        ("--tensor-parallel-size", "0"),
        ("--overhead-gib", "-1"),
        ("--max-num-seqs", "0"),
    ],
)
def test_the_planner_refuses_impossible_arguments_naming_the_flag(flag, value, capsys):
    from vllm.v1.hisparse.capacity import planner

    with pytest.raises(SystemExit) as exited:
        planner.argument_parser().parse_args(["--model", "glm-5.3", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "is outside" in err


def test_vllm_030s_hisparse_connector_plans_as_the_announcements_two_flags(capsys):
    """vLLM 0.30 writes HiSparse as a HiSparseConnector inside a MultiConnector with the
    OffloadingConnector: the planner reads it as hisparse_config plus that connector."""
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 128 * GiB}}  # fmt: skip
    hisparse = {"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"host_pool_gib": 384}}  # fmt: skip
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [hisparse, offload]}}  # fmt: skip
    common = ("--model", "glm-5.3", "-tp", "8", "--kv-cache-dtype", "fp8", "--gpu-memory-gib", "141",
              "--format", "json")  # fmt: skip
    code, ours, _ = run(capsys, *common, *HISPARSE_FLAG, "--kv-transfer-config", json.dumps(offload))
    assert code == 0
    code, theirs, _ = run(capsys, *common, "--kv-transfer-config", json.dumps(multi))
    assert code == 0
    assert json.loads(theirs) == json.loads(ours)
    code, _, err = run(capsys, *common, "--attention-config", '{"hisparse_config":{"host_pool_gib":64}}',
                       "--kv-transfer-config", json.dumps(multi))  # fmt: skip
    assert code == 2 and "disagree" in err
