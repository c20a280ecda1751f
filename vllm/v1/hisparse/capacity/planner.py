# SPDX-License-Identifier: Apache-2.0
"""Capacity planner for DSA models: `python -m vllm.v1.hisparse.capacity plan`.

Owns the answer to "what fits on this node" for a sparse-MLA (DSA) model under
three KV cache policies, given the flags of `vllm serve`:

- `none`: every session wholly resident; under pressure vLLM preempts;
- `offload`: the same on the device, plus the OffloadingConnector's host tier;
- `hybrid`: Hybrid HiSparse (with the connector, when one is configured).

For each it reports the KV blocks, the tokens the device holds fully resident,
how many sessions fit FULL, how many more run MIXED/NONE on a hot lease and the
host pool bytes those need, the longest context that starts, and whether
`--max-model-len` starts at all.

It does not re-derive vLLM's KV arithmetic: the VllmConfig comes from
`EngineArgs` with the same flags, each layer's KV cache spec from the layer
class's own `get_kv_cache_spec` (called on the attributes the layer would have,
without building it), the groups and block count from `get_kv_cache_configs`
(HiSparse's grouping included), "does it start" from running that same
start-up check, a FULL session's blocks from vLLM's per-request rule, a leased
session's from HiSparse's (`hisparse_device_blocks_per_request`), host pages
from `host_pool_pages`, and the connector's tier from its own offloading spec.
What it adds is the model-side input vLLM gets from the built model (which
layers hold which cache), an estimate of the weights, and the counting.

It plans for a GPU where HiSparse's residency plans run (Hopper or Blackwell
data-centre parts), whatever machine it runs on. It never allocates device or
host memory, loads weights, or starts an engine, a worker or a connector.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import vllm.config.hisparse as hisparse_settings
from vllm.config.hisparse import (
    RESIDENT_TAIL_PAGES,
    SPARSE_MLA_PAGE_TOKENS,
    host_pool_pages,
    sparse_mla_page_bytes,
    split_hisparse_connector,
)
from vllm.v1.hisparse.kv_grouping import (
    INDEXER_LAYER_SUFFIX,
    hisparse_device_blocks_per_request,
)
from vllm.v1.hisparse.offloading import hisparse_connector_view

if TYPE_CHECKING:
    import torch

    from vllm.config import CacheConfig, VllmConfig
    from vllm.config.cache import CacheDType
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

GiB = 1 << 30
GLM5_PRESET = "glm-5"
# GLM-5.2 and GLM-5.3: GLM-5's architecture (GlmMoeDsaForCausalLM) with shared indexers
# and a 1M-token context; see `glm53_preset_config`.
GLM53_PRESETS = ("glm-5.3", "glm-5.2")
PRESETS = (*GLM53_PRESETS, GLM5_PRESET)
# The announcement's agentic sessions are admitted up to 142K tokens (read as
# 142,000): a session is counted at the largest context it may reach.
DEFAULT_SESSION_TOKENS = 142_000
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Per GPU, besides the weights: the activation peak of the profiling run at
# max_num_batched_tokens, CUDA graph pools, NCCL buffers, MLA's absorbed
# up-projection copies and allocator slack. An assumption: calibrate it with the
# "Available KV cache memory" that `vllm serve` logs, or pass
# --kv-cache-memory-bytes to plan with the exact figure.
DEFAULT_OVERHEAD_GIB = 6.0
# The sparse-MLA backend assumed for a quantized KV cache: FlashMLA-sparse, whose
# fp8_ds_mla layout vLLM picks for DSA models with an fp8 KV cache on Hopper.
DEFAULT_SPARSE_MLA_BACKEND = "FLASHMLA_SPARSE"
# vLLM's DSA indexer stores fp8 keys with one float32 scale per 128 values.
INDEXER_QUANT_BLOCK = 128
SPARSE_MLA_LAYER_NAME = "model.layers.{}.self_attn.attn"
INDEXER_LAYER_NAME = "model.layers.{}.self_attn" + INDEXER_LAYER_SUFFIX
BYTES_PER_WEIGHT = {"fp8": 1, "bfloat16": 2, "float16": 2, "float32": 4}

Configuration = Literal["none", "offload", "hybrid"]
CONFIGURATIONS: tuple[Configuration, ...] = ("none", "offload", "hybrid")


class PlannerError(ValueError):
    """Input the planner cannot plan for; the message names the value and the fix."""


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: a model, a node and the `vllm serve` flags of the deployment."""

    model: str
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None
    weights_gib: float | None = None
    weights_dtype: str = "auto"
    overhead_gib: float = DEFAULT_OVERHEAD_GIB
    hisparse_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    kv_transfer_config: dict[str, Any] | None = None
    offload_baseline_bytes: int | None = None
    speculative_config: dict[str, Any] | None = None
    hf_overrides: dict[str, Any] | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    attention_backend: str | None = None
    session_tokens: int = DEFAULT_SESSION_TOKENS
    # Flags of a `vllm serve` line (--serve-command) that do not change the plan.
    unused_serve_flags: tuple[str, ...] = ()


def parse_json_flag(flag: str, text: str) -> dict[str, Any]:
    """A JSON object given on the command line, or an error naming the flag and the text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as bad:
        raise PlannerError(
            f"{flag} is not valid JSON ({bad.msg} at character {bad.pos}): {text!r}; quote it "
            f"for the shell, e.g. {flag} '{{\"key\": 1}}'"
        ) from None
    if not isinstance(value, dict):
        raise PlannerError(f"{flag} must be a JSON object, got {text!r}")
    return value


def hisparse_config_from_attention_config(attention_config: dict[str, Any]) -> dict[str, Any]:
    """The `hisparse_config` object inside `--attention-config`."""
    hisparse = attention_config.get("hisparse_config")
    if not isinstance(hisparse, dict) or "host_pool_gib" not in hisparse:
        raise PlannerError(
            f"--attention-config {json.dumps(attention_config)} has no hisparse_config with a "
            "host_pool_gib; pass the deployment's, e.g. --attention-config "
            '\'{"hisparse_config":{"host_pool_gib":384}}\''
        )
    return hisparse


def offloading_connector_config(kv_transfer_config: dict[str, Any]) -> dict[str, Any]:
    """`--kv-transfer-config`, checked to be an OffloadingConnector with its host bytes."""
    connector = kv_transfer_config.get("kv_connector")
    if connector != "OffloadingConnector":
        raise PlannerError(
            f"--kv-transfer-config names kv_connector {connector!r}; the planner models the "
            'OffloadingConnector only ("kv_connector":"OffloadingConnector")'
        )
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    cpu_bytes = extra.get("cpu_bytes_to_use")
    if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes <= 0:
        raise PlannerError(
            f"--kv-transfer-config: kv_connector_extra_config.cpu_bytes_to_use is {cpu_bytes!r}; "
            "give the connector's host bytes as a positive integer, e.g. 137438953472 (128 GiB)"
        )
    return {"kv_role": "kv_both", **kv_transfer_config}


def connector_cpu_bytes(kv_transfer_config: dict[str, Any] | None) -> int:
    if kv_transfer_config is None:
        return 0
    return int(kv_transfer_config["kv_connector_extra_config"]["cpu_bytes_to_use"])


def with_cpu_bytes(kv_transfer_config: dict[str, Any] | None, cpu_bytes: int) -> dict[str, Any]:
    """The connector config with `cpu_bytes` of host memory (a plain tier when none is given)."""
    base = kv_transfer_config or {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    extra = {**(base.get("kv_connector_extra_config") or {}), "cpu_bytes_to_use": cpu_bytes}
    return {**base, "kv_connector_extra_config": extra}


def serve_batch_defaults(gpu_memory_gib: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` of vLLM 0.29.0 picks on a
    CUDA GPU of this size (EngineArgs.get_batch_defaults), for planning from any machine."""
    if gpu_memory_gib >= 160:
        return 16384, 1024
    if gpu_memory_gib >= 70:
        return 8192, 1024
    return 2048, 256


# ----------------------------------------------------------------------------- the model


def glm5_preset_config() -> dict[str, Any]:
    """GLM-5's shapes: the defaults of the installed transformers' GlmMoeDsaConfig, whose
    docstring names zai-org/GLM-5 (78 layers, MLA with kv_lora_rank 512 and rope 64, an
    indexer of 32 x 128 with index_topk 2048, 256 routed experts; about 744B parameters)."""
    try:
        from transformers import GlmMoeDsaConfig
    except ImportError:
        raise PlannerError(
            "--model glm-5 needs transformers' GlmMoeDsaConfig, which the installed transformers "
            "lacks; pass GLM-5's config.json instead (--model /path/to/GLM-5)"
        ) from None
    data = GlmMoeDsaConfig().to_dict()
    data["architectures"] = ["GlmMoeDsaForCausalLM"]
    # The released checkpoints are bfloat16 (the FP8 one keeps bfloat16 outside its linears).
    data["dtype"] = "bfloat16"
    return data


def glm53_preset_config() -> dict[str, Any]:
    """GLM-5.3's (and GLM-5.2's) shapes: GLM-5's, with the figures below changed.

    The sources, figure by figure:
    - index_topk_freq 4: GLM-5.2/5.3 share one indexer among four layers (IndexCache),
      about 21 indexer layers of 78 (this project's announcement and capacity issue).
    - index_skip_topk_offset 2: an assumption. It is vLLM 0.29.0's default for GLM's
      sharing (layers 0 and 1, then every fourth from layer 1: 21 of 78 layers), the one
      that gives the published count; pass the checkpoint's config.json to use its own.
    - max_position_embeddings 1,048,576: the 1M-token context of the announcement.
    - num_nextn_predict_layers 1: one MTP layer, as GLM-5's checkpoints ship (the
      announcement runs MTP with three speculative tokens).
    - quantization_config fp8, 128 x 128 weight blocks: the FP8 checkpoint the
      announcement serves; an assumption where its config is not at hand.
    - everything else (78 layers, hidden 6144, 256 routed experts of 2048, MLA with
      kv_lora_rank 512 and rope 64, index_topk 2048, an indexer of 32 x 128): assumed
      equal to GLM-5's, `glm5_preset_config`, since the architecture is the same.
    """
    data = glm5_preset_config()
    data.update(
        index_topk_freq=4,
        index_skip_topk_offset=2,
        max_position_embeddings=1_048_576,
        num_nextn_predict_layers=1,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    )
    # transformers' per-layer lists describe GLM-5 (an indexer in every layer): vLLM 0.29.0
    # builds the layers from index_topk_freq and the offset, so they are left out.
    data.pop("indexer_types", None)
    return data


def hugging_face_cached_config(model: str) -> Path | None:
    """config.json of a Hugging Face model id ("org/name") in the local cache, if there."""
    if model.count("/") != 1 or model.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a valid repository id
        return None
    return Path(found) if isinstance(found, str) else None


def read_model_config(model: str) -> tuple[dict[str, Any], str]:
    """(config.json's content, a label) for a model directory, a config.json, a Hugging Face
    id in the local cache, or a preset."""
    if model == GLM5_PRESET:
        return glm5_preset_config(), "glm-5 (transformers GlmMoeDsaConfig defaults)"
    if model in GLM53_PRESETS:
        return glm53_preset_config(), f"{model} (GLM-5's shapes, 21 shared indexers, 1M positions, MTP, FP8)"
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        cached = hugging_face_cached_config(model)
        if cached is None:
            where = (
                f"{model} is not in the local Hugging Face cache (fetch its config with "
                f"`huggingface-cli download {model} config.json`)"
                if model.count("/") == 1 and not path.exists()
                else f"no config.json at {file}"
            )
            raise PlannerError(
                f"--model {model}: {where}; pass a model directory holding config.json, the "
                f"config.json file itself, a Hugging Face id in the local cache, or one of "
                f"{', '.join(PRESETS)}"
            )
        file = cached
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise PlannerError(
            f"--model {model}: {file} is not valid JSON ({bad}); pass the model's config.json"
        ) from None
    if not isinstance(data, dict):
        raise PlannerError(f"--model {model}: {file} holds {type(data).__name__}, not a config object")
    text_config = data.get("text_config")
    text = text_config if isinstance(text_config, dict) else data
    if not text.get("index_topk") or not text.get("kv_lora_rank"):
        kind = data.get("model_type") or data.get("architectures") or "unknown"
        raise PlannerError(
            f"--model {model}: {file} describes a {kind} model without sparse MLA (no index_topk "
            "or kv_lora_rank); the planner and Hybrid HiSparse need a DSA model such as GLM-5.x "
            "or DeepSeek-V3.2"
        )
    return data, str(file)


def weights_dtype_of(data: dict[str, Any], requested: str) -> str:
    """The weights' storage type: as requested, else FP8 for FP8 checkpoints, else the dtype."""
    if requested != "auto":
        if requested not in BYTES_PER_WEIGHT:
            raise PlannerError(
                f"--weights-dtype {requested!r}: use one of auto, {', '.join(BYTES_PER_WEIGHT)}"
            )
        return requested
    quantization = data.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method == "fp8":
            return "fp8"
        raise PlannerError(
            f"config.json is quantized with {method!r}, whose weight size the planner does not "
            "estimate; pass --weights-gib (the weights per GPU) or --weights-dtype"
        )
    dtype = str(data.get("dtype") or data.get("torch_dtype") or "bfloat16")
    return dtype if dtype in BYTES_PER_WEIGHT else "bfloat16"


def staged_model_dir(data: dict[str, Any], workdir: Path) -> Path:
    """A directory holding only config.json, as vLLM's ModelConfig reads it.

    The weights' quantization is left out: it does not change the KV cache, and
    a CPU-only machine would otherwise refuse an FP8 checkpoint's config.
    """
    staged = {key: value for key, value in data.items() if key != "quantization_config"}
    (workdir / "config.json").write_text(json.dumps(staged))
    return workdir


def layer_has_indexer(hf_config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` has its own indexer, hence an indexer K cache.

    As vLLM 0.29.0 builds DSA layers: checkpoints that share top-K selections
    (IndexCache) give indexers only to the layers `index_topk_pattern` marks "F",
    or without a pattern to every `index_topk_freq`-th layer counted from
    `index_skip_topk_offset` (and the layers before it); an MTP drafter's
    layers, numbered after the decoder's, always have one.
    """
    num_layers = hf_config.num_hidden_layers
    if layer >= num_layers:
        return True
    pattern = getattr(hf_config, "index_topk_pattern", None)
    if pattern is not None:
        return not (layer < len(pattern) and pattern[layer] == "S")
    freq = getattr(hf_config, "index_topk_freq", 1) or 1
    offset = getattr(hf_config, "index_skip_topk_offset", 2)
    return max(layer - offset + 1, 0) % freq == 0


def drafter_layer_count(vllm_config: VllmConfig) -> int:
    """KV cache layers an MTP drafter adds (its own next-token layers)."""
    speculative = vllm_config.speculative_config
    if speculative is None or speculative.method != "mtp":
        return 0
    return int(getattr(vllm_config.model_config.hf_config, "num_nextn_predict_layers", 0) or 0)


@dataclass(frozen=True)
class _SparseMLALayer:
    """The attributes `MLAAttention.get_kv_cache_spec` reads from its layer."""

    kv_cache_dtype: str
    head_size: int
    sliding_window: int | None = None
    non_causal_multi_token_decode: bool = False


@dataclass(frozen=True)
class _IndexerCacheLayer:
    """The attributes the DSA indexer cache's `get_kv_cache_spec` reads from its layer."""

    cache_config: CacheConfig
    head_dim: int
    dtype: torch.dtype


def sparse_mla_cache_dtype(kv_cache_dtype: str, attention_backend: str | None) -> str:
    """The sparse-MLA cache dtype the layers store, as vLLM settles it with the backend
    (FlashMLA-sparse turns a quantized cache into its fp8_ds_mla layout)."""
    from vllm.model_executor.layers.attention.mla_attention import _canonicalize_sparse_mla_kv_cache_dtype
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    name = attention_backend or DEFAULT_SPARSE_MLA_BACKEND
    try:
        backend = AttentionBackendEnum[name].get_class()
    except KeyError:
        raise PlannerError(f"--attention-backend {name!r} is not a vLLM attention backend") from None
    # A name vLLM's cache config accepts (the serve parser checked it against CacheDType).
    return _canonicalize_sparse_mla_kv_cache_dtype(backend, cast("CacheDType", kv_cache_dtype))


def resolve_layout(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], attention_backend: str | None
) -> None:
    """Settle the KV cache layout as the engine core does from its workers' backends
    (the sparse-MLA backend and the indexer's), unless it is already set."""
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    backends: list[Any] = [  # backend classes
        AttentionBackendEnum[attention_backend or DEFAULT_SPARSE_MLA_BACKEND].get_class(),
        DeepseekV32IndexerBackend,
    ]
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vllm_config, [supported], list(specs.values()))


def layer_kv_cache_specs(
    vllm_config: VllmConfig, attention_backend: str | None = None
) -> dict[str, KVCacheSpec]:
    """Every KV cache layer's spec, named and ordered as the built model registers them.

    Sets `cache_config.cache_dtype` to the layout the sparse-MLA layers store, as
    building them does, and the KV cache layout, as the engine core does next.
    """
    import torch

    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    hf = vllm_config.model_config.hf_text_config
    cache_config = vllm_config.cache_config
    cache_config.cache_dtype = cast(
        "CacheDType", sparse_mla_cache_dtype(cache_config.cache_dtype, attention_backend)
    )
    # The stand-in layers carry only the attributes get_kv_cache_spec reads.
    sparse_mla = MLAAttention.get_kv_cache_spec(
        cast(Any, _SparseMLALayer)(cache_config.cache_dtype, hf.kv_lora_rank + hf.qk_rope_head_dim),
        vllm_config,
    )
    indexer_head = hf.index_head_dim + hf.index_head_dim // INDEXER_QUANT_BLOCK * 4
    indexer = DeepseekV32IndexerCache.get_kv_cache_spec(
        cast(Any, _IndexerCacheLayer)(cache_config, indexer_head, torch.uint8),
        vllm_config,
    )
    specs: dict[str, KVCacheSpec] = {}
    for layer in range(hf.num_hidden_layers + drafter_layer_count(vllm_config)):
        if layer_has_indexer(hf, layer):
            specs[INDEXER_LAYER_NAME.format(layer)] = indexer
        specs[SPARSE_MLA_LAYER_NAME.format(layer)] = sparse_mla
    resolve_layout(vllm_config, specs, attention_backend)
    return specs


# ----------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class WeightsEstimate:
    """The weights one GPU holds."""

    bytes_per_gpu: int
    total_params: int | None
    dtype: str
    source: str


def _mlp_is_moe(hf: Any, layer: int) -> bool:
    kinds = getattr(hf, "mlp_layer_types", None)
    if kinds is not None and layer < len(kinds):
        return kinds[layer] == "sparse"
    freq = getattr(hf, "moe_layer_freq", 1) or 1
    return (
        bool(getattr(hf, "n_routed_experts", 0)) and layer >= hf.first_k_dense_replace and layer % freq == 0
    )


def estimate_weights(hf: Any, tensor_parallel_size: int, dtype: str, mtp_layers: int = 0) -> WeightsEstimate:
    """Parameters from the config's shapes, split as vLLM shards them across TP ranks.

    The attention's down-projections, the indexer and the norms are replicated on
    every rank; the up/out projections, MLPs, experts, embeddings and LM head are
    split. With FP8 weights the linear layers take one byte per parameter (block
    scales, under 0.1%, are left out); embeddings, LM head, norms, router and the
    indexer's key projection keep the checkpoint's bfloat16.
    """
    h, heads = hf.hidden_size, hf.num_attention_heads
    qk_head = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    # (sharded, quantized) -> parameters
    buckets = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}

    def add(params: int, sharded: bool, quantized: bool) -> None:
        buckets[(sharded, quantized)] += params

    def decoder_layer(layer: int) -> None:
        if hf.q_lora_rank:
            add(h * (hf.q_lora_rank + hf.kv_lora_rank + hf.qk_rope_head_dim), False, True)
            add(hf.q_lora_rank * heads * qk_head, True, True)
            add(hf.q_lora_rank, False, False)
        else:
            add(h * heads * qk_head, True, True)
            add(h * (hf.kv_lora_rank + hf.qk_rope_head_dim), False, True)
        add(hf.kv_lora_rank * heads * (hf.qk_nope_head_dim + hf.v_head_dim), True, True)
        add(heads * hf.v_head_dim * h, True, True)
        add(hf.kv_lora_rank + 2 * h, False, False)
        if layer_has_indexer(hf, layer):
            add((hf.q_lora_rank or h) * hf.index_n_heads * hf.index_head_dim, False, True)
            add(h * (hf.index_head_dim + hf.index_n_heads) + 2 * hf.index_head_dim, False, False)
        if layer >= hf.num_hidden_layers or _mlp_is_moe(hf, layer):
            experts = hf.n_routed_experts + (getattr(hf, "n_shared_experts", 0) or 0)
            add(experts * 3 * h * hf.moe_intermediate_size, True, True)
            add(h * hf.n_routed_experts + hf.n_routed_experts, False, False)
        else:
            add(3 * h * hf.intermediate_size, True, True)

    for layer in range(hf.num_hidden_layers + mtp_layers):
        decoder_layer(layer)
    add(mtp_layers * (2 * h * h + 3 * h), False, False)
    lm_heads = 1 if getattr(hf, "tie_word_embeddings", False) else 2
    add(lm_heads * hf.vocab_size * h, True, False)
    add(h, False, False)

    plain = 2 if dtype == "fp8" else BYTES_PER_WEIGHT[dtype]
    linear = BYTES_PER_WEIGHT[dtype]
    per_gpu = 0.0
    for (sharded, quantized), params in buckets.items():
        share = params / tensor_parallel_size if sharded else params
        per_gpu += share * (linear if quantized else plain)
    return WeightsEstimate(
        bytes_per_gpu=int(per_gpu),
        total_params=sum(buckets.values()),
        dtype=dtype,
        source="estimated from config.json",
    )


# ----------------------------------------------------------------------------- planning


@contextmanager
def _attributes(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of a question, as vLLM's own estimators do."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextmanager
def _where_hisparse_runs() -> Iterator[None]:
    """Plan for a GPU whose sparse-MLA backends run HiSparse's residency plans, whatever
    machine the planner runs on."""
    saved = hisparse_settings.workers_execute_plans, hisparse_settings.configs_for_this_machine
    hisparse_settings.workers_execute_plans = True
    hisparse_settings.configs_for_this_machine = False  # the node planned for, not this one
    try:
        yield
    finally:
        hisparse_settings.workers_execute_plans, hisparse_settings.configs_for_this_machine = saved


@contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs every grouping and start-up check; the planner asks hundreds of them."""
    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_logger.setLevel(saved)


def engine_config(
    request: PlanRequest,
    model_dir: Path,
    configuration: Configuration,
    max_model_len: int | None,
) -> VllmConfig:
    """The VllmConfig `vllm serve` builds for the deployment's flags in one configuration."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    optional: dict[str, Any] = {}
    if configuration == "hybrid":
        optional["attention_config"] = {"hisparse_config": request.hisparse_config}
        optional["kv_transfer_config"] = request.kv_transfer_config
    elif configuration == "offload":
        optional["kv_transfer_config"] = with_cpu_bytes(request.kv_transfer_config, offload_bytes(request))
    if request.hf_overrides:
        optional["hf_overrides"] = request.hf_overrides
    optional["max_model_len"] = max_model_len  # None: the model's own
    optional = {name: value for name, value in optional.items() if value is not None}
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=request.tensor_parallel_size,
        kv_cache_dtype=cast("CacheDType", request.kv_cache_dtype),
        gpu_memory_utilization=request.gpu_memory_utilization,
        max_num_batched_tokens=request.max_num_batched_tokens,
        max_num_seqs=request.max_num_seqs,
        speculative_config=request.speculative_config,
        **optional,
    )
    return args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def offload_bytes(request: PlanRequest) -> int:
    """Host bytes of the `offload` configuration's tier: as given, else the host memory
    the hybrid configuration uses (HiSparse pool plus connector tier), as the
    announcement's baseline (512 GiB against 384 + 128) did."""
    if request.offload_baseline_bytes is not None:
        return request.offload_baseline_bytes
    pool = int(float(request.hisparse_config["host_pool_gib"]) * GiB)
    return pool + connector_cpu_bytes(request.kv_transfer_config)


def kv_cache_configs_or_refusal(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], kv_bytes: int, max_model_len: int
) -> KVCacheConfig | str:
    """vLLM's KV cache config with this max_model_len, or the start-up check's refusal."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    with _attributes(vllm_config.model_config, max_model_len=max_model_len):
        try:
            kv_cache_config = get_kv_cache_configs(vllm_config, [dict(specs)], [kv_bytes])[0]
        except ValueError as refused:
            return str(refused)
    # The engine core records the resolved layout on the config it hands out.
    kv_cache_config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return kv_cache_config


def longest_starting_context(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], kv_bytes: int, upper: int
) -> int:
    """The largest --max-model-len the engine's start-up check accepts (0: none)."""
    low, high = 0, upper
    while low < high:
        middle = (low + high + 1) // 2
        if isinstance(kv_cache_configs_or_refusal(vllm_config, specs, kv_bytes, middle), str):
            high = middle - 1
        else:
            low = middle
    return low


def full_session_blocks(vllm_config: VllmConfig, groups: list[KVCacheGroupSpec], tokens: int) -> int:
    """Blocks a wholly resident session of `tokens` holds, by vLLM's per-request rule."""
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups, _pool_bytes_per_block

    with _attributes(vllm_config.model_config, max_model_len=tokens):
        return _max_memory_usage_bytes_from_groups(vllm_config, groups) // _pool_bytes_per_block(groups)


def leased_session_blocks(vllm_config: VllmConfig, groups: list[KVCacheGroupSpec], tokens: int) -> int:
    """Device blocks a MIXED/NONE session of `tokens` holds while decoding: every page of
    the resident (indexer) group, and per sparse-MLA group the pages a decode step
    writes, the resident tail and the hot lease, by HiSparse's own rule."""
    speculative = vllm_config.speculative_config
    step_tokens = 1 + ((speculative.num_speculative_tokens or 0) if speculative is not None else 0)
    with (
        _attributes(vllm_config.model_config, max_model_len=tokens),
        _attributes(vllm_config.scheduler_config, max_num_batched_tokens=step_tokens),
    ):
        return hisparse_device_blocks_per_request(vllm_config, groups)


def demoted_pages(tokens: int) -> int:
    """Host pages a MIXED/NONE session of `tokens` needs: its complete pages but the tail."""
    return max(0, tokens // SPARSE_MLA_PAGE_TOKENS - RESIDENT_TAIL_PAGES)


def connector_tier_tokens(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int | None:
    """Tokens of its groups' KV the OffloadingConnector's host tier holds, as its spec sizes it."""
    if vllm_config.kv_transfer_config is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    _, view = hisparse_connector_view(vllm_config, kv_cache_config)
    offloading = build_offloading_config(vllm_config, view)
    spec = OffloadingSpecFactory.create_spec(offloading)
    tokens_per_block = offloading.groups[0].tokens_per_block
    # The CPU spec's block count (not part of the OffloadingSpec interface).
    return int(cast(Any, spec).num_blocks) * offloading.cache.blocks_per_chunk * tokens_per_block


@dataclass
class ConfigurationPlan:
    """What one configuration holds on the node."""

    name: Configuration
    description: str
    num_blocks: int
    usable_blocks: int
    group_layers: list[int]
    block_bytes: int
    device_tokens: int
    session_blocks_full: int
    full_sessions: int
    session_blocks_leased: int | None
    leased_sessions: int
    full_beside_leased: int
    host_bytes_per_leased: int
    host_bytes_used: int
    host_pool_bytes: int
    running_sessions: int
    limited_by: str
    longest_context: int
    max_model_len_refusal: str | None
    connector_tokens: int | None
    # What the configuration was planned from; not part of its report.
    kv_cache_config: KVCacheConfig = dataclasses.field(repr=False, compare=False)
    vllm_config: VllmConfig = dataclasses.field(repr=False, compare=False)
    specs: dict[str, KVCacheSpec] = dataclasses.field(repr=False, compare=False)
    kv_cache_bytes: int = dataclasses.field(repr=False, compare=False, default=0)

    @property
    def starts(self) -> bool:
        return self.max_model_len_refusal is None

    def refusal_at(self, max_model_len: int) -> str | None:
        """Why vLLM's start-up check refuses this --max-model-len (None: it starts)."""
        with _where_hisparse_runs(), _quiet_vllm():
            result = kv_cache_configs_or_refusal(
                self.vllm_config, self.specs, self.kv_cache_bytes, max_model_len
            )
        return result if isinstance(result, str) else None


REPORT_EXCLUDED_FIELDS = ("kv_cache_config", "vllm_config", "specs", "kv_cache_bytes")


@dataclass
class Plan:
    """The node, the model, the workload and every configuration's capacity."""

    model: str
    num_layers: int
    num_indexer_layers: int
    index_topk: int
    tensor_parallel_size: int
    gpu_memory_gib: float | None
    gpu_memory_utilization: float
    weights: WeightsEstimate | None
    overhead_gib: float | None
    kv_cache_bytes_per_gpu: int
    kv_cache_dtype: str
    sparse_mla_bytes_per_token: int
    indexer_bytes_per_token: int
    max_model_len: int
    model_max_len: int
    session_tokens: int
    hot_buffer_rows: int
    mode: str
    max_num_seqs: int
    max_num_batched_tokens: int
    notes: list[str]
    configurations: list[ConfigurationPlan]

    def configuration(self, name: Configuration) -> ConfigurationPlan:
        return next(c for c in self.configurations if c.name == name)


def kv_cache_bytes_per_gpu(request: PlanRequest, weights: WeightsEstimate | None) -> int:
    """KV cache memory of one GPU: as given, else what the memory left after the weights and
    the overhead allowance holds."""
    if request.kv_cache_memory_bytes is not None:
        return request.kv_cache_memory_bytes
    assert request.gpu_memory_gib is not None and weights is not None
    usable = request.gpu_memory_gib * GiB * request.gpu_memory_utilization
    left = int(usable - weights.bytes_per_gpu - request.overhead_gib * GiB)
    if left <= 0:
        raise PlannerError(
            f"--gpu-memory-gib {request.gpu_memory_gib} x --gpu-memory-utilization "
            f"{request.gpu_memory_utilization} leaves {left / GiB:.1f} GiB for the KV cache after "
            f"{weights.bytes_per_gpu / GiB:.1f} GiB of weights per GPU ({weights.dtype}) and the "
            f"{request.overhead_gib} GiB overhead allowance; raise --tensor-parallel-size, use FP8 "
            "weights (--weights-dtype fp8) or a larger --gpu-memory-utilization"
        )
    return left


def resolver_reserve_bytes(
    request: PlanRequest, vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], kv_bytes: int
) -> int:
    """What `profile_run` holds for HiSparse's resolver (`worker.profile_reserve`), so the
    KV cache comes out that much smaller; 0 with --kv-cache-memory-bytes (no profile)."""
    from vllm.v1.hisparse.worker import profile_reserve_bytes, resolver_layers

    if request.kv_cache_memory_bytes is not None:
        return 0
    hisparse = vllm_config.attention_config.hisparse_config
    assert hisparse is not None and hisparse.device_buffer_size is not None
    owners, row_bytes = resolver_layers(specs)
    leases = kv_bytes // max(hisparse.device_buffer_size * row_bytes, 1)
    return profile_reserve_bytes(vllm_config, owners, leases) or 0


def _describe(request: PlanRequest, name: Configuration) -> str:
    if name == "none":
        return "preemption only"
    if name == "offload":
        return f"OffloadingConnector, {offload_bytes(request) / GiB:g} GiB host tier"
    hisparse = request.hisparse_config
    tier = connector_cpu_bytes(request.kv_transfer_config)
    text = f"Hybrid HiSparse, {float(hisparse['host_pool_gib']):g} GiB pool"
    if hisparse.get("mode", "hybrid") != "hybrid":
        text += f", mode={hisparse['mode']}"
    return text + (f" + {tier / GiB:g} GiB connector tier" if tier else "")


def plan_configuration(
    request: PlanRequest,
    name: Configuration,
    vllm_config: VllmConfig,
    specs: dict[str, KVCacheSpec],
    kv_bytes: int,
) -> ConfigurationPlan:
    """Blocks, sessions and contexts of one configuration."""
    from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block

    max_model_len = vllm_config.model_config.max_model_len
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    kv_cache_config = kv_cache_configs_or_refusal(vllm_config, specs, kv_bytes, 1)
    if isinstance(kv_cache_config, str):
        raise PlannerError(f"{kv_cache_config} (configuration {name}, {kv_bytes} bytes of KV cache per GPU)")
    refusal = kv_cache_configs_or_refusal(vllm_config, specs, kv_bytes, max_model_len)
    groups = kv_cache_config.kv_cache_groups
    block_size = groups[0].kv_cache_spec.block_size
    usable = kv_cache_config.num_blocks - 1  # the block pool holds one back as its null block
    hybrid = name == "hybrid"

    blocks_full = full_session_blocks(vllm_config, groups, request.session_tokens)
    full = min(usable // blocks_full, max_num_seqs)
    blocks_per_position = full_session_blocks(vllm_config, groups, block_size)
    device_tokens = usable // blocks_per_position * block_size

    blocks_leased = None
    leased = full_beside = 0
    host_each = host_pool = 0
    limited_by = "max_num_seqs" if full == max_num_seqs else "device"
    if hybrid:
        page_bytes = sparse_mla_page_bytes(vllm_config)  # one copy per node, shared by its TP ranks
        pool_pages = host_pool_pages(vllm_config)
        host_pool = pool_pages * page_bytes
        pages_each = demoted_pages(request.session_tokens)
        host_each = pages_each * page_bytes
        blocks_leased = leased_session_blocks(vllm_config, groups, request.session_tokens)
        if pages_each:
            by_device, by_host = usable // blocks_leased, pool_pages // pages_each
            leased = min(by_device, by_host, max_num_seqs)
            limited_by = "host pool" if leased == by_host < by_device else "device"
            if leased == max_num_seqs:
                limited_by = "max_num_seqs"
        hisparse = vllm_config.attention_config.hisparse_config
        assert hisparse is not None
        mode = hisparse.mode
        if mode == "hybrid":
            full_beside = min((usable - leased * blocks_leased) // blocks_full, max_num_seqs - leased)
        else:
            # "always" keeps only each session's tail resident: no session is FULL.
            full = 0
    upper = usable * block_size
    return ConfigurationPlan(
        name=name,
        description=_describe(request, name),
        num_blocks=kv_cache_config.num_blocks,
        usable_blocks=usable,
        group_layers=[len(group.layer_names) for group in groups],
        block_bytes=_pool_bytes_per_block(groups),
        device_tokens=device_tokens,
        session_blocks_full=blocks_full,
        full_sessions=full,
        session_blocks_leased=blocks_leased,
        leased_sessions=leased,
        full_beside_leased=full_beside,
        host_bytes_per_leased=host_each,
        host_bytes_used=leased * host_each,
        host_pool_bytes=host_pool,
        running_sessions=(leased + full_beside) if hybrid else full,
        limited_by=limited_by,
        longest_context=longest_starting_context(vllm_config, specs, kv_bytes, upper),
        max_model_len_refusal=refusal if isinstance(refusal, str) else None,
        connector_tokens=connector_tier_tokens(vllm_config, kv_cache_config),
        kv_cache_config=kv_cache_config,
        vllm_config=vllm_config,
        specs=specs,
        kv_cache_bytes=kv_bytes,
    )


def resident_tokens(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], kv_bytes: int) -> int:
    """Tokens `kv_bytes` of KV cache hold with every page resident, in this config's layout."""
    kv_cache_config = kv_cache_configs_or_refusal(vllm_config, specs, kv_bytes, 1)
    if isinstance(kv_cache_config, str):
        return 0
    groups = kv_cache_config.kv_cache_groups
    block_size = groups[0].kv_cache_spec.block_size
    usable = kv_cache_config.num_blocks - 1
    return usable // full_session_blocks(vllm_config, groups, block_size) * block_size


def grouping_tax_note(
    none: ConfigurationPlan,
    vllm_config: VllmConfig,
    specs: dict[str, KVCacheSpec],
    kv_bytes: int,
    hybrid: ConfigurationPlan,
) -> str:
    """What HiSparse's KV cache layout costs the device: tokens held all resident with the
    same KV cache bytes, in upstream's groups and in HiSparse's, then less its resolver's
    reserve."""
    grouped = resident_tokens(vllm_config, specs, kv_bytes)
    tax = 1 - grouped / none.device_tokens if none.device_tokens else 0.0
    text = (
        f"grouping tax: with every page resident, HiSparse's KV cache groups ({len(hybrid.group_layers)}) "
        f"hold {grouped:,} tokens where upstream's ({len(none.group_layers)}) hold "
        f"{none.device_tokens:,} ({tax:.1%} fewer)"
    )
    if hybrid.device_tokens != grouped:
        text += f"; less the resolver's reserve, {hybrid.device_tokens:,}"
    return text


def build_engine_configs(
    request: PlanRequest, model_dir: Path, model_max_len_note: list[str]
) -> dict[Configuration, VllmConfig]:
    """One VllmConfig per configuration, max_model_len as requested.

    vLLM refuses a --max-model-len beyond what the config's positions allow
    unless told otherwise; the plan then still answers the memory question.
    """
    configs: dict[Configuration, VllmConfig] = {}
    # The hybrid configuration first: its flags are the ones vLLM validates most.
    for name in ("hybrid", "none", "offload"):
        try:
            vllm_config = engine_config(request, model_dir, name, request.max_model_len)
        except ValueError as refused:
            if request.max_model_len is None:
                raise PlannerError(f"vLLM refuses these flags ({name} configuration): {refused}") from None
            try:
                vllm_config = engine_config(request, model_dir, name, None)
            except ValueError:
                raise PlannerError(f"vLLM refuses these flags ({name} configuration): {refused}") from None
            derived = vllm_config.model_config.max_model_len
            if derived >= request.max_model_len:
                raise PlannerError(f"vLLM refuses these flags ({name} configuration): {refused}") from None
            if not model_max_len_note:
                model_max_len_note.append(
                    f"--max-model-len {request.max_model_len:,} is beyond this config's {derived:,} "
                    "positions: vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or a checkpoint "
                    "whose RoPE covers it); the plan answers the memory question only"
                )
            vllm_config.model_config.max_model_len = request.max_model_len
        configs[name] = vllm_config
    return {name: configs[name] for name in CONFIGURATIONS}


def plan(request: PlanRequest) -> Plan:
    """Plan every configuration for the request."""
    data, label = read_model_config(request.model)
    hisparse_config_from_attention_config({"hisparse_config": request.hisparse_config})
    if request.kv_cache_memory_bytes is None and request.gpu_memory_gib is None:
        raise PlannerError(
            "give the KV cache memory per GPU exactly (--kv-cache-memory-bytes) or the GPU memory per "
            "GPU (--gpu-memory-gib, e.g. 141 for an H200) to estimate it from"
        )
    notes: list[str] = []
    if request.unused_serve_flags:
        notes.append(f"not used by the plan: {', '.join(request.unused_serve_flags)} (from --serve-command)")
    with (
        tempfile.TemporaryDirectory(prefix="hisparse-plan-") as workdir,
        _where_hisparse_runs(),
        _quiet_vllm(),
    ):
        configs = build_engine_configs(request, staged_model_dir(data, Path(workdir)), notes)
        hf = configs["none"].model_config.hf_text_config
        speculative = configs["none"].speculative_config
        if (
            speculative is not None
            and speculative.method == "mtp"
            and not drafter_layer_count(configs["none"])
        ):
            raise PlannerError(
                "--speculative-config asks for mtp but config.json has no MTP layers "
                "(num_nextn_predict_layers is 0 or missing); for a checkpoint that has them pass "
                "--hf-overrides '{\"num_nextn_predict_layers\": 1}', else drop --speculative-config"
            )
        if request.weights_gib is not None:
            weights = WeightsEstimate(int(request.weights_gib * GiB), None, "given", "--weights-gib")
        elif request.kv_cache_memory_bytes is None:
            weights = estimate_weights(
                hf,
                request.tensor_parallel_size,
                weights_dtype_of(data, request.weights_dtype),
                drafter_layer_count(configs["none"]),
            )
        else:
            weights = None
        kv_bytes = kv_cache_bytes_per_gpu(request, weights)
        session_len = configs["none"].model_config.max_model_len
        if request.session_tokens > session_len:
            raise PlannerError(
                f"--session-tokens {request.session_tokens:,} exceeds the max_model_len {session_len:,}: "
                "lower --session-tokens or raise --max-model-len"
            )
        plans = []
        for name, vllm_config in configs.items():
            specs = layer_kv_cache_specs(vllm_config, request.attention_backend)
            reserve = 0 if name != "hybrid" else resolver_reserve_bytes(request, vllm_config, specs, kv_bytes)
            if reserve:
                notes.append(
                    f"hybrid: the resolver's per-step plans and standing state take {_gib(reserve)} per "
                    "GPU from the KV cache (vLLM's memory profile holds them; docs/architecture.md, "
                    '"Plan memory")'
                )
            plans.append(plan_configuration(request, name, vllm_config, specs, kv_bytes - reserve))
            if name == "hybrid":
                notes.append(grouping_tax_note(plans[0], vllm_config, specs, kv_bytes, plans[-1]))
        hybrid = configs["hybrid"]
        sparse = [s for n, s in specs.items() if not n.endswith(INDEXER_LAYER_SUFFIX)]
        indexers = [s for n, s in specs.items() if n.endswith(INDEXER_LAYER_SUFFIX)]
        hisparse = hybrid.attention_config.hisparse_config
        assert hisparse is not None and hisparse.device_buffer_size is not None
        return Plan(
            model=label,
            num_layers=hf.num_hidden_layers,
            num_indexer_layers=sum(layer_has_indexer(hf, i) for i in range(hf.num_hidden_layers)),
            index_topk=int(hf.index_topk),
            tensor_parallel_size=request.tensor_parallel_size,
            gpu_memory_gib=request.gpu_memory_gib,
            gpu_memory_utilization=request.gpu_memory_utilization,
            weights=weights,
            overhead_gib=request.overhead_gib if request.kv_cache_memory_bytes is None else None,
            kv_cache_bytes_per_gpu=kv_bytes,
            kv_cache_dtype=hybrid.cache_config.cache_dtype,
            sparse_mla_bytes_per_token=sum(s.page_size_bytes for s in sparse) // sparse[0].block_size,
            indexer_bytes_per_token=sum(s.page_size_bytes for s in indexers) // indexers[0].block_size,
            max_model_len=hybrid.model_config.max_model_len,
            model_max_len=hf.max_position_embeddings,
            session_tokens=request.session_tokens,
            hot_buffer_rows=hisparse.device_buffer_size,
            mode=hisparse.mode,
            max_num_seqs=hybrid.scheduler_config.max_num_seqs,
            max_num_batched_tokens=hybrid.scheduler_config.max_num_batched_tokens,
            notes=notes,
            configurations=plans,
        )


# ----------------------------------------------------------------------------- output


def _gib(value: float) -> str:
    if abs(value) < GiB:
        return f"{value / (1 << 20):,.1f} MiB"
    return f"{value / GiB:,.1f} GiB"


def first_sentence(text: str) -> str:
    """The first sentence of a start-up refusal (vLLM's go on with generic advice)."""
    head = text.strip().splitlines()[0] if text.strip() else ""
    return head.split(". ", 1)[0].rstrip(".") + "."


def _groups(plan: ConfigurationPlan) -> str:
    if len(plan.group_layers) == 1:
        return f"1 x {plan.group_layers[0]} layers"
    *mla, resident = plan.group_layers
    return f"{len(mla)} x <= {max(mla)} + {resident} layers"


TABLE_HEADER = (
    "config",
    "KV cache groups",
    "KV blocks",
    "device tokens (all resident)",
    "FULL sessions",
    "MIXED/NONE sessions (hot lease)",
    "host pool for them",
    "running sessions",
    "longest context",
    "starts at --max-model-len",
)


def table_rows(plan: Plan) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for c in plan.configurations:
        if c.name == "hybrid":
            leased = f"{c.leased_sessions:,} ({c.session_blocks_leased:,} blocks each)"
            host = f"{_gib(c.host_bytes_used)} of {_gib(c.host_pool_bytes)}"
            mix = f"{c.full_beside_leased:,} FULL + {c.leased_sessions:,}"
            running = f"{c.running_sessions:,} ({mix}; {c.limited_by})"
        else:
            leased = host = "-"
            running = f"{c.running_sessions:,} ({c.limited_by})"
        rows.append(
            (
                f"{c.name} ({c.description})",
                _groups(c),
                f"{c.num_blocks:,} x {c.block_bytes / (1 << 20):,.2f} MiB",
                f"{c.device_tokens:,}",
                f"{c.full_sessions:,} ({c.session_blocks_full:,} blocks each)",
                leased,
                host,
                running,
                f"{c.longest_context:,}",
                "yes" if c.starts else "no",
            )
        )
    return rows


def summary_lines(plan: Plan) -> list[str]:
    lines = [
        f"model          {plan.model}: {plan.num_layers} layers, {plan.num_indexer_layers} with an indexer, "
        f"index_topk {plan.index_topk:,}"
    ]
    node = f"TP={plan.tensor_parallel_size}"
    if plan.gpu_memory_gib is not None:
        node = (
            f"{plan.tensor_parallel_size} GPUs x {plan.gpu_memory_gib:g} GiB, {node}, "
            f"gpu_memory_utilization {plan.gpu_memory_utilization:g}"
        )
    lines.append(f"node           {node}")
    if plan.weights is not None:
        params = f", {plan.weights.total_params / 1e9:,.1f}B parameters" if plan.weights.total_params else ""
        lines.append(
            f"weights        {_gib(plan.weights.bytes_per_gpu)} per GPU ({plan.weights.dtype}{params}; "
            f"{plan.weights.source})"
        )
    kv = f"KV cache       {_gib(plan.kv_cache_bytes_per_gpu)} per GPU"
    if plan.overhead_gib is not None:
        kv += f" (after a {plan.overhead_gib:g} GiB activation/overhead allowance)"
    else:
        kv += " (--kv-cache-memory-bytes)"
    lines.append(kv)
    lines.append(
        f"KV per token   {plan.sparse_mla_bytes_per_token + plan.indexer_bytes_per_token:,} B on every GPU: "
        f"sparse MLA {plan.sparse_mla_bytes_per_token:,} B ({plan.kv_cache_dtype}), indexer "
        f"{plan.indexer_bytes_per_token:,} B; MLA keeps the whole latent cache on every TP rank"
    )
    lines.append(
        f"HiSparse       mode {plan.mode}, hot lease {plan.hot_buffer_rows:,} rows; host_pool_gib is per "
        f"node, one copy of each demoted page shared by its {plan.tensor_parallel_size} TP ranks"
    )
    lines.append(
        f"workload       sessions counted at {plan.session_tokens:,} tokens; "
        f"--max-model-len {plan.max_model_len:,}; max_num_seqs {plan.max_num_seqs:,}, "
        f"max_num_batched_tokens {plan.max_num_batched_tokens:,}"
    )
    return lines


def render_text(plan: Plan) -> str:
    rows = [TABLE_HEADER, *table_rows(plan)]
    lines = ["Hybrid HiSparse capacity plan", "", *summary_lines(plan), ""]
    for c, row in zip(plan.configurations, rows[1:], strict=True):
        lines.append(row[0])
        for header, cell in zip(TABLE_HEADER[1:], row[1:], strict=True):
            lines.append(f"  {header:<32} {cell}")
        if c.connector_tokens is not None:
            lines.append(f"  {'connector host tier':<32} {c.connector_tokens:,} tokens of its groups' KV")
        if c.max_model_len_refusal is not None:
            lines.append(f"  {'why it does not start':<32} {first_sentence(c.max_model_len_refusal)}")
    lines += ["", *(f"note: {note}" for note in plan.notes)]
    return "\n".join(lines).rstrip() + "\n"


def render_markdown(plan: Plan) -> str:
    lines = ["```", *summary_lines(plan), "```", ""]
    lines.append("| " + " | ".join(TABLE_HEADER) + " |")
    lines.append("| " + " | ".join("---" for _ in TABLE_HEADER) + " |")
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(plan)]
    lines.append("")
    for c in plan.configurations:
        if c.connector_tokens is not None:
            tier = f"{c.connector_tokens:,} tokens of its groups' KV"
            lines.append(f"- {c.name}: the connector's host tier holds {tier}.")
        if c.max_model_len_refusal is not None:
            lines.append(
                f"- {c.name} does not start at --max-model-len: {first_sentence(c.max_model_len_refusal)}"
            )
    lines += [f"- {note}" for note in plan.notes]
    return "\n".join(lines).rstrip() + "\n"


def report(plan: Plan) -> dict[str, Any]:
    """The plan as plain data."""
    data = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "configurations"}
    data["weights"] = dataclasses.asdict(plan.weights) if plan.weights is not None else None
    data["configurations"] = [
        {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in REPORT_EXCLUDED_FIELDS}
        for c in plan.configurations
    ]
    return data


def render_json(plan: Plan) -> str:
    return json.dumps(report(plan), indent=2) + "\n"


# ----------------------------------------------------------------------------- command line


def _human_int(text: str) -> int:
    from vllm.utils.argparse_utils import human_readable_int

    return human_readable_int(text)


def _bounded(parse, low: float, high: float = math.inf, low_open: bool = True):
    """An argparse type: `parse`, then a finite value in (low, high] ([low, high] when not
    `low_open`), or the flag's error names the range."""

    def bounded(text: str):
        try:
            value = parse(text)
        except (TypeError, ValueError) as error:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({error})") from None
        above = value > low if low_open else value >= low
        if not (above and value <= high and math.isfinite(value)):
            left, right = "(" if low_open else "[", f"{high:g}]" if math.isfinite(high) else "inf)"
            raise argparse.ArgumentTypeError(f"{text!r} is outside {left}{low:g}, {right}")
        return value

    bounded.__name__ = getattr(parse, "__name__", "number")
    return bounded


_POSITIVE_INT = _bounded(_human_int, 0)
_POSITIVE = _bounded(float, 0)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.v1.hisparse.capacity plan",
        description=(
            "How many sessions of a DSA model (GLM-5.x, DeepSeek-V3.2) one node runs with "
            "preemption only, the OffloadingConnector, and Hybrid HiSparse; the longest context "
            "each starts; whether --max-model-len starts. Takes vllm serve's flags."
        ),
        epilog=(
            "Example (the announcement's node): --model glm-5.3 -tp 8 "
            "--gpu-memory-gib 141 --kv-cache-dtype fp8 --max-model-len 1048576 "
            '--attention-config \'{"hisparse_config":{"host_pool_gib":384}}\' '
            '--kv-transfer-config \'{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
            '"kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",'
            '"cpu_bytes_to_use":137438953472}}\''
        ),
    )
    parser.add_argument("model_tag", nargs="?", help="model directory or config.json (as --model)")
    parser.add_argument(
        "--model",
        help="a model directory holding config.json, a config.json, a Hugging Face id in the local "
        f"cache, or a preset: {', '.join(PRESETS)} (GLM-5.3's shapes; glm-5: transformers' "
        "GlmMoeDsaConfig defaults)",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=_bounded(int, 0), default=1)
    parser.add_argument("--max-model-len", type=_POSITIVE_INT, help="as vllm serve (default: the config's)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as vllm serve: auto, fp8, fp8_ds_mla, ...")
    parser.add_argument("--gpu-memory-gib", type=_POSITIVE, help="memory of one GPU in GiB, e.g. 141 (H200)")
    parser.add_argument(
        "--gpu-memory-utilization", type=_bounded(float, 0, 1), default=DEFAULT_GPU_MEMORY_UTILIZATION
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=_POSITIVE_INT,
        help="KV cache memory per GPU, exactly (as vllm serve)",
    )
    parser.add_argument(
        "--weights-gib", type=_POSITIVE, help="weights per GPU in GiB instead of the estimate"
    )
    parser.add_argument(
        "--weights-dtype",
        default="auto",
        help="fp8, bfloat16, float16 or float32; auto: fp8 for FP8 checkpoints, else the config's dtype",
    )
    parser.add_argument(
        "--overhead-gib",
        type=_bounded(float, 0, low_open=False),
        default=DEFAULT_OVERHEAD_GIB,
        help="per-GPU allowance besides the weights: activation peak, CUDA graphs, NCCL, slack "
        f"(default {DEFAULT_OVERHEAD_GIB:g})",
    )
    parser.add_argument(
        "--serve-command",
        help="a whole `vllm serve MODEL ...` line, read with vllm serve's own parser: it gives "
        "the model and the serve flags (those the plan does not use are listed); the other "
        "flags here add the node (--gpu-memory-gib, ...) and must not repeat it",
    )
    parser.add_argument("--attention-config", help="as vllm serve, with hisparse_config")
    parser.add_argument("--kv-transfer-config", help="as vllm serve (OffloadingConnector)")
    parser.add_argument(
        "--kv-offloading-size",
        type=_POSITIVE,
        help="as vllm serve: an OffloadingConnector with this many GiB of host memory",
    )
    parser.add_argument(
        "--offload-baseline-gib",
        type=_POSITIVE,
        help="host GiB of the offload configuration's tier (default: HiSparse pool + connector tier)",
    )
    parser.add_argument("--speculative-config", help='as vllm serve, e.g. \'{"method":"mtp",...}\'')
    parser.add_argument("--hf-overrides", help="as vllm serve: JSON overriding config.json")
    parser.add_argument(
        "--max-num-batched-tokens", type=_POSITIVE_INT, help="default: vllm serve's on the GPU"
    )
    parser.add_argument("--max-num-seqs", type=_bounded(int, 0), help="default: vllm serve's on the GPU")
    parser.add_argument(
        "--attention-backend",
        help=f"sparse-MLA backend that sets the fp8 layout (default {DEFAULT_SPARSE_MLA_BACKEND})",
    )
    parser.add_argument(
        "--session-tokens",
        type=_POSITIVE_INT,
        default=DEFAULT_SESSION_TOKENS,
        help=f"context of one session (default {DEFAULT_SESSION_TOKENS:,}: the announcement's admission "
        "limit)",
    )
    parser.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    parser.add_argument("--output", type=Path, help="write the report to this file instead of stdout")
    return parser


# vllm serve's destinations the plan reads: their planner flag, by the same destination.
SERVE_FLAGS_USED = (
    "model",
    "tensor_parallel_size",
    "max_model_len",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "attention_config",
    "kv_transfer_config",
    "kv_offloading_size",
    "speculative_config",
    "hf_overrides",
    "max_num_batched_tokens",
    "max_num_seqs",
)


def serve_command_args(args: argparse.Namespace, defaults: argparse.Namespace) -> tuple[str, ...]:
    """Fill `args` from --serve-command, parsed by vllm serve's own argument parser; the
    flags the line gives that the plan does not use. A flag given both ways is refused."""
    import shlex

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(args.serve_command)
    while words and (words[0] in ("vllm", "serve") or words[0].endswith("/vllm")):
        words = words[1:]
    if not words or words[0].startswith("-"):
        raise PlannerError(
            f"--serve-command {args.serve_command!r}: give the model first, as vllm serve takes it "
            "(vllm serve MODEL [options])"
        )
    serve_parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))
    try:
        with _quiet_vllm():
            serve = serve_parser.parse_args(words)
            serve_defaults = serve_parser.parse_args(words[:1])
    except (argparse.ArgumentError, SystemExit, ValueError) as bad:
        raise PlannerError(f"--serve-command: vllm serve does not accept it ({bad})") from None
    serve.model = serve.model_tag
    given = {
        dest
        for dest, value in vars(serve).items()
        if dest != "model_tag" and value != getattr(serve_defaults, dest, None)
    } | {"model"}
    for dest in sorted(given & set(SERVE_FLAGS_USED)):
        if getattr(args, dest, None) != getattr(defaults, dest, None):
            raise PlannerError(
                f"--{dest.replace('_', '-')} is given in --serve-command and again on its own; give it once"
            )
        value = getattr(serve, dest)
        if dest == "attention_config":
            hisparse = getattr(value, "hisparse_config", None)
            config = (
                {}
                if hisparse is None
                else {k: v for k, v in dataclasses.asdict(hisparse).items() if v is not None}
            )
            value = json.dumps({"hisparse_config": config} if hisparse is not None else {})
        elif dest == "kv_transfer_config":
            value = json.dumps(
                {
                    "kv_connector": value.kv_connector,
                    "kv_role": value.kv_role,
                    "kv_connector_extra_config": value.kv_connector_extra_config,
                }
            )
        elif dest in ("speculative_config", "hf_overrides"):
            value = json.dumps(value) if value else None
        setattr(args, dest, value)
    unused = sorted(given - set(SERVE_FLAGS_USED))
    return tuple(f"--{dest.replace('_', '-')}" for dest in unused)


def request_from_args(args: argparse.Namespace, defaults: argparse.Namespace | None = None) -> PlanRequest:
    unused: tuple[str, ...] = ()
    if args.serve_command:
        if args.model or args.model_tag:
            raise PlannerError("give the model once: in --serve-command (vllm serve MODEL ...) or --model")
        unused = serve_command_args(args, defaults or argument_parser().parse_args([]))
    model = args.model or args.model_tag
    if not model:
        raise PlannerError(
            "name the model: --model /path/to/model (or its config.json), a Hugging Face id in the "
            f"local cache, or a preset ({', '.join(PRESETS)})"
        )
    attention_config = {}
    if args.attention_config:
        attention_config = parse_json_flag("--attention-config", args.attention_config)
    kv_transfer = None
    if args.kv_transfer_config:
        given = parse_json_flag("--kv-transfer-config", args.kv_transfer_config)
        try:
            # vLLM 0.30's spelling of hisparse_config: a HiSparseConnector (see docs/deploy.md).
            settings, remaining = split_hisparse_connector(given)
        except ValueError as error:
            raise PlannerError(str(error)) from None
        if settings is not None:
            ours = attention_config.get("hisparse_config")
            if ours is not None and any(ours.get(k) != v for k, v in settings.items()):
                raise PlannerError(
                    f"--kv-transfer-config's HiSparseConnector ({settings}) and --attention-config's "
                    f"hisparse_config ({ours}) disagree: keep one of them"
                )
            attention_config = {**attention_config, "hisparse_config": {**settings, **(ours or {})}}
        if remaining is not None:
            kv_transfer = offloading_connector_config(remaining)
    if not args.attention_config and "hisparse_config" not in attention_config:
        raise PlannerError(
            "--attention-config is required (in --serve-command or on its own), with the deployment's "
            'hisparse_config, e.g. \'{"hisparse_config":{"host_pool_gib":384}}\' (or vLLM 0.30\'s '
            "HiSparseConnector in --kv-transfer-config)"
        )
    if args.kv_offloading_size is not None:
        if kv_transfer is not None:
            raise PlannerError(
                "give the connector once: --kv-transfer-config or --kv-offloading-size, not both"
            )
        kv_transfer = with_cpu_bytes(None, int(args.kv_offloading_size * GiB))
    batched, seqs = args.max_num_batched_tokens, args.max_num_seqs
    if args.gpu_memory_gib is not None:
        default_batched, default_seqs = serve_batch_defaults(args.gpu_memory_gib)
        batched = batched or default_batched
        seqs = seqs or default_seqs
    return PlanRequest(
        model=model,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_gib=args.gpu_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        weights_gib=args.weights_gib,
        weights_dtype=args.weights_dtype,
        overhead_gib=args.overhead_gib,
        hisparse_config=hisparse_config_from_attention_config(attention_config),
        kv_transfer_config=kv_transfer,
        offload_baseline_bytes=None
        if args.offload_baseline_gib is None
        else int(args.offload_baseline_gib * GiB),
        speculative_config=parse_json_flag("--speculative-config", args.speculative_config)
        if args.speculative_config
        else None,
        hf_overrides=parse_json_flag("--hf-overrides", args.hf_overrides) if args.hf_overrides else None,
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        attention_backend=args.attention_backend,
        session_tokens=args.session_tokens,
        unused_serve_flags=unused,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    try:
        result = plan(request_from_args(args, parser.parse_args([])))
    except PlannerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    render = {"text": render_text, "markdown": render_markdown, "json": render_json}[args.format]
    if args.output is not None:
        args.output.write_text(render(result))
    else:
        sys.stdout.write(render(result))
    if not any(c.starts for c in result.configurations):
        longest = max(result.configurations, key=lambda c: c.longest_context)
        print(
            f"error: --max-model-len {result.max_model_len:,} starts in no configuration; the longest "
            f"context that starts is {longest.longest_context:,} tokens ({longest.name}). Lower "
            "--max-model-len, or give the KV cache or the host pool more memory",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
