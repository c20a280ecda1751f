# SPDX-License-Identifier: Apache-2.0
"""Rotary embedding on vLLM's CPU kernel for tensors of any layout.

Owns one adapter: the CPU `rotary_embedding` kernel of vLLM 0.29.0 reads
query and key as [num_tokens, num_heads * head_size] and silently rotates only
part of a 3-D [num_tokens, num_heads, head_size] tensor (or of a strided view,
such as MLA's `q[..., qk_nope_head_dim:]`), which leaves MLA's rope dimensions
unrotated on CPU. The adapter hands the kernel 2-D contiguous tensors and
writes the result back, so callers keep the in-place contract. It never
changes the arithmetic of the kernel.
"""

from __future__ import annotations

import torch


def _as_token_rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(x.shape[0], -1)
    return rows if rows.is_contiguous() else rows.contiguous()


def rotary_embedding_cpu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate query (and key) in place through the CPU kernel; returns them."""
    from vllm import _custom_ops as ops

    query_rows = _as_token_rows(query)
    key_rows = _as_token_rows(key) if key is not None else None
    ops.rotary_embedding(positions, query_rows, key_rows, head_size, cos_sin_cache, is_neox_style)
    if query_rows.data_ptr() != query.data_ptr():
        query.copy_(query_rows.view(query.shape))
    if key is not None and key_rows is not None and key_rows.data_ptr() != key.data_ptr():
        key.copy_(key_rows.view(key.shape))
    return query, key
