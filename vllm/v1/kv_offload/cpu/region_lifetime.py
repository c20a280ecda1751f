# SPDX-License-Identifier: Apache-2.0
"""When the name of the KV offload connector's shared host region may go.

Owns one decision for ``SharedOffloadRegion`` (``/dev/shm/vllm_offload_<engine
id>.mmap``): the file's name is only a rendezvous. Once every process that maps
the region has done so, the name can be unlinked; the memory stays valid for
every mapping and the kernel frees it when the last one closes, however its
process ends (a killed worker or engine included).

``CPUOffloadingSpec`` already drops the name behind a barrier of its workers.
``TieringOffloadingSpec`` cannot: its scheduler-side manager maps the region
after the workers created it, so upstream leaves the name until the creating
worker's orderly cleanup, which a killed worker never reaches. The scheduler
side is the last to map (the engine builds its scheduler after the workers'
KV caches), so it drops the name once it has joined.

It also lets a later engine remove a name a crash left behind: every process
that opens a region holds a shared lock on it while it has it open (`hold`), so
a name nobody holds a lock on, older than a start-up takes to lock it, belongs to
an engine that died before the name could go (`remove_stale_regions`, run before
a region is made). Removing the name frees the memory, up to the whole
cpu_bytes_to_use, that the dead engine's file still held.

It never creates, maps or sizes a region, and never removes a name the calling
process created: a creator has no proof that anyone else has joined.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from vllm.logger import init_logger

logger = init_logger(__name__)


def release_name_after_last_join(path: str, *, creator: bool) -> bool:
    """Unlink the region's name from the last process to map it, if that process joined it.

    Returns whether the name was removed. A creator's own cleanup later finds the
    name gone, which is not an error.
    """
    if creator:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    logger.info("Unlinked shared offload region name %s: every process has mapped it", path)
    return True


REGION_DIR = Path("/dev/shm")
REGION_PATTERN = "vllm_offload_*.mmap"
# A region's maker locks it right after creating it; a name unchanged for this long and
# unlocked has no live maker.
STALE_AFTER_S = 60.0


def hold(fd: int) -> None:
    """Take the shared lock that marks an open region as in use (kept while `fd` is open)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def remove_stale_regions(directory: Path = REGION_DIR) -> list[Path]:
    """Remove offload region names no live process holds: a crash left them, with their
    memory. Never through a symbolic link, and only regular files of this user's."""
    from vllm.v1.hisparse.host_memory import remove_stale_names

    return remove_stale_names(
        directory, REGION_PATTERN, "a KV offload region left by an engine that died", STALE_AFTER_S
    )
