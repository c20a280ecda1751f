# SPDX-License-Identifier: Apache-2.0
"""Batched page copies between the sparse-MLA KV caches and the HiSparse host pool.

Owns the contract every implementation must match (the CUDA kernel in
csrc/hisparse_page_copy.cu included): for page n and sparse-MLA layer l, after
`copy_pages` the layer's device block `block_ids[n, l]` and the host pool's
slot `[l, host_pages[n]]` hold the same bytes, copied device -> host
(`to_host`, a post-forward copy) or host -> device (a restore). Every page of
every layer goes in one call: one kernel launch on CUDA, ordered on the current
stream; on other devices one indexed copy per layer (the torch reference).

It validates shapes, dtypes and devices with clear errors; it never decides
what to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.v1.hisparse.ops import cuda_kernels_available


def copy_pages(
    kv_caches: Sequence[torch.Tensor],
    host_pool: torch.Tensor,
    block_ids: torch.Tensor,
    host_pages: torch.Tensor,
    to_host: bool,
    use_kernel: bool | None = None,
) -> None:
    """Copy pages of every layer between `kv_caches` and `host_pool`.

    kv_caches[l]: layer l's cache, [num_blocks, block_size, width] (blocks may be
    strided further apart than a page). host_pool: [num_layers, num_host_pages,
    block_size, width], contiguous. block_ids: [num_pages, num_layers] int64,
    the block of each page in each layer's group. host_pages: [num_pages] int64.
    `use_kernel`: None picks the CUDA kernel for CUDA caches when the extension is
    built, the reference otherwise; True or False forces one (the kernel needs
    CUDA caches, a pinned host pool and the `copy_pages` op registered).
    """
    _validate(kv_caches, host_pool, block_ids, host_pages)
    if use_kernel is None:
        use_kernel = kv_caches[0].is_cuda and cuda_kernels_available()
    if not host_pages.numel():
        return
    if use_kernel:
        if not host_pool.is_pinned():
            raise ValueError("the host pool must be pinned memory for the CUDA page copy")
        element = host_pool.element_size()
        device = kv_caches[0].device
        torch.ops._hisparse_C.copy_pages(
            torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64),
            torch.tensor([c.stride(0) * element for c in kv_caches], dtype=torch.int64),
            host_pool[0, 0].numel() * element,
            host_pool,
            host_pool.stride(0) * element,
            host_pool.stride(1) * element,
            block_ids.to(device, torch.int64).contiguous(),
            host_pages.to(device, torch.int64).contiguous(),
            to_host,
        )
        return
    host_index = host_pages.long().cpu()
    for layer, cache in enumerate(kv_caches):
        blocks = block_ids[:, layer].long().to(cache.device)
        if to_host:
            host_pool[layer, host_index] = cache[blocks].to(host_pool.device)
        else:
            cache[blocks] = host_pool[layer, host_index].to(cache.device)


def _validate(
    kv_caches: Sequence[torch.Tensor],
    host_pool: torch.Tensor,
    block_ids: torch.Tensor,
    host_pages: torch.Tensor,
) -> None:
    if host_pool.dim() != 4 or not host_pool.is_contiguous():
        raise ValueError(
            f"host_pool must be a contiguous [layers, pages, block_size, width] tensor, got "
            f"{tuple(host_pool.shape)}"
        )
    if len(kv_caches) != host_pool.shape[0]:
        raise ValueError(f"{len(kv_caches)} KV caches for a host pool of {host_pool.shape[0]} layers")
    for layer, cache in enumerate(kv_caches):
        if cache.dim() != 3 or tuple(cache.shape[1:]) != tuple(host_pool.shape[2:]):
            raise ValueError(
                f"KV cache of layer {layer} is {tuple(cache.shape)}; pages must be "
                f"{tuple(host_pool.shape[2:])} like the host pool's"
            )
        if cache.dtype != host_pool.dtype:
            raise ValueError(f"KV cache of layer {layer} is {cache.dtype}, the host pool {host_pool.dtype}")
        if cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
            raise ValueError(
                f"KV cache of layer {layer} must have contiguous pages, strides {cache.stride()}"
            )
    if block_ids.dim() != 2 or block_ids.shape[1] != len(kv_caches) or block_ids.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"block_ids must be [pages, {len(kv_caches)}] int32/int64, got "
            f"{tuple(block_ids.shape)} {block_ids.dtype}"
        )
    if host_pages.shape != (block_ids.shape[0],) or host_pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"host_pages must be [{block_ids.shape[0]}] int32/int64, got "
            f"{tuple(host_pages.shape)} {host_pages.dtype}"
        )
