# SPDX-License-Identifier: Apache-2.0
"""Host-side KV offload transfers for vLLM's CPU platform.

Owns what the KV ``OffloadingConnector`` (``CPUOffloadingSpec`` and
``TieringOffloadingSpec``) needs to run when the "GPU" KV cache is itself host
memory, i.e. on vLLM's CPU platform:

- ``runs_on_host``: whether the current platform is vLLM's CPU platform;
- ``is_host_kv_tensor``: whether a KV cache tensor is a valid host-platform one;
- ``swap_blocks_batch``: the host copy that replaces the CUDA/XPU
  ``_C_cache_ops.swap_blocks_batch`` op (absent from the CPU build), with the same
  descriptor signature (source pointers, destination pointers, byte sizes);
- ``HostEvent`` / ``new_transfer_event``: a timing event for transfers, because the
  CPU backend has no ``torch.Event`` while the connector times every transfer;
- ``host_region_rank``: the slot a CPU-platform worker takes in the shared offload
  region, which upstream derives from the accelerator device index (there is none).

On the CPU platform every copy completes before ``swap_blocks_batch`` returns, so
a transfer is finished as soon as it is submitted. That ordering is safe for the
connector: stores are submitted in the engine step after the forward pass that
wrote the KV (and CPU forwards are synchronous), and loads are submitted before
the forward pass that reads them.

It never touches upstream state: it allocates no KV memory, opens no shared
memory regions, registers nothing, and patches nothing at import. Off the CPU
platform every hook falls through to upstream's own path (``new_transfer_event``
then returns the ``torch.Event`` upstream creates). The descriptors it copies are
built by upstream's ``SingleDirectionOffloadingHandler`` and point into tensors that
handler keeps alive; it does not validate addresses beyond their lengths and sizes.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from vllm.platforms import current_platform

__all__ = [
    "HostEvent",
    "host_region_rank",
    "is_host_kv_tensor",
    "new_transfer_event",
    "runs_on_host",
    "swap_blocks_batch",
]


def runs_on_host() -> bool:
    """True on vLLM's CPU platform, where the KV cache lives in host memory."""
    return current_platform.is_cpu()


def is_host_kv_tensor(tensor: torch.Tensor) -> bool:
    """True for a KV cache tensor the host transfer path can copy: a CPU tensor
    on vLLM's CPU platform."""
    return runs_on_host() and tensor.device.type == "cpu"


def _as_u64(descriptors: torch.Tensor) -> np.ndarray:
    """uint64 view of a 1-D int64/uint64 CPU descriptor tensor (no copy when contiguous)."""
    if descriptors.device.type != "cpu" or descriptors.ndim != 1:
        raise ValueError(
            f"descriptors must be a 1-D CPU tensor, got {descriptors.device} {descriptors.shape}"
        )
    if descriptors.dtype not in (torch.int64, torch.uint64):
        raise ValueError(f"descriptors must be int64 or uint64, got {descriptors.dtype}")
    return descriptors.contiguous().numpy().view(np.uint64)


def swap_blocks_batch(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
) -> None:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]``, for every i.

    Host replacement for ``vllm._custom_ops.swap_blocks_batch``: same arguments,
    all three 1-D int64 (or uint64) CPU tensors of equal length. Descriptors whose
    source and destination both continue the previous descriptor's ranges are
    merged first, so a run of consecutive blocks costs one ``memmove``. The copy is
    synchronous. ``is_src_access_order_any`` is a CUDA driver hint and is ignored.
    """
    del is_src_access_order_any  # no copy engine to hint on the host
    src = _as_u64(src_ptrs)
    dst = _as_u64(dst_ptrs)
    nbytes = _as_u64(sizes)
    if not len(src) == len(dst) == len(nbytes):
        raise ValueError(f"descriptor lengths differ: {len(src)} src, {len(dst)} dst, {len(nbytes)} sizes")
    if len(nbytes) == 0:
        return
    if np.any(nbytes.view(np.int64) < 0):
        raise ValueError("negative copy size in descriptors")

    # Descriptor i starts a new run unless it continues descriptor i-1 on both sides.
    src_end = src[:-1] + nbytes[:-1]
    dst_end = dst[:-1] + nbytes[:-1]
    continues = (src[1:] == src_end) & (dst[1:] == dst_end)
    run_starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    run_bytes = np.add.reduceat(nbytes, run_starts)

    for src_addr, dst_addr, count in zip(
        src[run_starts].tolist(), dst[run_starts].tolist(), run_bytes.tolist(), strict=True
    ):
        if count:
            ctypes.memmove(dst_addr, src_addr, count)


class HostEvent:
    """Stand-in for ``torch.Event(enable_timing=True)`` on the CPU platform.

    Work on the host is complete when ``record`` is reached, so recording stores the
    wall-clock time, ``query`` is always True and ``synchronize`` returns at once.
    ``elapsed_time`` gives milliseconds, like ``torch.Event.elapsed_time``.
    """

    __slots__ = ("_recorded_at",)

    def __init__(self) -> None:
        self._recorded_at: float | None = None

    def record(self, stream: object | None = None) -> None:
        del stream  # host work is ordered by program order
        self._recorded_at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object | None = None) -> None:
        del stream

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s record."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end_event._recorded_at - self._recorded_at) * 1e3


def new_transfer_event() -> torch.Event | HostEvent:
    """A timing event for one transfer: ``HostEvent`` on the CPU platform,
    ``torch.Event(enable_timing=True)`` elsewhere (what upstream creates)."""
    if runs_on_host():
        return HostEvent()
    return torch.Event(enable_timing=True)


def host_region_rank(parallel_rank: int, world_size: int) -> int:
    """A CPU-platform worker's slot in ``[0, world_size)`` of the shared offload region.

    Upstream folds the physical accelerator index into the slot range; the CPU platform
    has no accelerator index (``torch.accelerator.current_device_index`` raises), so the
    worker's rank within the replica (``OffloadingParallelConfig.rank``) names the slot.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return parallel_rank % world_size
