# SPDX-License-Identifier: Apache-2.0
"""DeepSeek Sparse Attention on vLLM's CPU platform.

Owns the two attention backends a DSA model (DeepSeek-V3.2, GLM-5) needs on
CPU, sharing one metadata type:

- `CPUDSAIndexerBackend` for the indexer K cache layers, and
  `run_cpu_sparse_attn_indexer`, the CPU body of vLLM's `sparse_attn_indexer`
  op: write the K cache, score keys, select the causal top-K positions into the
  model's shared top-K buffer;
- `CPUSparseMLABackend` for the sparse MLA layers: write the latent cache,
  convert selected positions to rows, attend over exactly those rows.

Every token, prefill or decode, takes the same top-K path, so chunked prefill
and prefix caching need nothing special. The arithmetic lives in
`vllm.v1.attention.ops.dsa_torch`; this module only adapts vLLM's metadata and
forward context to it, and never touches the scheduler or the block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.attention.ops import dsa_torch
from vllm.v1.hisparse.sparse_mla import resolve_selected_rows, resolves_through_hisparse
from vllm.v1.kv_cache_interface import AttentionSpec

if TYPE_CHECKING:
    from vllm.model_executor.models.deepseek_v2 import Indexer

logger = init_logger(__name__)

# One KV page of the sparse-MLA cache, as on the CUDA sparse-MLA backends.
DSA_BLOCK_SIZE = 64


@dataclass
class CPUDSAMetadata(AttentionMetadata):
    """Per-step metadata of one KV cache group, for the indexer and sparse MLA layers."""

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]: tokens in each request's KV after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_actual_tokens]
    req_id_per_token: torch.Tensor  # [num_actual_tokens]: block-table row of each token
    query_positions: torch.Tensor  # [num_actual_tokens]: position of each token in its request
    block_size: int
    topk_tokens: int
    # MLAAttention.forward_impl routes `num_decode_tokens` tokens through the
    # top-K MQA path; here that is every token.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0


class CPUDSAMetadataBuilder(AttentionMetadataBuilder[CPUDSAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.topk_tokens = int(vllm_config.model_config.hf_text_config.index_topk)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CPUDSAMetadata:
        m = common_attn_metadata
        num_tokens = m.num_actual_tokens
        starts = m.query_start_loc_cpu[: m.num_reqs + 1].long()
        query_lens = starts[1:] - starts[:-1]
        seq_lens = m.seq_lens[: m.num_reqs].to("cpu").long()
        req_ids = torch.repeat_interleave(torch.arange(m.num_reqs), query_lens)
        offset_in_query = torch.arange(num_tokens) - starts[req_ids]
        positions = (seq_lens - query_lens)[req_ids] + offset_in_query
        return CPUDSAMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=m.num_reqs,
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[:num_tokens],
            req_id_per_token=req_ids,
            query_positions=positions,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=m.num_reqs,
            num_prefills=0,
            num_decode_tokens=num_tokens,
        )


# ---------------------------------------------------------------------------
# Indexer


class CPUDSAIndexerBackend(DeepseekV32IndexerBackend):
    """The DSA indexer K cache on CPU: the CUDA row format, torch arithmetic."""

    @staticmethod
    def get_name() -> str:
        return "CPU_DSA_INDEXER"

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [DSA_BLOCK_SIZE]

    @staticmethod
    def get_builder_cls() -> type[CPUDSAMetadataBuilder]:  # type: ignore[override]
        # Upstream's indexer backend names its CUDA builder as the return type; this one
        # builds the same indexer metadata for the CPU kernels.
        return CPUDSAMetadataBuilder


def run_cpu_sparse_attn_indexer(
    k_cache_prefix: str,
    kv_cache: torch.Tensor,
    q_fp8: torch.Tensor,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    topk_tokens: int,
    topk_indices_buffer: torch.Tensor,
    skip_k_cache_insert: bool,
) -> torch.Tensor:
    """CPU body of `torch.ops.vllm.sparse_attn_indexer` (fp8 indexer cache only).

    Fills `topk_indices_buffer[:num_tokens]` with each token's selected key
    positions within its request (-1 padded) and returns the buffer.
    """
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        # Profiling / dummy run: no requests, nothing to select.
        return topk_indices_buffer
    meta = attn_metadata[k_cache_prefix]
    if not isinstance(meta, CPUDSAMetadata):
        raise TypeError(f"{k_cache_prefix}: expected CPUDSAMetadata, got {type(meta).__name__}")
    num_tokens = meta.num_actual_tokens
    if not skip_k_cache_insert:
        if k is None:
            raise ValueError(f"{k_cache_prefix}: keys are required to fill the indexer cache")
        dsa_torch.write_indexer_k_cache(k[:num_tokens], kv_cache, meta.slot_mapping)
    topk_indices_buffer[:num_tokens] = -1
    for req in range(meta.num_reqs):
        start, stop = int(meta.query_start_loc[req]), int(meta.query_start_loc[req + 1])
        if start == stop:
            continue
        seq_len = int(meta.seq_lens[req])
        key_positions = torch.arange(seq_len).unsqueeze(0)
        slots = dsa_torch.positions_to_slots(
            key_positions, torch.tensor([req]), meta.block_table, meta.block_size
        )[0]
        k_values, k_scales = dsa_torch.read_indexer_k_rows(kv_cache, slots)
        logits = dsa_torch.indexer_logits(q_fp8[start:stop], weights[start:stop], k_values, k_scales)
        selected = dsa_torch.select_topk_positions(logits, meta.query_positions[start:stop], topk_tokens)
        topk_indices_buffer[start:stop, :topk_tokens] = selected
    return topk_indices_buffer


# ---------------------------------------------------------------------------
# Sparse MLA


class CPUSparseMLABackend(AttentionBackend):
    """Sparse MLA over the latent cache (kv_cache_dtype "auto") on CPU."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "CPU_SPARSE_MLA"

    @staticmethod
    def get_builder_cls() -> type[CPUDSAMetadataBuilder]:
        return CPUDSAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CPUSparseMLAImpl]:
        return CPUSparseMLAImpl

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [DSA_BLOCK_SIZE]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent + rope width


def latent_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The latent cache [num_blocks, block_size, D] as rows [num_rows, D], and rows per block stride."""
    num_blocks, block_size, width = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) % width:
        raise ValueError("sparse MLA cache rows must be contiguous within a block")
    stride_rows = kv_cache.stride(0) // width
    rows = kv_cache.as_strided(((num_blocks - 1) * stride_rows + block_size, width), (width, 1))
    return rows, stride_rows


class CPUSparseMLAImpl(MLAAttentionImpl[CPUDSAMetadata]):
    is_sparse = True
    supports_dense_mha_prefill = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: Indexer | None = None,
        **mla_args,
    ) -> None:
        if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the CPU sparse MLA "
                "backend; use --kv-cache-dtype auto"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.topk_indices_buffer = indexer.topk_indices_buffer if indexer is not None else topk_indices_buffer

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        rows, stride_rows = latent_rows(kv_cache)
        block_size = kv_cache.shape[1]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        slots = (slots // block_size) * stride_rows + slots % block_size
        rows[slots, : self.kv_lora_rank] = kv_c_normed[keep].to(rows.dtype)
        rows[slots, self.kv_lora_rank :] = k_pe.flatten(1)[keep].to(rows.dtype)

    @resolves_through_hisparse(row_view=lambda cache, _block_size: latent_rows(cache))
    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: CPUDSAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        assert self.topk_indices_buffer is not None
        num_tokens = q.shape[0]
        positions = self.topk_indices_buffer[:num_tokens]
        req_ids = attn_metadata.req_id_per_token[:num_tokens]
        rows, stride_rows = latent_rows(kv_c_and_k_pe_cache)
        slots = dsa_torch.positions_to_slots(
            positions, req_ids, attn_metadata.block_table, attn_metadata.block_size, stride_rows
        )
        # Hybrid HiSparse: entries on pages in the host pool read the rows it resolved.
        slots = resolve_selected_rows(positions, req_ids, slots, stride_rows)
        return dsa_torch.sparse_mla_attention(q, rows, slots, self.scale, self.kv_lora_rank), None
