# SPDX-License-Identifier: Apache-2.0
"""Sparse-MLA attention backends that resolve through Hybrid HiSparse.

Owns the seam between a sparse-MLA backend and the HiSparse resolution: the
resolver takes the place of the backend's conversion of top-K positions into
cache rows, so each layer runs its attention kernel once per step (once per
pass when a request selects more rows than its hot and staging rows hold, see
resolver.py), for every token, over rows that hold the right KV.

- `resolves_through_hisparse` decorates a backend's `forward_mqa`. On a step
  whose batch has a request with HOST pages, for a layer HiSparse manages, it
  names the layer and its cache for the conversion below while the backend's
  own `forward_mqa` runs, once per pass, keeping each token's output from its
  own pass; otherwise it only calls it.
- `convert_req_index_to_global_index` stands in for upstream's Triton
  conversion in the CUDA backends (patch 0011 imports it under upstream's
  name): upstream's conversion runs first, then, inside a resolving layer,
  the entries on HOST pages are replaced by the rows the resolution chose.
- `resolve_selected_rows` does the same after the CPU backend's
  `positions_to_slots`.

Without HOST pages in the step nothing but the backend runs: Hybrid costs
nothing without pressure. It never allocates KV cache or host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.config.hisparse import SPARSE_MLA_PAGE_TOKENS
from vllm.v1.hisparse.resolution import RESOLVING_MARKER, HiSparseResolution, active_resolution

RowView = Callable[[torch.Tensor, int], tuple[torch.Tensor, int]]


@dataclass
class _ResolvingLayer:
    resolution: HiSparseResolution
    layer_name: str
    kv_cache: torch.Tensor
    block_size: int
    row_view: RowView
    pass_index: int = 0


# The layer whose forward_mqa is running with HOST pages to resolve, if any.
_resolving: _ResolvingLayer | None = None


def flat_row_view(kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """[rows, width] view of a [blocks, block_size, width] cache and its rows per block."""
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    return flat_kv_row_view(kv_cache, block_size)


def resolves_through_hisparse(row_view: RowView = flat_row_view):
    """Decorate a sparse-MLA impl's forward_mqa so HiSparse-managed layers resolve HOST pages."""

    def decorate(forward_mqa):
        @functools.wraps(forward_mqa)
        def forward_mqa_resolving(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            global _resolving
            resolution = active_resolution()
            if resolution is None or not resolution.resolves(layer.layer_name):
                return forward_mqa(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer)
            if getattr(impl, "dcp_world_size", 1) > 1:
                raise NotImplementedError(
                    "Hybrid HiSparse does not support decode context parallelism; "
                    "start without --decode-context-parallel-size or without hisparse_config"
                )
            _resolving = _ResolvingLayer(
                resolution, layer.layer_name, kv_c_and_k_pe_cache, attn_metadata.block_size, row_view
            )
            try:
                out = forward_mqa(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer)
                # The first pass planned the step: more passes when a request's selections
                # did not fit its hot and staging rows at once.
                for p in range(1, resolution.num_passes(layer.layer_name)):
                    _resolving.pass_index = p
                    again = forward_mqa(impl, q, kv_c_and_k_pe_cache, attn_metadata, layer)
                    out = _keep_pass(out, again, resolution.pass_of_token(layer.layer_name) == p)
                return out
            finally:
                _resolving = None

        setattr(forward_mqa_resolving, RESOLVING_MARKER, True)
        return forward_mqa_resolving

    return decorate


def _keep_pass(out, again, in_pass: torch.Tensor):
    """`out` with the rows of the pass's tokens (`in_pass` [T']) taken from `again`; an
    output's leading dimension is its tokens (padding past T' keeps `out`'s)."""
    if isinstance(out, tuple):
        return tuple(_keep_pass(a, b, in_pass) for a, b in zip(out, again, strict=True))
    if out is None:
        return None
    mask = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    mask[: in_pass.shape[0]] = in_pass[: out.shape[0]].to(out.device)
    return torch.where(mask.view(-1, *([1] * (out.dim() - 1))), again, out)


def resolve_selected_rows(
    positions: torch.Tensor, batch_rows: torch.Tensor, rows: torch.Tensor, index_stride: int
) -> torch.Tensor:
    """`rows` [T, K], the backend's conversion of `positions` (block b's token i at
    b * index_stride + i), with HOST pages resolved inside a resolving layer."""
    layer = _resolving
    if layer is None:
        return rows
    kv_rows, stride_rows = layer.row_view(layer.kv_cache, layer.block_size)
    return layer.resolution.resolve_rows(
        layer.layer_name,
        positions[: rows.shape[0]],
        batch_rows[: rows.shape[0]],
        rows,
        kv_rows,
        stride_rows,
        index_stride,
        layer.pass_index,
    )


def convert_req_index_to_global_index(
    req_id,
    block_table,
    token_indices,
    *,
    BLOCK_SIZE: int = SPARSE_MLA_PAGE_TOKENS,
    BLOCK_STRIDE_ROWS: int | None = None,
    HAS_PREFILL_WORKSPACE: bool = False,
    **kwargs,
):
    """Upstream's Triton index conversion, then HiSparse's resolution of HOST pages.

    Same arguments and results as `triton_convert_req_index_to_global_index`; every
    backend passes all but the first three by name, and the ones read here are named in
    this signature, so none is guessed from its position. The resolved entries stay
    valid, so upstream's valid counts still hold.
    """
    from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index

    def convert():
        return triton_convert_req_index_to_global_index(
            req_id,
            block_table,
            token_indices,
            BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_STRIDE_ROWS=BLOCK_STRIDE_ROWS,
            HAS_PREFILL_WORKSPACE=HAS_PREFILL_WORKSPACE,
            **kwargs,
        )

    if _resolving is None:
        return convert()
    if HAS_PREFILL_WORKSPACE:
        raise NotImplementedError(
            "Hybrid HiSparse: FlashMLA's prefill workspace gathers whole contexts through the "
            "block table; HiSparse runs FlashMLA sparse on its mixed-batch path"
        )
    if BLOCK_SIZE != SPARSE_MLA_PAGE_TOKENS:
        raise NotImplementedError(
            f"Hybrid HiSparse pages are {SPARSE_MLA_PAGE_TOKENS} tokens; the backend converted "
            f"indices with BLOCK_SIZE={BLOCK_SIZE}"
        )
    converted = convert()
    rows, counts = converted if isinstance(converted, tuple) else (converted, None)
    resolved = resolve_selected_rows(token_indices, req_id, rows, BLOCK_STRIDE_ROWS or BLOCK_SIZE)
    return (resolved, counts) if counts is not None else resolved
