# SPDX-License-Identifier: Apache-2.0
"""The memory behind the Hybrid HiSparse host pool: one mapping of exactly its size.

Owns allocating and releasing the host pool buffer of one node:
- before anything is mapped, pools a crash left behind are removed, then the bytes
  wanted are checked against the host RAM available now: `MemAvailable`, or the
  headroom of this process's memory cgroups (a container's limit) if less; a pool
  that does not fit fails at start-up naming `host_pool_gib`, the bytes wanted and
  the bytes available, instead of an OOM kill;
- the buffer is one mapping of exactly that many bytes (the kernel rounds to its
  page size only), never torch's caching host allocator, which rounds a pinned
  allocation up to a power of two;
- a rank alone on its node maps private anonymous memory. Ranks that share the
  node (tensor parallelism: every rank holds the same MLA latent cache) map one
  shared region instead (`PoolShare`): its creator makes it without a name
  (O_TMPFILE), locks it, reserves its pages (tmpfs then cannot run out under a
  running engine) and only then links it to
  /dev/shm/vllm_hisparse_<engine>_dp<rank>_n<node>.pool, so the name is never
  visible unlocked and a creator killed before that leaves nothing; the others
  map it, and the creator removes the name at once, so no exit, a killed
  process included, can leave it behind. A name whose
  creator died before that (a crash during start-up) is stale: nothing holds its
  lock, and the next creator on the node removes it, never through a symbolic
  link and only a regular file of its own user;
- the mapping is kept out of core dumps (`MADV_DONTDUMP`: it holds every user's
  prompt KV);
- on CUDA each rank registers its mapping with `cudaHostRegister` (mapped:
  kernels read it through its device address; portable: every device may use
  it), so it is pinned memory to torch and to the HiSparse kernels; on CPU the
  same mapping serves unregistered.

It never decides the pool's size, its layout or who shares it; the worker asks
for a shape and says which ranks share (`pool_placement.py`).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    from vllm.logger import init_logger
except ImportError:  # scripts/gpu_check.py maps and registers pools on machines without vLLM
    from logging import getLogger as init_logger  # type: ignore[assignment]

logger = init_logger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h).
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


SHARED_POOL_DIR = Path("/dev/shm")
SHARED_POOL_PREFIX = "vllm_hisparse_"
SHARED_POOL_SUFFIX = ".pool"
# A staging name (made only where O_TMPFILE is missing) unchanged this long and unlocked
# has no live creator.
STAGING_STALE_AFTER_S = 60.0


class HostPoolMemoryError(RuntimeError):
    """The host pool cannot be allocated (not enough RAM, or registration failed)."""


@dataclass(frozen=True)
class PoolShare:
    """How one rank takes part in making its node's host pool.

    `path`: the shared region's rendezvous name, or None for private memory of
    this rank alone; `creator`: whether this rank makes the region (always, for
    private memory); `agree(ok)`: a collective over every rank starting together,
    returning whether all were ok, so a rank that fails never leaves the others
    waiting: each calls it after making (or not) and after joining (or not) its
    mapping, and a failed agreement ends the start-up of every rank at once.
    """

    path: Path | None
    creator: bool
    agree: Callable[[bool], bool]

    @classmethod
    def alone(cls) -> PoolShare:
        return cls(None, True, lambda ok: ok)


def shared_pool_path(engine_key: str, dp_rank: int, node_index: int) -> Path:
    return SHARED_POOL_DIR / f"{SHARED_POOL_PREFIX}{engine_key}_dp{dp_rank}_n{node_index}{SHARED_POOL_SUFFIX}"


def remove_stale_pools(directory: Path = SHARED_POOL_DIR) -> list[Path]:
    """Remove host pool names whose creator is gone: nothing holds their lock.

    A live creator holds a shared lock from before its staging name exists until it
    has removed the pool's name, so only a name (staging or pool) left by a process
    that died in between can be locked exclusively here. Returns the names removed.
    """
    pattern = f"{SHARED_POOL_PREFIX}*{SHARED_POOL_SUFFIX}"
    removed = remove_stale_names(directory, pattern, "a host pool left by an engine that died starting")
    # Where O_TMPFILE is missing, a creator killed while it reserved the pool's pages leaves
    # its staging name; a live creator locks it right after making it.
    staging = f".{pattern}.*.tmp"
    return removed + remove_stale_names(
        directory, staging, "a host pool an engine died reserving", STAGING_STALE_AFTER_S
    )


def remove_stale_names(directory: Path, pattern: str, what: str, min_age_s: float = 0.0) -> list[Path]:
    """Remove the names matching `pattern` in `directory` that no live process holds a lock
    on, and (`min_age_s`) whose content changed no later than that long ago: never through a
    symbolic link, only a regular file of this user's, and only the file locked here (not
    one made under the name since). Returns the names removed."""
    removed = []
    for path in sorted(directory.glob(pattern)):
        try:
            # Never through a symbolic link, and only a regular file of this user's.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # removed meanwhile, a link, or not ours to open
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            if min_age_s and time.time() - info.st_mtime < min_age_s:
                continue  # its maker may not have locked it yet
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The name still names the file locked here (not one made since).
            if os.lstat(path).st_ino != info.st_ino:
                continue
        except OSError:
            continue  # a live engine holds it, or the name went meanwhile
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        removed.append(path)
        logger.warning("Hybrid HiSparse: removed %s, %s", path, what)
    return removed


def shared_memory_free_bytes(directory: Path = SHARED_POOL_DIR) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def _setting(host_pool_gib: float | None) -> str:
    """How an error names the pool: by the operator's setting when it is known."""
    return "the host pool" if host_pool_gib is None else f"hisparse_config.host_pool_gib={host_pool_gib}"


def available_host_bytes(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int:
    """Host RAM that can be allocated now without swapping or an OOM kill: Linux's
    `MemAvailable`, or less where this process's memory cgroup (a container's limit) has
    less headroom left (`cgroup_memory_headroom`)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = cgroup_memory_headroom(cgroup_root, proc_cgroup)
    return available if headroom is None else min(available, headroom)


def _read_int(path: Path) -> int | None:
    """An integer file of the cgroup tree; None when absent, unreadable or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory_headroom(cgroup_root: Path, proc_cgroup: Path) -> int | None:
    """Bytes this process's memory cgroups let it add before their limit (the smallest over
    its cgroup and every ancestor: cgroup v2 `memory.max` - `memory.current`; v1
    `memory.limit_in_bytes` - `memory.usage_in_bytes`); None when no limit applies or the
    tree cannot be read. Pages of a /dev/shm pool are charged there too."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    headroom = None
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # cgroup v2
            base, limit_name, usage_name = cgroup_root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # cgroup v1
            base = cgroup_root / "memory"
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        group = base / path.lstrip("/")
        while True:
            limit, usage = _read_int(group / limit_name), _read_int(group / usage_name)
            # v1 reports "no limit" as a huge page-aligned number, above any host's RAM.
            if limit is not None and usage is not None and limit < 1 << 60:
                room = max(limit - usage, 0)
                headroom = room if headroom is None else min(headroom, room)
            if group == base or base not in group.parents:
                break
            group = group.parent
    return headroom


def _advise(mapping: mmap.mmap) -> tuple[str, ...]:
    """Advice the kernel took for the pool's mapping: never into a core dump (it holds every
    user's prompt KV); advice a kernel does not support is skipped. Not MADV_HUGEPAGE:
    with the common `defrag=madvise` setting it compacts memory on every fault, and a 1 GiB
    pool took 3.6 s to fault in with it against 0.6-0.8 s without (measured on the CPU test
    bed), which at 384 GiB would add minutes to start-up, when cudaHostRegister faults it in."""
    taken = []
    for constant, name in (("MADV_DONTDUMP", "dontdump"),):
        advice = getattr(mmap, constant, None)
        if advice is None:
            continue
        try:
            mapping.madvise(advice)
        except OSError:
            continue
        taken.append(name)
    return tuple(taken)


class HostPoolMemory:
    """A host buffer of `shape` and `dtype` in one mapping of exactly its size.

    `register`: pin it for CUDA (`cudaHostRegister`, mapped and portable).
    `host_pool_gib`: the configured size, named in the error when it does not fit.
    `share`: the node's ranks that map the same region (None: this rank alone).
    `tensor` is the buffer; `release()` unregisters it (also done when collected).
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        register: bool,
        host_pool_gib: float | None = None,
        share: PoolShare | None = None,
    ) -> None:
        element = torch.empty((), dtype=dtype).element_size()
        self.nbytes = math.prod(shape) * element
        if self.nbytes <= 0:
            raise ValueError(f"host pool shape {shape} holds no bytes")
        share = share if share is not None else PoolShare.alone()
        self._mapping = self._map(share, host_pool_gib)
        self.advice = _advise(self._mapping)
        flat = torch.frombuffer(self._mapping, dtype=torch.uint8, count=self.nbytes)
        self.tensor = flat.view(dtype).view(shape)
        self.shared = share.path is not None
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

    def _map(self, share: PoolShare, host_pool_gib: float | None) -> mmap.mmap:
        """Make (creator) or join the mapping, agreeing with the other ranks after each."""
        fd: int | None = None
        mapping: mmap.mmap | None = None
        failure: BaseException | None = None
        try:
            if share.creator:
                # A pool a crash left behind holds RAM the check below would count as used
                # (swept by every creator, a private pool's too).
                remove_stale_pools(share.path.parent if share.path is not None else SHARED_POOL_DIR)
                self._check_ram(host_pool_gib)
                if share.path is None:
                    # Private anonymous memory, like any large host allocation (not shmem-backed).
                    mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                else:
                    fd = self._create_region(share.path, host_pool_gib)
                    mapping = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        except Exception as e:
            failure = e
        if not self._agree(share, failure is None, fd, mapping):
            self._give_up(share, fd, mapping)
            raise failure or HostPoolMemoryError(
                f"Hybrid HiSparse: another rank could not create the shared host pool {share.path}"
            )
        try:
            if not share.creator:
                assert share.path is not None
                fd = os.open(share.path, os.O_RDWR)
                size = os.fstat(fd).st_size
                if size != self.nbytes:
                    raise HostPoolMemoryError(
                        f"Hybrid HiSparse: the shared host pool {share.path} holds {size} bytes, "
                        f"this rank needs {self.nbytes}: the ranks of this node disagree on its shape"
                    )
                mapping = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        except Exception as e:
            failure = e
        everyone_mapped = self._agree(share, failure is None, fd, mapping)
        if share.creator and share.path is not None:
            share.path.unlink(missing_ok=True)  # every rank mapped it, or gave up: the name goes
        if not everyone_mapped:
            self._give_up(share, fd, mapping)
            raise failure or HostPoolMemoryError(
                f"Hybrid HiSparse: another rank could not map the shared host pool {share.path}"
            )
        if fd is not None:
            os.close(fd)  # the mapping keeps the memory; the lock had only to outlive the name
        assert mapping is not None
        return mapping

    def _check_ram(self, host_pool_gib: float | None) -> None:
        available = available_host_bytes()
        if self.nbytes > available:
            raise HostPoolMemoryError(
                f"Hybrid HiSparse: {_setting(host_pool_gib)} needs {self.nbytes} bytes of host memory "
                f"on this node, but only {available} bytes are available; lower host_pool_gib or free "
                f"host memory"
            )

    def _create_region(self, path: Path, host_pool_gib: float | None) -> int:
        free = shared_memory_free_bytes(path.parent)
        if self.nbytes > free:
            raise HostPoolMemoryError(
                f"Hybrid HiSparse: {_setting(host_pool_gib)} is shared by this node's ranks in "
                f"{path.parent}, which has {free} bytes free of the {self.nbytes} needed; give the "
                f"container more shared memory (docker run --ipc=host, or --shm-size) or lower "
                f"host_pool_gib"
            )
        # Made with no name at all (O_TMPFILE): locked and its pages reserved there, then
        # linked to its rendezvous name. The name is never visible unlocked (a peer's sweep
        # cannot take it for stale), and a creator killed while reserving, the longest step,
        # leaves no name behind: the kernel frees the pages with its last descriptor.
        staging: Path | None = None
        try:
            fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR, 0o600)
        except (AttributeError, OSError):
            # No O_TMPFILE here: a staging name no pool sweep matches until it is a minute
            # old (a dead creator's is removed by `remove_stale_pools` after that).
            staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # Reserve every page now: tmpfs grows on demand, and a full /dev/shm would
            # otherwise end a running engine with SIGBUS on its first write past it.
            os.posix_fallocate(fd, 0, self.nbytes)
            try:
                if staging is None:
                    # linkat(AT_SYMLINK_FOLLOW) through the descriptor's /proc link: Python calls
                    # linkat, not link, only when given a directory descriptor.
                    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory, follow_symlinks=True)
                    finally:
                        os.close(directory)
                else:
                    os.link(staging, path)
            except FileExistsError:
                raise HostPoolMemoryError(
                    f"Hybrid HiSparse: {path} belongs to an engine starting now with the same id; "
                    f"two engines cannot share one engine id"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        finally:
            if staging is not None:
                staging.unlink(missing_ok=True)
        return fd

    @classmethod
    def _agree(cls, share: PoolShare, ok: bool, fd: int | None, mapping: mmap.mmap | None) -> bool:
        """`share.agree(ok)`; where the collective itself fails (a rank died, the start-up
        was interrupted), this rank gives up as on a failed agreement, so a name it made
        does not outlive it holding the pool's size in /dev/shm."""
        try:
            return share.agree(ok)
        except BaseException:
            cls._give_up(share, fd, mapping)
            raise

    @staticmethod
    def _give_up(share: PoolShare, fd: int | None, mapping: mmap.mmap | None) -> None:
        # Only a name this rank made goes (one an engine with the same id made stays).
        if share.creator and share.path is not None and fd is not None:
            share.path.unlink(missing_ok=True)
        if mapping is not None:
            mapping.close()
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Unregister the mapping from CUDA (idempotent); the memory goes with the last reference."""
        with self._lock:
            if self.registered:
                self.registered = False
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())

    def __del__(self) -> None:
        if getattr(self, "registered", False):
            self.release()
