# SPDX-License-Identifier: Apache-2.0
"""`--attention-config '{"hisparse_config": {...}}'`: parsing, validation, hashing."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest

from vllm.config import AttentionConfig
from vllm.config.hisparse import HiSparseConfig, verify_hisparse_config
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

REPO = Path(__file__).resolve().parents[2]
ANNOUNCED = '{"hisparse_config":{"host_pool_gib":384}}'


@pytest.fixture(scope="module")
def parser():
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def parse_error(parser, capsys, attention_config: str) -> str:
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--attention-config", attention_config])
    assert exc.value.code == 2
    return capsys.readouterr().err.split("error:", 1)[1]


def test_cli_accepts_the_announced_flag(parser):
    args = parser.parse_args(["--attention-config", ANNOUNCED])
    hisparse = args.attention_config.hisparse_config
    assert hisparse == HiSparseConfig(host_pool_gib=384)
    assert (hisparse.mode, hisparse.device_buffer_size, hisparse.proactive_copy) == ("hybrid", None, True)
    assert hisparse.host_pool_bytes == 384 << 30


def test_cli_accepts_every_field(parser):
    value = {"host_pool_gib": 1.5, "device_buffer_size": 4096, "mode": "always", "proactive_copy": False}
    args = parser.parse_args(["--attention-config", json.dumps({"hisparse_config": value})])
    assert args.attention_config.hisparse_config == HiSparseConfig(**value)


def test_hisparse_is_off_by_default(parser):
    assert parser.parse_args([]).attention_config.hisparse_config is None
    assert AttentionConfig().hisparse_config is None


POOL_RANGE = "hisparse_config.host_pool_gib must be > 0 and at most 1048576"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"host_pool_gib": -1}, f"{POOL_RANGE} (got -1"),
        ({"host_pool_gib": 0}, f"{POOL_RANGE} (got 0"),
        ({"host_pool_gib": float("inf")}, f"{POOL_RANGE} (got inf"),
        ({"host_pool_gib": float("nan")}, f"{POOL_RANGE} (got nan"),
        ({"host_pool_gib": 1e308}, f"{POOL_RANGE} (got 1e+308"),
        ({"host_pool_gib": 8, "device_buffer_size": 0}, "hisparse_config.device_buffer_size must be >= 1"),
        ({"device_buffer_size": 0}, "hisparse_config.device_buffer_size must be >= 1"),
        ({"device_buffer_size": 512}, "hisparse_config.host_pool_gib\n  Field required"),
        ({"host_pool_gib": 8, "pool_gib": 2}, "unknown key 'pool_gib' in hisparse_config"),
        (
            {"host_pool_gib": 8, "mode": "eager"},
            "hisparse_config.mode\n  Input should be 'hybrid' or 'always'",
        ),
    ],
)
def test_cli_rejects_bad_values_naming_the_field(parser, capsys, value, named):
    err = parse_error(parser, capsys, json.dumps({"hisparse_config": value}))
    assert named in err


def test_llm_style_dict_is_validated_too():
    args = EngineArgs(model="unused", attention_config={"hisparse_config": {"host_pool_gib": 2}})
    assert args.attention_config.hisparse_config == HiSparseConfig(host_pool_gib=2)
    with pytest.raises(ValueError, match="hisparse_config.host_pool_gib must be > 0"):
        EngineArgs(model="unused", attention_config={"hisparse_config": {"host_pool_gib": -3}})


def test_config_hash_follows_layout_fields_only():
    off = AttentionConfig().compute_hash()
    on = AttentionConfig(hisparse_config=HiSparseConfig(host_pool_gib=384)).compute_hash()
    bigger_pool = AttentionConfig(hisparse_config=HiSparseConfig(host_pool_gib=512)).compute_hash()
    no_copy = AttentionConfig(
        hisparse_config=HiSparseConfig(host_pool_gib=384, proactive_copy=False)
    ).compute_hash()
    always = AttentionConfig(hisparse_config=HiSparseConfig(host_pool_gib=384, mode="always")).compute_hash()
    buffer = AttentionConfig(
        hisparse_config=HiSparseConfig(host_pool_gib=384, device_buffer_size=8192)
    ).compute_hash()
    page = AttentionConfig(hisparse_config=HiSparseConfig(host_pool_gib=384, kv_layout="page")).compute_hash()
    assert on != off
    assert on == bigger_pool == no_copy
    assert len({on, always, buffer, page}) == 4


def test_kv_layout_is_groups_unless_page_is_chosen_and_anything_else_is_refused():
    assert HiSparseConfig(host_pool_gib=1).kv_layout == "groups"
    assert HiSparseConfig(host_pool_gib=1, kv_layout="page").kv_layout == "page"
    with pytest.raises(ValueError, match="kv_layout[\\s\\S]*'groups' or 'page'"):
        HiSparseConfig(host_pool_gib=1, kv_layout="pages")


def engine_config(model_dir: Path, hisparse: dict):
    return EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, attention_config={"hisparse_config": hisparse}
    ).create_engine_config()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_startup_resolves_default_buffer_and_says_hisparse_is_on(tiny_glm_dsa_dir):
    records = _Records()
    logger = logging.getLogger("vllm.config.hisparse")
    logger.addHandler(records)
    try:
        config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    finally:
        logger.removeHandler(records)
    assert config.attention_config.hisparse_config.device_buffer_size == 2 * 32
    assert config.attention_config.hisparse_config.staging_rows == 2 * 32, "the staging budget: a hot buffer"
    assert config.cache_config.kv_cache_layout == "BLHNC", "groups of different page sizes overlay blocks"
    expected = "Hybrid HiSparse: on (mode=hybrid, host_pool_gib=1.0, device_buffer_size=64, staging_rows=64)"
    assert any(expected in m for m in records.messages), records.messages


def test_a_negative_staging_budget_is_refused_naming_the_default():
    refused = "staging_rows must be >= 0 rows \\(got -1\\).*default of device_buffer_size"
    with pytest.raises(ValueError, match=refused):
        HiSparseConfig(host_pool_gib=1, staging_rows=-1)


def test_startup_rejects_a_model_without_sparse_mla(tiny_llama_dir):
    with pytest.raises(ValueError, match="is not a sparse-MLA \\(DSA\\) model"):
        engine_config(tiny_llama_dir, {"host_pool_gib": 1})


def test_startup_rejects_a_buffer_smaller_than_index_topk(tiny_glm_dsa_dir):
    with pytest.raises(ValueError, match="device_buffer_size is 8 rows .* index_topk=32"):
        engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1, "device_buffer_size": 8})


def test_startup_rejects_a_host_pool_without_room_for_one_page(tiny_glm_dsa_dir):
    with pytest.raises(ValueError, match="host_pool_gib=1e-09 holds no page"):
        engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1e-9})


def test_startup_rejects_hisparse_without_the_hybrid_kv_cache_manager(tiny_glm_dsa_dir):
    with pytest.raises(ValueError, match="remove --disable-hybrid-kv-cache-manager"):
        EngineArgs(
            model=str(tiny_glm_dsa_dir),
            skip_tokenizer_init=True,
            disable_hybrid_kv_cache_manager=True,
            attention_config={"hisparse_config": {"host_pool_gib": 1}},
        ).create_engine_config()


def test_verify_is_a_no_op_when_hisparse_is_off(tiny_glm_dsa_dir):
    config = EngineArgs(model=str(tiny_glm_dsa_dir), skip_tokenizer_init=True).create_engine_config()
    assert config.attention_config.hisparse_config is None
    verify_hisparse_config(config)


@pytest.mark.slow_test
def test_vllm_serve_rejects_a_bad_hisparse_config_before_loading_anything():
    vllm = REPO / ".venv" / "bin" / "vllm"
    done = subprocess.run(
        [
            str(vllm),
            "serve",
            "no/such-model",
            "--attention-config",
            '{"hisparse_config":{"host_pool_gib":-1}}',
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{POOL_RANGE} (got -1" in done.stderr


def speculative_engine_config(model_dir: Path, speculative_config: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        max_model_len=1024,
        attention_config={"hisparse_config": {"host_pool_gib": 1}},
        speculative_config=speculative_config,
    ).create_engine_config()


def test_startup_accepts_the_checkpoints_own_mtp_layers(tmp_path, tiny_glm_dsa_dir):
    # A GLM-5 checkpoint with a next-token layer as its own draft model is MTP.
    config = json.loads((tiny_glm_dsa_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    mtp = speculative_engine_config(tmp_path, {"model": str(tmp_path), "num_speculative_tokens": 3})
    assert mtp.speculative_config.method == "mtp"
    # A decode step verifies 3 drafts: 4 tokens' selections fit the default hot buffer.
    assert mtp.attention_config.hisparse_config.device_buffer_size == 4 * 32


def test_startup_refuses_another_draft_model_with_a_clear_reason(tiny_glm_dsa_dir, tiny_llama_dir):
    draft = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="does not support speculative_config method 'draft_model'"):
        speculative_engine_config(tiny_glm_dsa_dir, draft)


def test_startup_accepts_model_free_drafts(tiny_glm_dsa_dir):
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = speculative_engine_config(tiny_glm_dsa_dir, ngram)
    assert config.attention_config.hisparse_config.device_buffer_size == 3 * 32
    assert config.speculative_config.method == "ngram"


def test_the_tensor_parallel_ranks_of_a_node_share_the_whole_host_pool(tiny_glm_dsa_dir):
    from vllm.config.hisparse import host_pool_pages, sparse_mla_page_bytes

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    single = host_pool_pages(config)
    assert single == (1 << 30) // sparse_mla_page_bytes(config)
    config.parallel_config.tensor_parallel_size = 8  # one copy of a page serves every rank
    assert host_pool_pages(config) == single


def test_startup_refuses_pipeline_parallelism_naming_the_flag_and_the_config(tiny_glm_dsa_dir):
    with pytest.raises(ValueError) as raised:
        EngineArgs(
            model=str(tiny_glm_dsa_dir),
            skip_tokenizer_init=True,
            pipeline_parallel_size=2,
            attention_config={"hisparse_config": {"host_pool_gib": 1}},
        ).create_engine_config()
    message = str(raised.value)
    assert "--pipeline-parallel-size 2" in message and "hisparse_config" in message


class _CudaPlatform:
    """A CUDA platform of a given compute capability (the seam: no GPU here)."""

    def __init__(self, major: int) -> None:
        self.major = major

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def get_device_capability(self):
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(self.major, 0)


@pytest.mark.parametrize(("major", "executable"), [(9, True), (10, True), (12, False)])
def test_plans_run_on_the_gpus_whose_sparse_mla_backends_resolve(monkeypatch, major, executable):
    import vllm.platforms
    from vllm.config.hisparse import plans_executable

    monkeypatch.setattr(vllm.platforms, "_current_platform", _CudaPlatform(major))
    assert plans_executable() is executable


def test_on_cuda_every_sparse_mla_read_goes_where_the_resolver_sees_it(tiny_glm_dsa_dir):
    from vllm.config.compilation import CUDAGraphMode
    from vllm.config.hisparse import route_sparse_mla_through_the_resolver

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    route_sparse_mla_through_the_resolver(config)
    assert config.attention_config.sparse_mla_force_mqa, "no dense or masked MHA prefill"
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE

    config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    route_sparse_mla_through_the_resolver(config)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE, "eager stays eager"


@pytest.mark.parametrize("backend", ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE"])
def test_on_cuda_the_resolving_backends_are_accepted(tiny_glm_dsa_dir, backend):
    from vllm.config.hisparse import route_sparse_mla_through_the_resolver
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    config.attention_config.backend = AttentionBackendEnum[backend]
    route_sparse_mla_through_the_resolver(config)


def test_on_cuda_a_backend_that_does_not_resolve_is_refused_by_name(tiny_glm_dsa_dir):
    from vllm.config.hisparse import route_sparse_mla_through_the_resolver
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    config.attention_config.backend = AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM120
    refused = "--attention-backend is FLASHINFER_MLA_SPARSE_SM120. Use one of FLASHMLA_SPARSE"
    with pytest.raises(ValueError, match=refused):
        route_sparse_mla_through_the_resolver(config)


def test_on_cuda_context_parallelism_is_refused(tiny_glm_dsa_dir):
    from vllm.config.hisparse import route_sparse_mla_through_the_resolver

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        route_sparse_mla_through_the_resolver(config)


def test_hisparse_keeps_the_v1_model_runner_that_executes_its_plans(tiny_glm_dsa_dir):
    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    assert "Hybrid HiSparse (hisparse_config)" in config._get_v2_model_runner_unsupported_features()


def test_on_cuda_a_forced_v2_model_runner_is_refused(tiny_glm_dsa_dir, monkeypatch):
    from vllm import envs
    from vllm.config.hisparse import route_sparse_mla_through_the_resolver

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1 selects the V2 runner"):
        route_sparse_mla_through_the_resolver(config)


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "fp8", "auto"])
def test_a_page_is_sized_by_the_cache_dtypes_row(tiny_glm_dsa_dir, cache_dtype):
    from vllm.config.hisparse import sparse_mla_page_bytes

    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    hf = config.model_config.hf_text_config
    values = hf.kv_lora_rank + hf.qk_rope_head_dim
    bytes_per_token = {
        "fp8_ds_mla": 512 + 4 * 4 + 64 * 2,  # FlashMLA's row: fp8 latent, fp32 scales, bf16 rope
        "fp8": values,
        "auto": values * config.model_config.dtype.itemsize,
    }[cache_dtype]
    config.cache_config.cache_dtype = cache_dtype
    layers = config.model_config.get_total_num_hidden_layers()
    assert sparse_mla_page_bytes(config) == bytes_per_token * 64 * layers


@pytest.mark.parametrize(
    ("field", "value", "named"), [("enable_dbo", True, "--enable-dbo"), ("ubatch_size", 2, "--ubatch-size 2")]
)
def test_startup_refuses_micro_batching_naming_both_settings(tiny_glm_dsa_dir, field, value, named):
    # Plans are kept per layer for the whole batch: a second micro-batch would replay them.
    config = engine_config(tiny_glm_dsa_dir, {"host_pool_gib": 1})
    setattr(config.parallel_config, field, value)
    with pytest.raises(ValueError) as raised:
        verify_hisparse_config(config)
    message = str(raised.value)
    assert named in message and "hisparse_config" in message and "micro-batching" in message


def test_startup_names_an_index_topk_of_zero_plainly(tiny_glm_dsa_dir):
    with pytest.raises(ValueError, match=r"index_topk=0: a sparse-MLA model selects at least one row"):
        EngineArgs(
            model=str(tiny_glm_dsa_dir),
            skip_tokenizer_init=True,
            hf_overrides={"index_topk": 0},
            attention_config={"hisparse_config": {"host_pool_gib": 1}},
        ).create_engine_config()


def test_startup_refuses_a_hot_buffer_larger_than_any_context(tiny_glm_dsa_dir):
    # Hot rows past a request's whole context are never used; an absurd size is a typo.
    with pytest.raises(ValueError, match=r"device_buffer_size is 100000 rows, more than .* at most 2048"):
        EngineArgs(
            model=str(tiny_glm_dsa_dir),
            skip_tokenizer_init=True,
            max_model_len=2048,
            attention_config={"hisparse_config": {"host_pool_gib": 1, "device_buffer_size": 100000}},
        ).create_engine_config()


def test_startup_refuses_a_host_pool_and_an_offload_tier_that_do_not_fit_in_dev_shm_together(
    tiny_glm_dsa_dir, monkeypatch
):
    """The tensor-parallel ranks' shared host pool and an OffloadingConnector's tier both live
    in /dev/shm: start-up refuses a sum that does not fit there, naming both settings and the
    container's shared-memory flags; each alone (or the sum where it fits) starts."""
    import vllm.config.hisparse as hisparse_config

    gib = 1 << 30
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 3 * gib}}  # fmt: skip
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [offload]}}  # fmt: skip

    def config(transfer, tensor_parallel=2):
        return EngineArgs(
            model=str(tiny_glm_dsa_dir), skip_tokenizer_init=True, tensor_parallel_size=tensor_parallel,
            attention_config={"hisparse_config": {"host_pool_gib": 2}}, kv_transfer_config=transfer,
            distributed_executor_backend="mp",
        ).create_engine_config()  # fmt: skip

    class Fs:
        f_frsize = 4096

        def __init__(self, free: int) -> None:
            self.f_bavail = free // self.f_frsize

    monkeypatch.setattr(hisparse_config.os, "statvfs", lambda path: Fs(4 * gib))
    for transfer in (offload, multi):
        with pytest.raises(ValueError) as refused:
            config(transfer)
        message = str(refused.value)
        for named in ("host_pool_gib=2", f"cpu_bytes_to_use={3 * gib}", "5.00 GiB", "/dev/shm",
                      "4.00 GiB free", "--shm-size", "--ipc=host"):  # fmt: skip
            assert named in message, (named, message)
    config(offload, tensor_parallel=1)  # one rank: its pool is private memory, not /dev/shm
    config(None)  # the pool alone (checked where it is made)
    monkeypatch.setattr(hisparse_config.os, "statvfs", lambda path: Fs(6 * gib))
    config(offload)


def test_vllm_030s_hisparse_connector_is_read_as_hisparse_config(tiny_glm_dsa_dir):
    """vLLM 0.30 spells HiSparse `--kv-transfer-config '{"kv_connector":"HiSparseConnector",...}'`,
    alone or inside a MultiConnector beside the OffloadingConnector: the same settings."""
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}  # fmt: skip
    hisparse = {"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"host_pool_gib": 2}}  # fmt: skip

    def config(transfer, attention=None):
        return EngineArgs(
            model=str(tiny_glm_dsa_dir), skip_tokenizer_init=True, kv_transfer_config=transfer,
            attention_config=attention or {},
        ).create_engine_config()  # fmt: skip

    alone = config(hisparse)
    assert alone.attention_config.hisparse_config.host_pool_gib == 2
    assert alone.kv_transfer_config is None, "HiSparse is not a KV connector in this build"
    multi = config({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"connectors": [hisparse, offload]}})  # fmt: skip
    assert multi.attention_config.hisparse_config.host_pool_gib == 2
    assert multi.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert multi.kv_transfer_config.kv_connector_extra_config == {
        "cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc"}  # fmt: skip
    assert multi.kv_transfer_config.kv_role == "kv_both"
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}  # fmt: skip
    three = config({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"connectors": [offload, hisparse, example]}})  # fmt: skip
    connectors = three.kv_transfer_config.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in connectors] == ["OffloadingConnector", "ExampleConnector"]
    # Both spellings: they must agree.
    both = config(hisparse, {"hisparse_config": {"host_pool_gib": 2, "mode": "always"}})
    assert both.attention_config.hisparse_config.mode == "always" and both.kv_transfer_config is None
    with pytest.raises(ValueError) as refused:
        config(hisparse, {"hisparse_config": {"host_pool_gib": 8}})
    assert "host_pool_gib=2" in str(refused.value) and "host_pool_gib=8.0" in str(refused.value)
    with pytest.raises(ValueError, match="unknown key 'pool_size'"):
        config({**hisparse, "kv_connector_extra_config": {"host_pool_gib": 2, "pool_size": 3}})


def test_an_offloading_tier_beside_hisparse_evicts_with_arc_unless_it_names_its_policy(tiny_glm_dsa_dir):
    """Beside HiSparse the OffloadingConnector's tier holds session histories' indexer keys,
    read back once per turn, in turn, which LRU evicts just before they are read (see
    HISTORY_TIER_EVICTION_POLICY): a tier that names no eviction policy, alone or inside a
    MultiConnector, gets ARC, and says so; one that names its own, or a tier without
    HiSparse, keeps what it has. The caller's dicts are left as they were."""
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}  # fmt: skip
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}  # fmt: skip
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [offload, example]}}  # fmt: skip
    as_given = json.dumps([offload, example, multi])

    def tier_settings(transfer, hisparse=True):
        config = EngineArgs(
            model=str(tiny_glm_dsa_dir), skip_tokenizer_init=True, kv_transfer_config=transfer,
            attention_config={"hisparse_config": {"host_pool_gib": 1}} if hisparse else {},
        ).create_engine_config()  # fmt: skip
        return config.kv_transfer_config.kv_connector_extra_config

    records = _Records()
    logger = logging.getLogger("vllm.config.hisparse")
    logger.addHandler(records)
    try:
        alone = tier_settings(offload)
    finally:
        logger.removeHandler(records)
    assert alone == {"cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc"}
    assert any("evicts with 'arc'" in m and "eviction_policy" in m for m in records.messages), (
        records.messages
    )
    inside = tier_settings(multi)["connectors"]
    assert inside[0]["kv_connector_extra_config"]["eviction_policy"] == "arc"
    assert inside[1] == example, "another connector's settings are its own"
    named = {**offload, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30, "eviction_policy": "lru"}}
    assert tier_settings(named)["eviction_policy"] == "lru"
    assert "eviction_policy" not in tier_settings(offload, hisparse=False), "without HiSparse: upstream's"
    assert json.dumps([offload, example, multi]) == as_given
