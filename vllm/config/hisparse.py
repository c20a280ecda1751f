# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse configuration: `AttentionConfig.hisparse_config`.

Owns the operator-facing surface of Hybrid HiSparse: the typed config parsed
from `--attention-config '{"hisparse_config": {...}}'` (and from
`LLM(attention_config=...)`), its validation, its contribution to the config
hash, the start-up checks that need the model (`verify_hisparse_config`), and
the facts every other HiSparse module reads: whether HiSparse is active in this
process (`hisparse_active`), the page geometry, and the names of the layouts
and backends it needs.

It is the leaf of HiSparse's dependencies: it imports no `vllm.v1.hisparse`
module. It must never allocate memory or touch the scheduler or workers: those
read the validated config.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import field_validator, model_validator

from vllm.config.utils import config, get_hash_factors, hash_factors
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

HiSparseMode = Literal["hybrid", "always"]
# How the KV cache is grouped with HiSparse on (vllm/v1/hisparse/kv_grouping.py): k
# sparse-MLA groups plus the resident group ("groups"), or one sparse-MLA group plus a
# resident group of m-page blocks ("page").
HiSparseKVLayout = Literal["groups", "page"]

GiB = 1 << 30
# Page geometry of the sparse-MLA KV cache: the CUDA sparse-MLA backends of
# vLLM 0.29.0 use 64-token blocks, and a HiSparse page is one such block.
SPARSE_MLA_PAGE_TOKENS = 64
# No host has a pebibyte of RAM: a larger (or non-finite) host_pool_gib is a typo, refused
# while parsing; start-up then checks the pool against the host's own memory.
MAX_HOST_POOL_GIB = 1 << 20
# Bytes per token of one layer in the fp8_ds_mla cache layout (FlashMLA): 512 fp8
# latent values, 4 float32 scales and 64 bf16 rope values.
FP8_SPARSE_MLA_BYTES_PER_TOKEN = 512 + 4 * 4 + 64 * 2
# Complete pages at the end of a request that stay on the device besides the
# page it is writing: decode attention keeps picking recent tokens, so demoting
# them would only turn into row misses on the next steps.
RESIDENT_TAIL_PAGES = 1
# Consecutive scheduling steps a preemption may wait for pages marked for
# copy-then-free with nothing freed meanwhile: their copies land within a step or
# two, so a longer wait means they cannot free anything, and the scheduler preempts.
MAX_PREEMPTION_DEFERRALS = 4
# The default hot buffer holds this many times the model's index top-K rows.
DEFAULT_HOT_BUFFER_TOPK_MULTIPLE = 2
# Block-outermost KV cache layout: KV cache groups with different page sizes
# share each block's bytes (see vllm/v1/hisparse/kv_grouping.py).
HISPARSE_KV_CACHE_LAYOUT = "BLHNC"
# The attention backends whose sparse-MLA attention resolves through HiSparse, by
# registry name (see vllm/v1/hisparse/sparse_mla.py); the first is the CPU test bed's.
RESOLVING_BACKENDS = ("CPU_SPARSE_MLA", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE")
# CUDA compute capability majors whose sparse-MLA backends resolve (Hopper, Blackwell DC).
RESOLVING_CUDA_MAJORS = (9, 10)
# Speculative methods HiSparse serves. The target model verifies any method's drafts
# like a short prefill, which the resolver handles token by token. Model-free
# drafters read no KV cache; an MTP drafter's layers stay resident (they join the
# indexer group, see vllm/v1/hisparse/kv_grouping.py). Other draft models would
# read demoted pages through their own, unwired, attention layers.
SUPPORTED_SPECULATIVE_METHODS = ("ngram", "suffix", "mtp")
# Eviction policy of an OffloadingConnector tier that sets none, with HiSparse on. The
# tier then holds the indexer keys (and an MTP drafter's layers) of session histories,
# each read back once per turn, in turn: once the histories outgrow it, LRU evicts each
# one just before its next turn, and every turn recomputes its history. ARC keeps the
# blocks read back at least once apart from the stream of new ones (vLLM's CPU and
# tiering specs implement both; eviction_policy in kv_connector_extra_config chooses).
HISTORY_TIER_EVICTION_POLICY = "arc"


@config
class HiSparseConfig:
    """Hybrid HiSparse residency for the sparse-MLA KV cache of DSA models.

    While the GPU KV pool has room everything stays resident; under pressure
    older pages move to a host pool and each request keeps its tail plus a
    small GPU hot buffer that is filled row by row as the indexer picks tokens.
    """

    host_pool_gib: float
    """Host memory for the HiSparse page pool, in GiB per node (required, > 0)."""

    device_buffer_size: int | None = None
    """Hot-buffer rows per request on the GPU. Default: 2 x the model's index
    top-K, or (1 + n) x top-K with n speculative tokens per step. Must be at least
    the model's index top-K."""

    staging_rows: int | None = None
    """Rows per request and step (in every sparse-MLA layer) that a prefill chunk or a
    draft verification over host pages may load beyond its hot buffer, leased from the
    KV cache pool for that step. A step whose tokens select more distinct host rows
    than the hot buffer and these hold attends in passes over its query tokens, so the
    chunk keeps its length. Default: device_buffer_size. 0: no staging (passes of at
    most the hot buffer's rows)."""

    mode: HiSparseMode = "hybrid"
    """"hybrid": offload only under KV-cache pressure. "always": keep only each
    request's tail resident regardless of pressure (the original HiSparse
    behaviour, kept for ablations)."""

    proactive_copy: bool = True
    """Copy completed prefix pages of fully resident requests to the host pool
    ahead of pressure, so pressure can free them without waiting for a copy."""

    kv_layout: HiSparseKVLayout = "groups"
    """"groups": k sparse-MLA KV cache groups plus one resident group (indexer and MTP
    layers), every group in 64-token blocks, so a page costs k + 1 blocks. "page": one
    sparse-MLA group (a page is one block) plus a resident group whose blocks hold m
    pages, which cuts the scheduler's per-block work several-fold at 32-64 long sessions;
    a prefix hit ending inside a resident block takes a private copy of it."""

    @model_validator(mode="before")
    @classmethod
    def reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            cls.check_keys(data, "hisparse_config")
        return data

    @classmethod
    def check_keys(cls, data: dict[str, Any], where: str) -> None:
        """Refuse a key that is not a field, naming it, `where` it was given and the valid keys."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            valid = ", ".join(sorted(known))
            raise ValueError(f"unknown key {unknown[0]!r} in {where}; valid keys are {valid}")

    @field_validator("host_pool_gib")
    @classmethod
    def validate_host_pool_gib(cls, value: float) -> float:
        if not 0 < value <= MAX_HOST_POOL_GIB:
            raise ValueError(
                f"hisparse_config.host_pool_gib must be > 0 and at most {MAX_HOST_POOL_GIB} (got "
                f"{value}); set it to the host memory in GiB HiSparse may use, e.g. 384 (start-up "
                "checks that the host has it)"
            )
        return value

    @field_validator("device_buffer_size")
    @classmethod
    def validate_device_buffer_size(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(
                f"hisparse_config.device_buffer_size must be >= 1 row (got {value}); leave "
                "it unset for the default of 2 x the model's index top-K"
            )
        return value

    @field_validator("staging_rows")
    @classmethod
    def validate_staging_rows(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(
                f"hisparse_config.staging_rows must be >= 0 rows (got {value}); leave it unset "
                "for the default of device_buffer_size"
            )
        return value

    @property
    def host_pool_bytes(self) -> int:
        return int(self.host_pool_gib * GiB)

    def compute_hash(self) -> str:
        """Hash of the fields that change the compiled graph or the KV layout.

        Whether HiSparse is on, its mode and the hot-buffer size shape the
        attention path and the KV cache layout; the host pool size, the staging
        budget and the proactive-copy switch are runtime policy only.
        """
        factors = get_hash_factors(self, {"host_pool_gib", "proactive_copy", "staging_rows"})
        return hash_factors(factors)

    def uuid(self) -> str:
        # vLLM's normalize_value() prefers uuid() over hashing every field,
        # so AttentionConfig.compute_hash folds in only compute_hash()'s factors.
        return self.compute_hash()


# Whether the workers execute residency plans, when set (a test harness that
# plays the worker sets it); None decides by platform, see plans_executable().
workers_execute_plans: bool | None = None
# Whether configs made here are for this machine (False while the capacity planner and
# simulator build configs of another node): start-up checks of this machine's resources
# (/dev/shm) run only then.
configs_for_this_machine: bool = True


def plans_executable() -> bool:
    """Whether this build's workers execute residency plans on this platform.

    The CPU sparse-MLA backend and the CUDA sparse-MLA backends of Hopper and
    Blackwell data-centre GPUs resolve through HiSparse (see
    `vllm/v1/hisparse/sparse_mla.py`). Elsewhere HiSparse stays off after
    validating its config: upstream's KV cache grouping, layout, start-up sizing
    and admission, no scheduler or worker state, and a KV connector that handles
    every group.
    """
    if workers_execute_plans is not None:
        return workers_execute_plans
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return True
    if not current_platform.is_cuda():
        return False
    capability = current_platform.get_device_capability()
    return capability is not None and capability.major in RESOLVING_CUDA_MAJORS


def hisparse_active(vllm_config: VllmConfig) -> bool:
    """Whether Hybrid HiSparse runs in this engine: `hisparse_config` is set and the
    workers execute residency plans on this platform."""
    return vllm_config.attention_config.hisparse_config is not None and plans_executable()


def sparse_mla_index_topk(vllm_config: VllmConfig) -> int | None:
    """The model's index top-K if it is a sparse-MLA (DSA) model (one that names an index
    top-K, whatever its value: start-up refuses one below 1), else None."""
    model_config = vllm_config.model_config
    if model_config is None or not model_config.use_mla:
        return None
    topk = getattr(model_config.hf_text_config, "index_topk", None)
    return int(topk) if topk is not None else None


def sparse_mla_page_bytes(vllm_config: VllmConfig) -> int:
    """Bytes of one page (64 tokens) of every sparse-MLA layer together."""
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    if vllm_config.cache_config.cache_dtype == "fp8_ds_mla":
        per_token = FP8_SPARSE_MLA_BYTES_PER_TOKEN
    elif vllm_config.cache_config.cache_dtype.startswith("fp8"):
        per_token = hf.kv_lora_rank + hf.qk_rope_head_dim  # one byte per value, no scales
    else:
        dtype = model_config.dtype
        assert not isinstance(dtype, str), f"model dtype {dtype!r} is not resolved yet"
        per_token = (hf.kv_lora_rank + hf.qk_rope_head_dim) * dtype.itemsize
    return per_token * SPARSE_MLA_PAGE_TOKENS * model_config.get_total_num_hidden_layers()


def host_pool_pages(vllm_config: VllmConfig) -> int:
    """Pages the host pool holds: `host_pool_gib` per node, shared by the node's
    tensor-parallel ranks (each holds the same sparse-MLA latent cache)."""
    hisparse = vllm_config.attention_config.hisparse_config
    assert hisparse is not None
    return hisparse.host_pool_bytes // sparse_mla_page_bytes(vllm_config)


def default_hot_buffer_rows(vllm_config: VllmConfig, topk: int) -> int:
    """2 x top-K rows, or (1 + n) x top-K when each decode step verifies n draft tokens.

    A step resolves all its query tokens at once, and a decode step of n drafts
    selects up to (n + 1) x top-K rows: a hot buffer that holds them needs no
    staging rows on decode steps.
    """
    speculative = vllm_config.speculative_config
    drafts = (speculative.num_speculative_tokens or 0) if speculative is not None else 0
    return max(DEFAULT_HOT_BUFFER_TOPK_MULTIPLE, 1 + drafts) * topk


SHARED_MEMORY_DIR = "/dev/shm"


def _cpu_bytes(extra: Any) -> int:
    try:
        return max(int((extra or {}).get("cpu_bytes_to_use") or 0), 0)
    except (AttributeError, TypeError, ValueError):
        return 0  # the connector refuses it itself, naming the field


def _offload_tier_bytes(transfer: Any) -> int:
    """Bytes of host memory an OffloadingConnector in `transfer` (alone or inside a
    MultiConnector) maps in /dev/shm: its cpu_bytes_to_use."""
    return sum(_cpu_bytes(settings) for settings in offloading_tier_settings(transfer))


def offloading_tier_settings(transfer: Any) -> list[Any]:
    """The kv_connector_extra_config of each OffloadingConnector in `transfer`, alone or
    inside a MultiConnector (read only)."""
    if transfer is None:
        return []
    extra = transfer.kv_connector_extra_config or {}
    if transfer.kv_connector == "OffloadingConnector":
        return [extra]
    if transfer.kv_connector != "MultiConnector":
        return []
    return [
        sub.get("kv_connector_extra_config") or {}
        for sub in extra.get("connectors") or ()
        if isinstance(sub, dict) and sub.get("kv_connector") == "OffloadingConnector"
    ]


def _with_history_tier_policy(connector: dict[str, Any]) -> dict[str, Any]:
    """One connector's settings (a copy) with `HISTORY_TIER_EVICTION_POLICY` where it is an
    OffloadingConnector that names no eviction policy."""
    extra = connector.get("kv_connector_extra_config") or {}
    if connector.get("kv_connector") != "OffloadingConnector" or "eviction_policy" in extra:
        return connector
    return {
        **connector,
        "kv_connector_extra_config": {**extra, "eviction_policy": HISTORY_TIER_EVICTION_POLICY},
    }


def choose_history_tier_policy(vllm_config: VllmConfig) -> None:
    """An OffloadingConnector tier beside HiSparse (alone or inside a MultiConnector) that
    names no eviction policy gets `HISTORY_TIER_EVICTION_POLICY` (see there); one that names
    its own keeps it. The caller's dicts are not changed."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        return
    extra = dict(transfer.kv_connector_extra_config or {})
    if transfer.kv_connector == "OffloadingConnector":
        chosen = _with_history_tier_policy(
            {"kv_connector": transfer.kv_connector, "kv_connector_extra_config": extra}
        )
        extra = chosen["kv_connector_extra_config"]
    elif transfer.kv_connector == "MultiConnector" and extra.get("connectors"):
        extra["connectors"] = [
            _with_history_tier_policy(sub) if isinstance(sub, dict) else sub for sub in extra["connectors"]
        ]
    else:
        return
    if extra == (transfer.kv_connector_extra_config or {}):
        return
    transfer.kv_connector_extra_config = extra
    logger.info(
        "Hybrid HiSparse: the OffloadingConnector's tier holds session histories' indexer keys, "
        "read back once per turn; it evicts with %r (set eviction_policy in "
        "kv_connector_extra_config to choose another).",
        HISTORY_TIER_EVICTION_POLICY,
    )


def shared_memory_needs(vllm_config: VllmConfig) -> list[tuple[str, int]]:
    """(setting, bytes) of what an engine started with `vllm_config` maps in /dev/shm on one
    node: the host pool when the ranks of a node share it (tensor parallelism), and a KV
    offloading tier; each data-parallel engine of the node has its own."""
    hisparse = vllm_config.attention_config.hisparse_config
    parallel = vllm_config.parallel_config
    engines = max(int(getattr(parallel, "data_parallel_size_local", 1) or 1), 1)
    needs = []
    if hisparse is not None and parallel.tensor_parallel_size > 1:
        setting = f"hisparse_config.host_pool_gib={hisparse.host_pool_gib}"
        needs.append((setting, hisparse.host_pool_bytes * engines))
    offload = _offload_tier_bytes(vllm_config.kv_transfer_config)
    if offload:
        needs.append((f"kv_connector_extra_config.cpu_bytes_to_use={offload}", offload * engines))
    return needs


def check_shared_memory(vllm_config: VllmConfig, free_bytes: int | None = None) -> None:
    """Refuse to start when the host pool and a KV offloading tier both live in /dev/shm and
    together do not fit there (each alone is checked where it is made): naming both settings,
    the total and what /dev/shm has free, instead of failing half-way through start-up."""
    needs = shared_memory_needs(vllm_config)
    if len(needs) < 2 or not configs_for_this_machine:
        return
    if free_bytes is None:
        try:
            info = os.statvfs(SHARED_MEMORY_DIR)
        except OSError:
            return
        free_bytes = info.f_bavail * info.f_frsize
    total = sum(n for _, n in needs)
    if total > free_bytes:
        parts = " + ".join(f"{setting} ({n / GiB:.2f} GiB)" for setting, n in needs)
        raise ValueError(
            f"Hybrid HiSparse: {parts} = {total / GiB:.2f} GiB must fit in {SHARED_MEMORY_DIR}, "
            f"which has {free_bytes / GiB:.2f} GiB free. Give the container more shared memory "
            f"(docker run --shm-size={math.ceil(total / GiB * 1.05)}g, or --ipc=host), or lower "
            "host_pool_gib or cpu_bytes_to_use"
        )


UPSTREAM_CONNECTOR = "HiSparseConnector"


def split_hisparse_connector(transfer: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """vLLM 0.30 spells HiSparse as a KV connector: `HiSparseConnector`, alone or inside a
    MultiConnector. From a --kv-transfer-config dict: its settings (its
    kv_connector_extra_config), and the config left once it is taken out: None when it was
    alone, the other connector (with the outer kv_role and engine_id unless it has its own)
    when one remains, else the MultiConnector without it. (None, transfer) when it is not
    there."""
    if transfer.get("kv_connector") == UPSTREAM_CONNECTOR:
        return dict(transfer.get("kv_connector_extra_config") or {}), None
    if transfer.get("kv_connector") != "MultiConnector":
        return None, transfer
    extra = dict(transfer.get("kv_connector_extra_config") or {})
    connectors = list(extra.get("connectors") or ())
    ours = [c for c in connectors if isinstance(c, dict) and c.get("kv_connector") == UPSTREAM_CONNECTOR]
    if not ours:
        return None, transfer
    if len(ours) > 1:
        raise ValueError(f"--kv-transfer-config names {UPSTREAM_CONNECTOR} {len(ours)} times; name it once")
    rest = [c for c in connectors if c is not ours[0]]
    settings = dict(ours[0].get("kv_connector_extra_config") or {})
    if not rest:
        return settings, None
    if len(rest) == 1:
        outer = {k: transfer[k] for k in ("kv_role", "engine_id") if transfer.get(k) is not None}
        return settings, {**outer, **rest[0]}
    return settings, {**transfer, "kv_connector_extra_config": {**extra, "connectors": rest}}


def _hisparse_connector_settings(transfer: Any) -> tuple[dict[str, Any] | None, Any]:
    """`split_hisparse_connector` of a KVTransferConfig: the remaining config as one."""
    if transfer is None or transfer.kv_connector not in (UPSTREAM_CONNECTOR, "MultiConnector"):
        return None, transfer
    given = {"kv_connector": transfer.kv_connector, "kv_role": transfer.kv_role,
             "engine_id": transfer.engine_id,
             "kv_connector_extra_config": transfer.kv_connector_extra_config or {}}  # fmt: skip
    settings, rest = split_hisparse_connector(given)
    if settings is None:
        return None, transfer
    if rest is None:
        return settings, None
    if rest["kv_connector"] == "MultiConnector":
        transfer.kv_connector_extra_config = rest["kv_connector_extra_config"]
        return settings, transfer
    from vllm.config.kv_transfer import KVTransferConfig

    return settings, KVTransferConfig(**rest)


def adopt_hisparse_connector(vllm_config: VllmConfig) -> None:
    """Read vLLM 0.30's `HiSparseConnector` in --kv-transfer-config as hisparse_config (it is
    not a KV connector in this build). With both spellings, they must agree on every
    setting the connector gives; otherwise start-up is refused naming both."""
    settings, rest = _hisparse_connector_settings(vllm_config.kv_transfer_config)
    if settings is None:
        return
    attention = vllm_config.attention_config
    HiSparseConfig.check_keys(
        settings, f"{UPSTREAM_CONNECTOR}'s kv_connector_extra_config, which is read as hisparse_config"
    )
    if attention.hisparse_config is None:
        try:
            attention.hisparse_config = HiSparseConfig(**settings)
        except Exception as error:
            raise ValueError(
                f"{UPSTREAM_CONNECTOR}'s kv_connector_extra_config is read as hisparse_config: {error}"
            ) from None
    else:
        differ = {k: (v, getattr(attention.hisparse_config, k)) for k, v in settings.items()
                  if getattr(attention.hisparse_config, k) != v}  # fmt: skip
        if differ:
            key, (theirs, ours) = next(iter(differ.items()))
            raise ValueError(
                f"--kv-transfer-config's {UPSTREAM_CONNECTOR} sets {key}={theirs!r} but "
                f"--attention-config's hisparse_config sets {key}={ours!r}: keep one of them "
                "(they are two spellings of the same setting)"
            )
    vllm_config.kv_transfer_config = rest
    logger.info(
        "Hybrid HiSparse: %s in --kv-transfer-config read as --attention-config "
        "'{\"hisparse_config\": %s}'%s",
        UPSTREAM_CONNECTOR,
        settings,
        "" if rest is None else f"; the KV connector is now {rest.kv_connector}",
    )


def verify_hisparse_config(vllm_config: VllmConfig) -> None:
    """Start-up checks that need the model; resolves the hot-buffer default."""
    adopt_hisparse_connector(vllm_config)
    hisparse = vllm_config.attention_config.hisparse_config
    if hisparse is None or vllm_config.model_config is None:
        return
    model = vllm_config.model_config.model
    topk = sparse_mla_index_topk(vllm_config)
    if topk is None:
        raise ValueError(
            f"hisparse_config is set but {model} is not a sparse-MLA (DSA) model: Hybrid "
            "HiSparse needs an index top-K (GLM-5.x, DeepSeek-V3.2). Remove hisparse_config "
            "from --attention-config for this model"
        )
    if topk < 1:
        raise ValueError(
            f"hisparse_config is set but {model}'s config gives index_topk={topk}: a sparse-MLA "
            "model selects at least one row per token. Fix index_topk in the checkpoint's "
            "config.json (or --hf-overrides), or remove hisparse_config"
        )
    default = default_hot_buffer_rows(vllm_config, topk)
    longest = max(vllm_config.model_config.max_model_len, default)
    if hisparse.device_buffer_size is not None and hisparse.device_buffer_size > longest:
        raise ValueError(
            f"hisparse_config.device_buffer_size is {hisparse.device_buffer_size} rows, more than "
            f"{model} can ever select (max_model_len {vllm_config.model_config.max_model_len}, "
            f"default {default}): hot rows past a request's whole context are never used. Set it "
            f"at most {longest}, or leave it unset for the default {default}"
        )
    if hisparse.device_buffer_size is None:
        hisparse.device_buffer_size = default
    elif hisparse.device_buffer_size < topk:
        raise ValueError(
            f"hisparse_config.device_buffer_size is {hisparse.device_buffer_size} rows but "
            f"{model} selects index_topk={topk} rows per step; set device_buffer_size >= "
            f"{topk} or leave it unset for the default {default}"
        )
    if hisparse.staging_rows is None:
        hisparse.staging_rows = hisparse.device_buffer_size
    page_bytes = sparse_mla_page_bytes(vllm_config)
    if host_pool_pages(vllm_config) < 1:
        raise ValueError(
            f"hisparse_config.host_pool_gib={hisparse.host_pool_gib} holds no page of {model}: "
            f"one page of all sparse-MLA layers is {page_bytes} bytes "
            f"({page_bytes / GiB:.4f} GiB); raise host_pool_gib"
        )
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        raise ValueError(
            f"hisparse_config does not support pipeline parallelism (--pipeline-parallel-size "
            f"{pipeline}) in this build: each stage holds other layers' pages, and the scheduler "
            "would demote a page before every stage had copied its layers of it. Use tensor "
            "parallelism (--tensor-parallel-size) across the GPUs instead, or remove hisparse_config"
        )
    parallel = vllm_config.parallel_config
    if parallel.use_ubatching:
        raise ValueError(
            "hisparse_config does not support micro-batching (--enable-dbo or --ubatch-size "
            f"{parallel.ubatch_size}) in this build: each step's resolution plans are kept per "
            "layer for the whole batch, so a second micro-batch would read the first one's rows. "
            "Remove --enable-dbo / --ubatch-size, or remove hisparse_config"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ValueError(
            "hisparse_config needs the hybrid KV cache manager (separate KV cache groups for "
            "the sparse-MLA and indexer caches); remove --disable-hybrid-kv-cache-manager"
        )
    speculative = vllm_config.speculative_config
    if speculative is not None and speculative.method not in SUPPORTED_SPECULATIVE_METHODS:
        raise ValueError(
            f"hisparse_config does not support speculative_config method "
            f"{speculative.method!r} in this build: its draft model's attention layers are "
            "not wired to HiSparse residency, so their reads of demoted pages would be "
            f"wrong. Use one of {', '.join(SUPPORTED_SPECULATIVE_METHODS)} (mtp: the "
            "checkpoint's own next-token layers), or remove --speculative-config or "
            "hisparse_config"
        )
    if plans_executable():
        check_shared_memory(vllm_config)
        choose_history_tier_policy(vllm_config)
        # Groups with different page sizes overlay each block's bytes only in a
        # block-outermost layout (see vllm/v1/hisparse/kv_grouping.py).
        vllm_config.cache_config.kv_cache_layout = HISPARSE_KV_CACHE_LAYOUT
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            route_sparse_mla_through_the_resolver(vllm_config)
        logger.info(
            "Hybrid HiSparse: on (mode=%s, host_pool_gib=%s, device_buffer_size=%d, staging_rows=%d).",
            hisparse.mode,
            hisparse.host_pool_gib,
            hisparse.device_buffer_size,
            hisparse.staging_rows,
        )
    else:
        logger.warning(
            "Hybrid HiSparse: hisparse_config is valid (mode=%s, host_pool_gib=%s, "
            "device_buffer_size=%d), but the sparse-MLA attention backends of this platform "
            "do not resolve through HiSparse in this build: it stays off, and the KV cache, "
            "its layout and any KV connector work exactly as without it.",
            hisparse.mode,
            hisparse.host_pool_gib,
            hisparse.device_buffer_size,
        )


def route_sparse_mla_through_the_resolver(vllm_config: VllmConfig) -> None:
    """On CUDA: every sparse-MLA read must go where the resolver can see it.

    - Only backends whose top-K attention resolves through HiSparse
      (`RESOLVING_BACKENDS`) may run; vLLM picks one of them on Hopper and
      Blackwell unless told otherwise.
    - Prefills take the top-K (MQA) path: the dense and masked MHA prefill paths
      read a request's whole context through its block table, where a demoted
      page is the null block.
    - CUDA graphs are piecewise, so attention runs eagerly and the resolver runs
      on the steps that need it; a full graph would replay the fully resident
      path.
    - Context parallelism splits the KV cache across ranks, which the host pool
      and the hot buffers do not.
    - The V1 model runner executes the plans; `VllmConfig.use_v2_model_runner`
      keeps it whenever hisparse_config is set (patch 0001), unless the V2 runner
      is forced, which is refused here.
    """
    from vllm import envs
    from vllm.config.compilation import CUDAGraphMode

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(
            "hisparse_config runs on vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER=1 "
            "selects the V2 runner; unset VLLM_USE_V2_MODEL_RUNNER or remove hisparse_config"
        )

    attention = vllm_config.attention_config
    if attention.backend is not None and attention.backend.name not in RESOLVING_BACKENDS:
        raise ValueError(
            f"hisparse_config needs a sparse-MLA attention backend that resolves through it; "
            f"--attention-backend is {attention.backend.name}. Use one of "
            f"{', '.join(RESOLVING_BACKENDS[1:])}, or leave it unset"
        )
    parallel = vllm_config.parallel_config
    for field in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, field, 1)
        if size > 1:
            raise ValueError(
                f"hisparse_config does not support context parallelism ({field}={size}); "
                f"set it to 1 or remove hisparse_config"
            )
    if not attention.sparse_mla_force_mqa:
        attention.sparse_mla_force_mqa = True
        logger.info("Hybrid HiSparse: sparse-MLA prefills take the top-K path (sparse_mla_force_mqa).")
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_mode is None or compilation.cudagraph_mode.has_full_cudagraphs():
        logger.info(
            "Hybrid HiSparse: CUDA graphs are piecewise (was %s) so the resolver runs on the steps "
            "that need it.",
            "the default" if compilation.cudagraph_mode is None else compilation.cudagraph_mode.name,
        )
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
