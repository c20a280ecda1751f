# SPDX-License-Identifier: Apache-2.0
"""Sparse-MLA attention backends that resolve through Hybrid HiSparse.

Owns the one seam between a sparse-MLA backend and the HiSparse worker:
`resolves_through_hisparse(attend_rows)` wraps a backend's `forward_mqa`.

- On a step without HOST pages, or for a layer HiSparse does not manage (the
  indexer group, an MTP drafter), the backend's own `forward_mqa` runs and
  nothing else: Hybrid costs nothing without pressure.
- Otherwise the backend's own path still runs for the whole batch, because its
  kernel metadata describes the whole batch. Then the worker resolves the
  tokens of requests with HOST pages (`HiSparseResolution.attend`) and replaces
  their outputs with `attend_rows`: the backend's kernel run on just those
  tokens over the rows the resolver chose.

Each backend's `attend_rows(impl, q, kv_cache, kv_rows, stride_rows, rows,
attn_metadata)` takes q for the selected tokens (a tensor or the backend's
(q_nope, q_pe) pair), and `rows` [n, K] int64 rows of the flat view `kv_rows`
(block b's token i at b * stride_rows + i, -1 where nothing is selected), in
the order the indexer selected them. It returns [n, heads, kv_lora_rank].

It never changes a backend's path for fully resident requests, and never
allocates KV cache or host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm.v1.hisparse.resolution import RESOLVING_MARKER, active_resolution

AttendRows = Callable[..., torch.Tensor]
RowView = Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]


def flat_row_view(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """[rows, width] view of a [blocks, block_size, width] cache and its rows per block."""
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    return flat_kv_row_view(kv_cache, block_size)


def resolves_through_hisparse(attend_rows: AttendRows, row_view: RowView = flat_row_view):
    """Decorate a sparse-MLA impl's forward_mqa so HiSparse-managed layers resolve HOST pages."""

    def decorate(forward_mqa):
        @functools.wraps(forward_mqa)
        def forward_mqa_resolving(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            hisparse = active_resolution()
            if hisparse is None or not hisparse.resolves(layer.layer_name):
                return forward_mqa(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer)
            if getattr(impl, "dcp_world_size", 1) > 1:
                raise NotImplementedError(
                    "Hybrid HiSparse does not support decode context parallelism; "
                    "start without --decode-context-parallel-size or without hisparse_config"
                )
            num_tokens = (q[0] if isinstance(q, tuple) else q).shape[0]
            kv_rows, stride_rows = row_view(kv_c_and_k_pe_cache, attn_metadata.block_size)

            def attend_all() -> torch.Tensor:
                return forward_mqa(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer)[0]

            def attend_selected(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
                return attend_rows(
                    impl, select_tokens(q, tokens), kv_c_and_k_pe_cache, kv_rows, stride_rows, rows,
                    attn_metadata,
                )

            out = hisparse.attend(
                layer.layer_name,
                impl.topk_indices_buffer[:num_tokens],
                attn_metadata.req_id_per_token[:num_tokens],
                attn_metadata.block_table,
                kv_rows,
                stride_rows,
                attend_all,
                attend_selected,
            )
            return out, None

        setattr(forward_mqa_resolving, RESOLVING_MARKER, True)
        return forward_mqa_resolving

    return decorate


def select_tokens(q: torch.Tensor | tuple[torch.Tensor, ...], tokens: torch.Tensor):
    if isinstance(q, tuple):
        return tuple(part[tokens] for part in q)
    return q[tokens]


def concat_q(q: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[n, heads, kv_lora_rank + rope] from a tensor or the (q_nope, q_pe) pair."""
    return torch.cat(q, dim=-1) if isinstance(q, tuple) else q


def valid_counts(rows: torch.Tensor) -> torch.Tensor:
    """Selected rows per token, as upstream's index conversion counts them (int32)."""
    return (rows >= 0).sum(dim=-1, dtype=torch.int32)


def kernel_indices(rows: torch.Tensor, stride_rows: int, block_size: int) -> torch.Tensor:
    """Rows of the flat view as paged indices block * block_size + offset (int32, -1 kept).

    Kernels that take the paged cache itself (FlashMLA's fp8 path) address a
    token by block and offset and find the block through the cache's stride.
    """
    paged = (rows // stride_rows) * block_size + rows % stride_rows
    return torch.where(rows >= 0, paged, -1).to(torch.int32)


# -- the backends' row attention -----------------------------------------------------


def flashmla_sparse_attend_rows(
    impl, q, kv_cache, kv_rows, stride_rows, rows, attn_metadata
) -> torch.Tensor:
    q = concat_q(q)
    if impl.kv_cache_dtype != "fp8_ds_mla":
        out, _ = impl._bf16_flash_mla_kernel(q, kv_rows, rows.to(torch.int32), valid_counts(rows))
        return out
    from vllm.v1.attention.backends.mla import flashmla_sparse

    # A fresh schedule: FlashMLA may reuse one only for the same shapes.
    scheduler_metadata, _ = flashmla_sparse.get_mla_metadata()
    device = q.device
    kernel_metadata = flashmla_sparse.FlashMLASparseMetadata.FP8KernelMetadata(
        scheduler_metadata=scheduler_metadata,
        cache_lens=torch.full((1,), attn_metadata.topk_tokens, dtype=torch.int32, device=device),
        dummy_block_table=torch.zeros((1, 1), dtype=torch.int32, device=device),
    )
    indices = kernel_indices(rows, stride_rows, attn_metadata.block_size)
    out, _ = impl._fp8_flash_mla_kernel(
        q=q.unsqueeze(0),
        kv_c_and_k_pe_cache=kv_cache,
        topk_indices=indices.unsqueeze(0),
        kernel_metadata=kernel_metadata,
    )
    return out.squeeze(0)


def flashinfer_mla_sparse_attend_rows(
    impl, q, kv_cache, kv_rows, stride_rows, rows, attn_metadata
) -> torch.Tensor:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

    out = trtllm_batch_decode_with_kv_cache_mla(
        query=concat_q(q).unsqueeze(1),
        kv_cache=kv_cache.unsqueeze(1),
        workspace_buffer=impl._workspace_buffer,
        qk_nope_head_dim=impl.qk_nope_head_dim,
        kv_lora_rank=impl.kv_lora_rank,
        qk_rope_head_dim=impl.qk_rope_head_dim,
        block_tables=rows.to(torch.int32).unsqueeze(1),
        seq_lens=valid_counts(rows),
        max_seq_len=attn_metadata.topk_tokens,
        bmm1_scale=impl.bmm1_scale,
        bmm2_scale=impl.bmm2_scale,
        sparse_mla_top_k=attn_metadata.topk_tokens,
        return_lse=False,
    )
    return out.view(-1, out.shape[-2], out.shape[-1])


def flashattn_mla_sparse_attend_rows(
    impl, q, kv_cache, kv_rows, stride_rows, rows, attn_metadata
) -> torch.Tensor:
    from vllm.v1.attention.backends.mla import flashattn_mla_sparse

    q_nope, q_rope = q
    lora = impl.kv_lora_rank
    return flashattn_mla_sparse.flash_attn_varlen_func(
        q=q_rope,
        k=kv_rows[:, lora:].unsqueeze(1).unsqueeze(1),
        v=kv_rows[:, :lora].unsqueeze(1).unsqueeze(1),
        q_v=q_nope,
        max_seqlen_q=1,
        cu_seqlens_q=torch.arange(0, rows.shape[0] + 1, dtype=torch.int32, device=rows.device),
        max_seqlen_k=rows.shape[1],
        seqused_k=valid_counts(rows),
        block_table=rows.to(torch.int32),
        softmax_scale=impl.scale,
        causal=True,
        fa_version=3,
    )
