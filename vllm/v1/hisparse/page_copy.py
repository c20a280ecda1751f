# SPDX-License-Identifier: Apache-2.0
"""Batched page copies between the sparse-MLA KV caches and the HiSparse host pool.

Owns the contract every implementation must match (the CUDA kernel in
csrc/hisparse_page_copy.cu included): for page n and sparse-MLA layer l, after
`copy_pages` the layer's device block `block_ids[n, l]` and the host pool's
slot `[l, host_pages[n]]` hold the same bytes, copied device -> host
(`to_host`, a post-forward copy) or host -> device (a restore). Every page of
every layer goes in one call: one kernel launch on CUDA, ordered on the current
stream; on other devices one indexed copy per layer (the torch reference).
`PageCopyStream` runs a step's post-forward copies on a CUDA copy stream beside
the next step's forward.

It validates shapes, dtypes, devices, bounds and duplicates with clear errors; it never decides
what to copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm.v1.hisparse.ops import cuda_kernels_available, require_cuda_kernels

# The kernel's bit in a step's error word (csrc/hisparse_errors.h; resolver.py re-exports
# every bit and raises for them once per step).
ERROR_PAGE_OUT_OF_BOUNDS = 8


class PageCopyError(ValueError):
    """A page copy named a block or host page outside its table, or a destination twice."""


def copy_pages(
    kv_caches: Sequence[torch.Tensor],
    host_pool: torch.Tensor,
    block_ids: torch.Tensor,
    host_pages: torch.Tensor,
    to_host: bool,
    use_kernel: bool | None = None,
    error: torch.Tensor | None = None,
) -> None:
    """Copy pages of every layer between `kv_caches` and `host_pool`.

    kv_caches[l]: layer l's cache, [num_blocks, block_size, width] (blocks may be
    strided further apart than a page). host_pool: [num_layers, num_host_pages,
    block_size, width], contiguous. block_ids: [num_pages, num_layers] int64,
    the block of each page in each layer's group. host_pages: [num_pages] int64.
    Both index tensors are host tensors, refused up front when a destination
    repeats (a host page when `to_host`, a layer's block otherwise): two copies
    into one destination would race on a GPU.
    `use_kernel`: None picks the CUDA kernel for CUDA caches when the extension is
    built, the reference otherwise; True or False forces one (the kernel needs
    CUDA caches, a pinned host pool and the `copy_pages` op registered).
    Out-of-bounds indices: the reference raises `PageCopyError`; the kernel skips
    the page and sets ERROR_PAGE_OUT_OF_BOUNDS in `error`, the step's error word
    on the caches' device, which the worker reads once per step (without `error`,
    this call reads its own word back and raises: for tools and tests).
    """
    pages, blocks_of = _validate(kv_caches, host_pool, block_ids, host_pages, to_host)
    if use_kernel is None:
        use_kernel = kv_caches[0].is_cuda and cuda_kernels_available()
    if not host_pages.numel():
        return
    if use_kernel:
        if not host_pool.is_pinned():
            raise ValueError("the page copy kernel needs a pinned (or CUDA-registered) host pool")
        device = kv_caches[0].device
        own_error = error is None
        word = torch.zeros((), dtype=torch.int64, device=device) if own_error else error
        torch.ops._hisparse_C.copy_pages(
            list(kv_caches),
            host_pool,
            block_ids.to(device, torch.int64, non_blocking=True).contiguous(),
            host_pages.to(device, torch.int64, non_blocking=True).contiguous(),
            to_host,
            word,
        )
        if own_error and word is not None and int(word) & ERROR_PAGE_OUT_OF_BOUNDS:
            raise PageCopyError("HiSparse page copy: a device block or host page was out of bounds (skipped)")
        return
    if kv_caches[0].is_cuda:
        require_cuda_kernels()
    host_index = host_pages.long()
    if not 0 <= min(pages) <= max(pages) < host_pool.shape[1]:
        raise PageCopyError(f"HiSparse page copy: a host page is outside [0, {host_pool.shape[1]})")
    for layer, cache in enumerate(kv_caches):
        if not 0 <= min(blocks_of[layer]) <= max(blocks_of[layer]) < cache.shape[0]:
            raise PageCopyError(
                f"HiSparse page copy: a block of layer {layer} is outside [0, {cache.shape[0]})"
            )
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
    to_host: bool,
) -> tuple[list[int], list[list[int]]]:
    """Raise for a bad argument; the host pages and each layer's blocks as lists."""
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
    if (
        block_ids.dim() != 2
        or block_ids.shape[1] != len(kv_caches)
        or block_ids.dtype
        not in (
            torch.int32,
            torch.int64,
        )
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
    if block_ids.device.type != "cpu" or host_pages.device.type != "cpu":
        raise ValueError("block_ids and host_pages must be host tensors (checked before reaching the device)")
    # Two copies into one destination would race on a GPU (sources may repeat). The
    # lists are a step's pages, small: checked in Python, one read of each tensor.
    pages = host_pages.tolist()
    blocks_of = [list(column) for column in zip(*block_ids.tolist(), strict=True)] or [[] for _ in kv_caches]
    if to_host and len(set(pages)) != len(pages):
        raise PageCopyError("HiSparse page copy: a host page is the destination of two pages in one copy")
    for layer, blocks in enumerate(blocks_of if not to_host else ()):
        if len(set(blocks)) != len(blocks):
            raise PageCopyError(
                f"HiSparse page copy: a block of layer {layer} is the destination of two pages in one copy"
            )
    return pages, blocks_of


@dataclass
class CopiesOut:
    """A step's device->host page copies launched on the copy stream: done once `event`
    has passed, and then `error` (host memory) holds their own error word."""

    event: Any
    error: torch.Tensor


class PageCopyStream:
    """Where a step's post-forward page copies (device -> host) run.

    On CUDA, a side stream: it first waits for the work queued on the compute stream so
    far (the forward that wrote the pages), then copies and records an event, so the
    next step's forward runs beside the copies instead of after them (on the writing
    rank; the node's other ranks no longer wait for it at their next collective). That
    is safe because a copy's source blocks and destination host page stay its own until
    the scheduler reads it durable, which is after the event (with a pool on each of
    several nodes, the other nodes' writers' copies are fenced instead, `fence` and
    `worker.COPY_FENCE_STEPS`): a page with a copy in
    flight is never demoted, and an ended request's copies keep their blocks and host
    pages (`residency.py`, orphans); and what the copy allocates (its indices and error
    word) is allocated on the side stream. The copies' error bits go to a word of their
    own, read from host memory after the event. Restores and the resolver's row copies
    stay on the compute stream: blocks the scheduler frees for the next step may still
    be read by the forward queued before it, and layer L's rows are needed right after
    its indexer, so neither has anything to overlap with (docs/architecture.md, "Copies
    and reports").
    On other devices the copies run in place, with the step's error word.

    `cuda`: torch.cuda, or a stand-in with its Stream, Event, current_stream and stream.
    """

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self._cuda: Any = cuda if cuda is not None else (torch.cuda if device.type == "cuda" else None)
        self._stream = self._cuda.Stream(device=device) if self._cuda is not None else None

    def launch(
        self, copy_pages: Callable[[torch.Tensor], None], step_error: torch.Tensor
    ) -> CopiesOut | None:
        """Run `copy_pages(error_word)`: on the copy stream (returned: when it is done), or
        in place with the step's error word (None: done)."""
        if self._stream is None:
            copy_pages(step_error)
            return None
        cuda = self._cuda
        self._stream.wait_stream(cuda.current_stream(self.device))
        with cuda.stream(self._stream):
            word = torch.zeros(1, dtype=torch.int64, device=self.device)
            copy_pages(word)
            error = torch.empty(1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            error.copy_(word, non_blocking=True)
            event = cuda.Event()
            event.record(self._stream)
        return CopiesOut(event, error)

    def fence(self, copies_out: CopiesOut) -> None:
        """Work queued on the compute stream from now on waits for these copies."""
        self._cuda.current_stream(self.device).wait_event(copies_out.event)
