# SPDX-License-Identifier: Apache-2.0
"""The tiering offload region's name is gone once its last process has mapped it.

Patch 0012: the workers create /dev/shm/vllm_offload_<engine id>.mmap, the
scheduler side joins it last and drops the name, so a worker killed later leaves
nothing in /dev/shm. Played in one process with upstream's SharedOffloadRegion.
"""

from __future__ import annotations

import logging
import mmap
import uuid
from pathlib import Path

import numpy as np
import pytest

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

PAGE = mmap.PAGESIZE
BLOCKS = 4


def region(engine_id: str, rank: int | None) -> SharedOffloadRegion:
    return SharedOffloadRegion(
        engine_id=engine_id, num_blocks=BLOCKS, rank=rank, kv_bytes_per_block=2 * PAGE, cpu_page_size=PAGE
    )


@pytest.fixture
def engine_id():
    engine_id = f"test-region-{uuid.uuid4().hex}"
    yield engine_id
    Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)


def test_the_scheduler_side_drops_the_name_the_workers_created_and_the_memory_stays_shared(engine_id):
    path = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    workers = [region(engine_id, rank) for rank in (0, 1)]
    assert path.exists(), "the workers' rendezvous name exists until the scheduler side joins"
    scheduler = region(engine_id, None)
    assert not path.exists(), "the last process to map the region dropped its name"
    # Every mapping is still the same memory: a worker's write is what the scheduler reads.
    view = workers[1].create_next_worker_view(PAGE)
    view[2].fill_(7)
    rows = np.asarray(scheduler.create_kv_memoryview())
    assert rows[2, PAGE : PAGE + 4].tolist() == [7] * 4 and not rows[1].any()
    for r in (scheduler, *workers):
        r.cleanup()


def test_a_creator_finding_its_name_released_cleans_up_without_a_warning(engine_id, caplog):
    worker = region(engine_id, 0)
    scheduler = region(engine_id, None)
    with caplog.at_level(logging.WARNING):
        scheduler.cleanup()
        worker.cleanup()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_scheduler_side_that_created_the_region_keeps_its_name(engine_id):
    """Only a joiner knows another process mapped the file first; a creator keeps the name
    for the workers still to come, and removes it at cleanup as upstream does."""
    path = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    scheduler = region(engine_id, None)
    assert path.exists()
    worker = region(engine_id, 0)
    worker.cleanup()
    scheduler.cleanup()
    assert not path.exists()


# -- names a crash left behind ------------------------------------------------------


def _age(path: Path, seconds: float) -> None:
    import os
    import time

    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_region_a_crash_left_is_removed_before_the_next_one_is_made(engine_id, tmp_path):
    from vllm.v1.kv_offload.cpu import region_lifetime

    stale = Path(f"/dev/shm/vllm_offload_{engine_id}-dead.mmap")
    stale.write_bytes(b"\0" * PAGE)  # the memory of an engine killed before the name went
    _age(stale, 2 * region_lifetime.STALE_AFTER_S)
    try:
        worker = region(engine_id, 0)  # another engine starts: its region sweeps first
        assert not stale.exists(), "the stale region's name (and so its memory) was removed"
        # The live region, old and unlocked by nobody, is held: a sweep leaves it.
        live = Path(worker.mmap_path)
        _age(live, 2 * region_lifetime.STALE_AFTER_S)
        assert live not in region_lifetime.remove_stale_regions()
        assert live.exists(), "a region a live process holds open is never swept"
        worker.cleanup()
    finally:
        stale.unlink(missing_ok=True)


def test_a_sweep_leaves_young_names_links_and_other_files_alone(tmp_path):
    import os

    from vllm.v1.hisparse.host_memory import remove_stale_names
    from vllm.v1.kv_offload.cpu import region_lifetime

    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    link = tmp_path / "vllm_offload_link.mmap"
    os.symlink(target, link)
    _age(link, 1000)
    young = tmp_path / "vllm_offload_young.mmap"
    young.write_bytes(b"\0")  # made just now: its maker may not have locked it yet
    old = tmp_path / "vllm_offload_old.mmap"
    old.write_bytes(b"\0")
    _age(old, 1000)
    directory = tmp_path / "vllm_offload_dir.mmap"
    directory.mkdir()
    _age(directory, 1000)
    pattern, age = region_lifetime.REGION_PATTERN, region_lifetime.STALE_AFTER_S
    assert remove_stale_names(tmp_path, pattern, "test", age) == [old]
    assert link.is_symlink() and target.read_bytes() == b"keep" and young.exists() and directory.is_dir()
