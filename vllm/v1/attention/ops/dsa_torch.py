# SPDX-License-Identifier: Apache-2.0
"""Plain-torch DeepSeek Sparse Attention (DSA) ops: the reference semantics.

Owns the arithmetic of the DSA path on machines without CUDA kernels: fp8
group quantisation with power-of-two (ue8m0) scales, the indexer K cache row
format, indexer logits and causal top-K selection, the conversion of selected
token positions to physical KV slots, and sparse MLA attention over exactly the
selected rows. Readable before fast: every op is a few tensor expressions.

It never reads vLLM's forward context or metadata; the CPU backends
(`cpu_dsa_indexer`, `cpu_mla_sparse`) adapt those to these functions.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# The CUDA indexer cache kernel floors each token's absolute maximum here
# before deriving its scale, so an all-zero key still gets a finite scale.
INDEXER_K_AMAX_FLOOR = 1e-4
# Tokens per attention chunk: bounds the [tokens, top-K, 576] gather.
ATTENTION_TOKEN_CHUNK = 256


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive scales up to the next power of two (an 8-bit exponent)."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def quantize_fp8_groups(
    x: torch.Tensor, group_size: int, eps: float, use_ue8m0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row-group fp8 quantisation: returns (values [..., D] fp8, scales [..., D/group] fp32)."""
    if x.shape[-1] % group_size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of group size {group_size}")
    groups = x.float().unflatten(-1, (-1, group_size))
    scale = groups.abs().amax(dim=-1).clamp(min=eps) / FP8_MAX
    if use_ue8m0:
        scale = ue8m0(scale)
    values = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values.flatten(-2), scale


# ---------------------------------------------------------------------------
# Indexer K cache: per block, [block_size x head_dim] fp8 values followed by
# [block_size] fp32 scales (the layout of the CUDA indexer kernels).


def _indexer_block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """View a [num_blocks, block_size, head_dim + 4] uint8 cache as [num_blocks, bytes]."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3:
        raise ValueError(f"indexer K cache must be 3-D uint8, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    num_blocks, block_size, row_bytes = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != row_bytes:
        raise ValueError("indexer K cache blocks must be contiguous")
    return kv_cache.as_strided((num_blocks, block_size * row_bytes), (kv_cache.stride(0), 1))


def _indexer_fields(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [num_blocks, block_size, head_dim] fp8, scales [num_blocks, block_size] fp32) views."""
    flat = _indexer_block_bytes(kv_cache)
    num_blocks, block_size, row_bytes = kv_cache.shape
    head_dim = row_bytes - 4
    values = flat[:, : block_size * head_dim].view(FP8_DTYPE).view(num_blocks, block_size, head_dim)
    scales = flat[:, block_size * head_dim :].view(torch.float32)
    return values, scales


def write_indexer_k_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantise each key (one group per token) and store it at its slot; slot -1 is skipped."""
    values, scales = _indexer_fields(kv_cache)
    block_size = kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    amax = k[keep].float().abs().amax(dim=-1, keepdim=True).clamp(min=INDEXER_K_AMAX_FLOOR)
    scale = ue8m0(amax / FP8_MAX)
    quantised = (k[keep].float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    blocks, offsets = slots // block_size, slots % block_size
    values[blocks, offsets] = quantised
    scales[blocks, offsets] = scale.squeeze(-1)


def read_indexer_k_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather (fp8 values as fp32 [S, head_dim], scales [S]) for the given slots."""
    values, scales = _indexer_fields(kv_cache)
    block_size = kv_cache.shape[1]
    blocks, offsets = slots.long() // block_size, slots.long() % block_size
    return values[blocks, offsets].float(), scales[blocks, offsets]


def indexer_logits(
    q_fp8: torch.Tensor, weights: torch.Tensor, k_values: torch.Tensor, k_scales: torch.Tensor
) -> torch.Tensor:
    """logits[t, s] = sum_h relu(q[t, h] . k[s]) * weights[t, h] * k_scale[s], in fp32.

    q_fp8: [T, H, D] fp8 (its scale is already folded into `weights`), weights: [T, H],
    k_values: [S, D], k_scales: [S]. Returns [T, S].
    """
    scores = torch.einsum("thd,sd->ths", q_fp8.float(), k_values).relu_()
    return torch.einsum("ths,th->ts", scores, weights.float()) * k_scales.unsqueeze(0)


def select_topk_positions(logits: torch.Tensor, query_positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Causal top-K over key positions 0..len-1 for queries at `query_positions`.

    logits: [T, S] over key positions 0..S-1. A query at position p sees keys
    0..p. Returns [T, topk] int32 positions, highest logit first, -1 where a
    query has fewer than `topk` visible keys.
    """
    num_keys = logits.shape[1]
    visible = torch.arange(num_keys).unsqueeze(0) <= query_positions.unsqueeze(1)
    masked = logits.masked_fill(~visible, float("-inf"))
    k = min(topk, num_keys)
    best, positions = torch.topk(masked, k, dim=1)
    positions = positions.to(torch.int32).masked_fill_(best == float("-inf"), -1)
    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
    out[:, :k] = positions
    return out


# ---------------------------------------------------------------------------
# Sparse MLA


def positions_to_slots(
    positions: torch.Tensor,
    req_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    block_stride_rows: int | None = None,
) -> torch.Tensor:
    """Map per-request token positions to physical KV rows through the block table.

    positions: [T, K] (-1 = none), req_ids: [T] row of `block_table` for each query,
    block_table: [R, W] physical block ids. A row is `block * block_stride_rows +
    position % block_size` (the stride defaults to block_size, a contiguous cache).
    Returns [T, K] int64 rows, -1 where the position is -1.

    This is the seam Hybrid HiSparse replaces with its resolver: a resolver
    returns rows in the same order, drawn from resident pages or hot buffers.
    """
    stride = block_size if block_stride_rows is None else block_stride_rows
    valid = positions >= 0
    safe = positions.long().clamp(min=0)
    blocks = block_table[req_ids.long()].long().gather(1, safe // block_size)
    rows = blocks * stride + safe % block_size
    return rows.masked_fill_(~valid, -1)


def _packed_rows(ids: torch.Tensor) -> torch.Tensor:
    """The selections of a chunk of queries with their `-1` padding dropped where every
    query has it: a query early in a long prefill selects far fewer than K rows, and
    gathering the padding would cost as much as a full selection. Each query keeps its
    rows in order (stably moved ahead of its padding), so the result is the same."""
    valid = ids >= 0
    used = int(valid.sum(dim=1).max()) if ids.numel() else 0
    if used == ids.shape[1]:
        return ids
    if not bool((valid[:, used:]).any()):
        return ids[:, :used]
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :used]
    return ids.gather(1, order)


def sparse_mla_attention(
    q: torch.Tensor, kv_rows: torch.Tensor, rows: torch.Tensor, scale: float, v_dim: int
) -> torch.Tensor:
    """Attention of each query over exactly its selected latent rows.

    q: [T, N, D] (absorbed latent + rope), kv_rows: [num_rows, D] (the latent cache as
    rows; values are the first `v_dim` columns), rows: [T, K] row ids (-1 = none).
    Returns [T, N, v_dim] in q's dtype; a query with no row gets zeros.
    """
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float32)
    for start in range(0, q.shape[0], ATTENTION_TOKEN_CHUNK):
        stop = min(start + ATTENTION_TOKEN_CHUNK, q.shape[0])
        ids = _packed_rows(rows[start:stop])
        valid = ids >= 0
        selected = kv_rows[ids.clamp(min=0)].float()  # [t, K, D]
        scores = torch.einsum("tnd,tkd->tnk", q[start:stop].float(), selected) * scale
        scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        out[start:stop] = torch.einsum("tnk,tkv->tnv", weights, selected[..., :v_dim])
    return out.to(q.dtype)
