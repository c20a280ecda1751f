# SPDX-License-Identifier: Apache-2.0
"""The memory behind the Hybrid HiSparse host pool: one mapping of exactly its size.

Owns allocating and releasing the worker's host pool buffer:
- before anything is mapped, the bytes wanted are checked against the host RAM
  available now (`MemAvailable`); a pool that does not fit fails at start-up
  naming `host_pool_gib`, the bytes wanted and the bytes available;
- the buffer is one anonymous private mapping of exactly that many bytes (the
  kernel rounds to its page size only), never torch's caching host allocator,
  which rounds a pinned allocation up to a power of two;
- on CUDA the mapping is registered with `cudaHostRegister` (mapped: kernels
  read it through its device address; portable: every device may use it), so
  it is pinned memory to torch and to the HiSparse kernels; on CPU the same
  mapping serves unregistered.

It never decides the pool's size or layout; the worker asks for a shape.
"""

from __future__ import annotations

import math
import mmap
import os
import threading

import torch

# cudaHostRegister flags (cuda_runtime_api.h).
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


class HostPoolMemoryError(RuntimeError):
    """The host pool cannot be allocated (not enough RAM, or registration failed)."""


def available_host_bytes() -> int:
    """Host RAM that can be allocated now without swapping (Linux `MemAvailable`)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostPoolMemory:
    """A host buffer of `shape` and `dtype` in one mapping of exactly its size.

    `register`: pin it for CUDA (`cudaHostRegister`, mapped and portable).
    `host_pool_gib`: the configured size, named in the error when it does not fit.
    `tensor` is the buffer; `release()` unregisters it (also done when collected).
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        register: bool,
        host_pool_gib: float | None = None,
    ) -> None:
        element = torch.empty((), dtype=dtype).element_size()
        self.nbytes = math.prod(shape) * element
        if self.nbytes <= 0:
            raise ValueError(f"host pool shape {shape} holds no bytes")
        available = available_host_bytes()
        if self.nbytes > available:
            asked = "the host pool"
            if host_pool_gib is not None:
                asked = f"hisparse_config.host_pool_gib={host_pool_gib}"
            raise HostPoolMemoryError(
                f"Hybrid HiSparse: {asked} needs {self.nbytes} bytes of host memory on this worker, "
                f"but only {available} bytes are available; lower host_pool_gib or free host memory"
            )
        # Private anonymous memory, like any large host allocation (not shmem-backed).
        self._mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(self._mapping, dtype=torch.uint8, count=self.nbytes)
        self.tensor = flat.view(dtype).view(shape)
        self.registered = False
        self._lock = threading.Lock()
        if register:
            result = torch.cuda.cudart().cudaHostRegister(
                self.tensor.data_ptr(), self.nbytes, CUDA_HOST_REGISTER_MAPPED | CUDA_HOST_REGISTER_PORTABLE
            )
            if int(result) != 0:
                raise HostPoolMemoryError(
                    f"Hybrid HiSparse: cudaHostRegister of the {self.nbytes}-byte host pool failed "
                    f"(CUDA error {int(result)}); the host could not pin that much memory"
                )
            self.registered = True

    def release(self) -> None:
        """Unregister the mapping from CUDA (idempotent); the memory goes with the last reference."""
        with self._lock:
            if self.registered:
                self.registered = False
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())

    def __del__(self) -> None:
        if getattr(self, "registered", False):
            self.release()
