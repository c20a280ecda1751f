# SPDX-License-Identifier: Apache-2.0
"""The Hybrid HiSparse top-K resolver, torch reference: positions -> physical rows.

Owns the semantics every resolver implementation must match exactly (the CUDA
kernel included): for one sparse-MLA layer and one batch, map the indexer's
selected token positions to the rows attention reads, in the same order, so
attention reads exactly the rows it would read with everything resident:

- a position on a resident page is read in place (block table, as upstream);
- a position held in the request's hot buffer is a hit: its slot's LRU stamp
  becomes this step;
- otherwise it is a miss: one row is copied from the host pool into the least
  recently used hot slot not selected in this step (lowest stamp, then lowest
  slot; empty slots have stamp -1), which then holds that position.

Entries are visited token by token, in order, so a duplicate in a list, or the
same position picked by several tokens of one request in one step (prefill
chunks, multi-token decode), is one miss followed by hits. Hot state is per
request and per layer (each layer has its own rows). A step whose distinct
misses for one request exceed its free slots cannot be served and raises
`HotBufferTooSmall`.

`resolve_topk_slots` validates shapes and dtypes with clear errors, then runs
the CUDA kernel (csrc/hisparse_resolver.cu, in the `vllm._hisparse_C`
extension the CUDA wheel builds) on CUDA tensors and the reference elsewhere.

It never allocates hot buffers or host memory; it reads and updates the state
it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.hisparse.ops import cuda_kernels_available


class HotBufferTooSmall(RuntimeError):
    """A request selected more distinct non-resident rows in one step than its hot buffer holds."""


@dataclass
class HotState:
    """One layer's hot buffers: row r of each tensor is request r's buffer."""

    rows: torch.Tensor  # [R, H] int64: physical row of each slot in the layer's KV cache
    positions: torch.Tensor  # [R, H] int64: token position a slot holds, -1 if empty
    stamps: torch.Tensor  # [R, H] int64: step that last selected a slot, -1 never

    def validate(self, num_requests: int) -> None:
        for name in ("rows", "positions", "stamps"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int64 or tensor.dim() != 2:
                raise ValueError(
                    f"hot state {name} must be 2-D int64, got {tuple(tensor.shape)} {tensor.dtype}"
                )
            if tensor.shape != self.rows.shape:
                raise ValueError(
                    f"hot state {name} has shape {tuple(tensor.shape)}, rows {tuple(self.rows.shape)}"
                )
        if self.rows.shape[0] < num_requests:
            raise ValueError(f"hot state covers {self.rows.shape[0]} requests, the batch has {num_requests}")


def resolve_topk_slots(
    positions: torch.Tensor,
    req_ids: torch.Tensor,
    page_table: torch.Tensor,
    block_size: int,
    kv_rows: torch.Tensor,
    host_rows: torch.Tensor,
    host_page_table: torch.Tensor,
    hot: HotState,
    step: int,
    block_stride_rows: int | None = None,
) -> torch.Tensor:
    """Resolve selected positions [T, K] (-1 padded) to rows of `kv_rows`, same order.

    req_ids [T]: each query's row in the per-request tables. page_table [R, P]:
    device block of each page, -1 where the page is not resident. host_page_table
    [R, P]: host page holding each page's copy, -1 if none. kv_rows [N, D] and
    host_rows [num_host_pages * block_size, D]: the layer's device cache and host
    pool as rows. Misses write into `kv_rows` and update `hot`. Returns [T, K] int64,
    -1 where the position is -1.

    Runs the CUDA kernel for CUDA tensors when the extension is built, the torch
    reference below otherwise; both follow the contract in the module docstring.
    """
    _validate(positions, req_ids, page_table, host_page_table, kv_rows, host_rows)
    hot.validate(page_table.shape[0])
    stride = block_size if block_stride_rows is None else block_stride_rows
    if kv_rows.is_cuda and cuda_kernels_available():
        try:
            return torch.ops._hisparse_C.resolve_topk_slots(
                positions.long().contiguous(),
                req_ids.long().contiguous(),
                page_table.long().contiguous(),
                kv_rows,
                host_rows,
                host_page_table.long().contiguous(),
                hot.rows,
                hot.positions,
                hot.stamps,
                block_size,
                stride,
                step,
            )
        except RuntimeError as e:
            if "HotBufferTooSmall" in str(e):
                raise HotBufferTooSmall(str(e)) from e
            raise

    pos = positions.long()
    valid = pos >= 0
    safe = pos.clamp(min=0)
    pages = safe // block_size
    req = req_ids.long().unsqueeze(1).expand_as(pos)
    blocks = page_table.long()[req, pages]
    resident = valid & (blocks >= 0)
    out = torch.where(resident, blocks * stride + safe % block_size, torch.full_like(pos, -1))

    for t, k in torch.nonzero(valid & ~resident).tolist():
        r, p = int(req[t, k]), int(pos[t, k])
        held = torch.nonzero(hot.positions[r] == p)
        if held.numel():
            slot = int(held[0, 0])
        else:
            slot = _least_recently_used(hot, r, step, p)
            host_page = int(host_page_table[r, p // block_size])
            if host_page < 0:
                raise ValueError(f"request row {r}: position {p} is neither resident nor in the host pool")
            kv_rows[hot.rows[r, slot]] = host_rows[host_page * block_size + p % block_size]
            hot.positions[r, slot] = p
        hot.stamps[r, slot] = step
        out[t, k] = hot.rows[r, slot]
    return out


def _least_recently_used(hot: HotState, r: int, step: int, position: int) -> int:
    stamps = hot.stamps[r]
    eligible = stamps != step
    if not bool(eligible.any()):
        raise HotBufferTooSmall(
            f"request row {r} needs position {position} but all {stamps.numel()} hot slots were "
            f"selected in step {step}; raise hisparse_config.device_buffer_size"
        )
    masked = torch.where(eligible, stamps, torch.iinfo(torch.int64).max)
    return int(torch.argmin(masked))  # argmin returns the first (lowest) slot among ties


def _validate(
    positions: torch.Tensor,
    req_ids: torch.Tensor,
    page_table: torch.Tensor,
    host_page_table: torch.Tensor,
    kv_rows: torch.Tensor,
    host_rows: torch.Tensor,
) -> None:
    if positions.dim() != 2 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be [T, K] int32/int64, got {tuple(positions.shape)} {positions.dtype}"
        )
    if req_ids.shape != (positions.shape[0],):
        raise ValueError(f"req_ids must be [{positions.shape[0]}], got {tuple(req_ids.shape)}")
    if page_table.dim() != 2 or host_page_table.shape != page_table.shape:
        raise ValueError(
            f"page_table and host_page_table must be the same [R, P] shape, got "
            f"{tuple(page_table.shape)} and {tuple(host_page_table.shape)}"
        )
    if kv_rows.dim() != 2 or host_rows.dim() != 2 or kv_rows.shape[1] != host_rows.shape[1]:
        raise ValueError(
            f"kv_rows and host_rows must be [rows, D] with one D, got {tuple(kv_rows.shape)} "
            f"and {tuple(host_rows.shape)}"
        )
    if kv_rows.dtype != host_rows.dtype:
        raise ValueError(f"kv_rows is {kv_rows.dtype} but host_rows is {host_rows.dtype}")
