# SPDX-License-Identifier: Apache-2.0
"""One host pool per node, shared by its tensor-parallel ranks (host_memory + pool_placement).

Ranks are played by threads of this process with a real collective stand-in: each
`agree` call waits for every rank and returns whether all were ok, as the TP
group's gloo all-gather does in the engine.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm.v1.hisparse import host_memory
from vllm.v1.hisparse.host_memory import (
    STAGING_STALE_AFTER_S,
    HostPoolMemory,
    HostPoolMemoryError,
    PoolShare,
    remove_stale_pools,
)
from vllm.v1.hisparse.pool_placement import place_ranks

SHAPE = (2, 3, 64, 16)


class Agreement:
    """`agree` for `n` ranks: a barrier that also ANDs their votes."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.votes: list[bool] = []
        self.lock = threading.Lock()
        self.calls = 0

    def agree(self, ok: bool) -> bool:
        with self.lock:
            self.votes.append(ok)
        self.barrier.wait()
        result = all(self.votes)
        if self.barrier.wait() == 0:
            with self.lock:
                self.votes.clear()
                self.calls += 1
        self.barrier.wait()
        return result


@pytest.fixture
def shm_dir(tmp_path_factory):
    """A directory on /dev/shm, as the pool's own, removed afterwards."""
    path = Path("/dev/shm") / f"test-hisparse-{uuid.uuid4().hex}"
    path.mkdir()
    yield path
    for leftover in path.iterdir():
        leftover.unlink()
    path.rmdir()


def start_ranks(path: Path, n: int, shape=SHAPE, fail_rank: int | None = None) -> list:
    """Every rank's HostPoolMemory, or the exception it raised."""
    agreement = Agreement(n)

    def rank(r: int):
        if r == fail_rank:
            # A rank that fails before the pool (say its RAM check): it still takes part.
            assert not agreement.agree(False)
            return HostPoolMemoryError("rank failed")
        try:
            share = PoolShare(path, creator=r == 0, agree=agreement.agree)
            return HostPoolMemory(shape, torch.float32, register=False, share=share)
        except Exception as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(rank, range(n)))


def test_the_ranks_of_a_node_map_one_pool_and_its_name_is_gone_once_they_have(shm_dir):
    path = shm_dir / "vllm_hisparse_engine_dp0_n0.pool"
    memories = start_ranks(path, 3)
    assert all(isinstance(m, HostPoolMemory) and m.shared for m in memories), memories
    assert not path.exists(), "the name goes once every rank mapped the pool"
    assert [m.nbytes for m in memories] == [2 * 3 * 64 * 16 * 4] * 3
    memories[0].tensor[1, 2, 5].fill_(3.5)  # the writer's copy of a page ...
    for reader in memories[1:]:
        assert torch.equal(reader.tensor[1, 2, 5], torch.full((16,), 3.5)), "... is every rank's row"
        assert not reader.tensor[0].any()


def test_a_rank_that_fails_fails_them_all_without_a_wait_or_a_leftover(shm_dir):
    path = shm_dir / "vllm_hisparse_engine_dp0_n0.pool"
    for fail_rank in (0, 1):
        results = start_ranks(path, 2, fail_rank=fail_rank)
        assert all(isinstance(r, HostPoolMemoryError) for r in results), results
        assert not path.exists()
    assert not list(shm_dir.iterdir())


def test_shared_memory_too_small_for_the_pool_is_refused_naming_the_setting_and_the_fix(shm_dir, monkeypatch):
    monkeypatch.setattr(host_memory, "shared_memory_free_bytes", lambda directory: 1024)
    agreement = Agreement(1)
    share = PoolShare(shm_dir / "vllm_hisparse_e_dp0_n0.pool", creator=True, agree=agreement.agree)
    with pytest.raises(HostPoolMemoryError) as raised:
        HostPoolMemory(SHAPE, torch.float32, register=False, host_pool_gib=7.5, share=share)
    message = str(raised.value)
    assert "host_pool_gib=7.5" in message and "1024 bytes free" in message and "--shm-size" in message
    assert agreement.calls == 1, "it still took part in the agreement"
    assert not list(shm_dir.iterdir())


def test_ranks_that_disagree_on_the_shape_are_refused(shm_dir):
    path = shm_dir / "vllm_hisparse_engine_dp0_n0.pool"
    agreement = Agreement(2)

    def rank(r: int):
        shape = SHAPE if r == 0 else (2, 4, 64, 16)
        try:
            share = PoolShare(path, r == 0, agreement.agree)
            return HostPoolMemory(shape, torch.float32, register=False, share=share)
        except Exception as e:
            return e

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, range(2)))
    assert "disagree on its shape" in str(results[1])
    assert isinstance(results[0], HostPoolMemoryError)
    assert not path.exists()


def test_a_name_left_by_a_creator_that_died_is_stale_and_a_locked_one_is_not(shm_dir):
    stale = shm_dir / "vllm_hisparse_dead_dp0_n0.pool"
    stale.write_bytes(b"\0" * 4096)
    live = shm_dir / "vllm_hisparse_live_dp0_n0.pool"
    live.write_bytes(b"\0" * 4096)
    holder = os.open(live, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_SH)  # as a creator holds it until the name goes
    try:
        assert remove_stale_pools(shm_dir) == [stale]
        assert live.exists() and not stale.exists()
        # A creator clears stale names of its directory before making its own.
        stale.write_bytes(b"\0" * 4096)
        memories = start_ranks(shm_dir / "vllm_hisparse_new_dp0_n0.pool", 2)
        assert all(isinstance(m, HostPoolMemory) for m in memories)
        assert sorted(p.name for p in shm_dir.iterdir()) == [live.name]
    finally:
        os.close(holder)


def test_a_creator_reserving_pages_shows_no_name_until_the_pool_is_locked_and_whole(shm_dir, monkeypatch):
    """Reserving the pool's pages is the longest step of making it, where a kill -9 is most
    likely: while it runs, nothing of the pool has a name in the directory (so a killed
    creator leaves nothing), and the file it reserves is already locked."""
    seen: list[list[str]] = []
    fallocate = os.posix_fallocate

    def look_then_fallocate(fd, offset, length):
        seen.append(sorted(p.name for p in shm_dir.iterdir()))
        with pytest.raises(BlockingIOError):
            fcntl.flock(os.open(f"/proc/self/fd/{fd}", os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", look_then_fallocate)
    memories = start_ranks(shm_dir / "vllm_hisparse_tmp_dp0_n0.pool", 2)
    assert all(isinstance(m, HostPoolMemory) for m in memories), memories
    assert seen == [[]], "no name (staging or pool) while the pages are reserved"
    assert list(shm_dir.iterdir()) == []


def test_where_o_tmpfile_is_missing_a_dead_creators_staging_name_is_removed_once_a_minute_old(shm_dir):
    dead = shm_dir / ".vllm_hisparse_dead_dp0_n0.pool.4242.tmp"
    dead.write_bytes(b"\0" * 4096)
    young = shm_dir / ".vllm_hisparse_young_dp0_n0.pool.4343.tmp"
    young.write_bytes(b"\0" * 4096)  # just made: its creator may not have locked it yet
    live = shm_dir / ".vllm_hisparse_live_dp0_n0.pool.4444.tmp"
    live.write_bytes(b"\0" * 4096)
    old = time.time() - 2 * STAGING_STALE_AFTER_S
    os.utime(dead, (old, old))
    os.utime(live, (old, old))
    holder = os.open(live, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        assert remove_stale_pools(shm_dir) == [dead]
        assert live.exists() and young.exists()
    finally:
        os.close(holder)


@pytest.mark.parametrize(
    ("nodes", "rank", "expected"),
    [
        (["a", "a"], 1, ((0, 1), 0, 1)),
        (["a", "b"], 1, ((1,), 1, 2)),
        (["a", "b", "a", "b"], 3, ((1, 3), 1, 2)),
        (["b", "b", "a", "a"], 2, ((2, 3), 1, 2)),
    ],
)
def test_ranks_are_placed_by_the_node_they_run_on(nodes, rank, expected):
    assert place_ranks(nodes, rank) == expected


def test_the_sweep_never_follows_a_link_nor_removes_what_is_not_a_pool_of_this_user(shm_dir, tmp_path):
    # A name of the pool's pattern that is a symbolic link (to a file the sweep must never
    # open for writing or remove), and one that is a directory: both stay, as does the target.
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    link = shm_dir / "vllm_hisparse_link_dp0_n0.pool"
    link.symlink_to(target)
    folder = shm_dir / "vllm_hisparse_dir_dp0_n0.pool"
    folder.mkdir()
    try:
        assert remove_stale_pools(shm_dir) == []
        assert link.is_symlink() and target.read_bytes() == b"keep" and folder.is_dir()
    finally:
        folder.rmdir()


def test_a_pools_name_is_locked_before_it_is_visible(shm_dir, monkeypatch):
    # A peer sweeps at the worst moment: just before the creator takes its lock on the file
    # it made. The sweep must find the rendezvous name absent or locked, never stale; the
    # pool is made, and the staging name it was made under is gone.
    path = shm_dir / "vllm_hisparse_race_dp0_n0.pool"
    swept: list[list[Path]] = []
    flock = fcntl.flock

    def sweep_then_flock(fd, operation):
        if operation == fcntl.LOCK_SH and not swept:  # the creator's lock
            monkeypatch.setattr(fcntl, "flock", flock)  # the sweep's own locks run as usual
            swept.append(remove_stale_pools(shm_dir))
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", sweep_then_flock)
    memories = start_ranks(path, 2)
    assert all(isinstance(m, HostPoolMemory) for m in memories), memories
    assert swept == [[]], "nothing the creator was making looked stale"
    assert list(shm_dir.iterdir()) == []


def test_a_creator_refused_for_a_taken_name_leaves_that_name_alone(shm_dir):
    # Another engine with the same id is starting: its name stays (a failed creator removes
    # only what it made).
    path = shm_dir / "vllm_hisparse_same_dp0_n0.pool"
    path.write_bytes(b"\0" * 4096)
    holder = os.open(path, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        results = start_ranks(path, 2)
        assert isinstance(results[0], HostPoolMemoryError) and "same id" in str(results[0])
        assert path.exists(), "the other engine's name stays"
        assert sorted(p.name for p in shm_dir.iterdir()) == [path.name]
    finally:
        os.close(holder)


def test_a_stale_pool_is_removed_before_the_ram_check_it_would_fail(shm_dir, monkeypatch):
    # A pool a crash left behind holds RAM; the next start removes it before checking RAM,
    # so a check that fails still leaves the node clean for the start after.
    stale = shm_dir / "vllm_hisparse_dead_dp0_n0.pool"
    stale.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda *args: 0)
    results = start_ranks(shm_dir / "vllm_hisparse_next_dp0_n0.pool", 2)
    assert isinstance(results[0], HostPoolMemoryError) and "are available" in str(results[0])
    assert not stale.exists()


@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_creator_whose_collective_fails_leaves_no_name_behind(shm_dir, failing_call):
    """The collective itself can fail (another rank died while the creator reserved
    hundreds of GiB, or the start-up was interrupted): the creator's named pool stayed in
    /dev/shm at full size until another engine with a shared pool started on the node."""
    path = shm_dir / "vllm_hisparse_engine_dp0_n0.pool"
    calls = []

    def agree(ok: bool) -> bool:
        calls.append(ok)
        if len(calls) == failing_call:
            raise RuntimeError("Connection closed by peer")
        return ok

    with pytest.raises(RuntimeError, match="closed by peer"):
        HostPoolMemory(SHAPE, torch.float32, register=False, share=PoolShare(path, creator=True, agree=agree))
    assert not list(shm_dir.iterdir())


def test_a_private_pool_also_sweeps_the_pools_a_crash_left(shm_dir, monkeypatch):
    """A pool a crash left holds its size of /dev/shm; an engine whose pool is its own
    (one rank a node) sweeps them as a shared pool's creator does."""
    stale = shm_dir / "vllm_hisparse_dead_dp0_n0.pool"
    stale.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(host_memory, "SHARED_POOL_DIR", shm_dir)
    memory = HostPoolMemory(SHAPE, torch.float32, register=False)
    assert not memory.shared and not stale.exists()


def test_a_nodes_ranks_name_its_pool_by_its_writers_engine_key_whatever_their_own(monkeypatch):
    """Each rank names the node's pool from its own config's instance id, which is one
    only where the configs were pickled from one process: with torchrun's external
    launcher each rank builds its own, the creator and the readers computed different
    names, and start-up failed. The ranks exchange their keys with their nodes, and use
    their node writer's."""
    import torch.distributed as dist

    from vllm.distributed import parallel_state
    from vllm.v1.hisparse import pool_placement

    gathered = [("kernel-a", "key-of-rank-0"), ("kernel-a", "key-of-rank-1"), ("kernel-b", "key-of-rank-2")]

    def all_gather_object(out, mine, group=None):
        out[:] = gathered if isinstance(mine, tuple) else [True] * len(out)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    paths = {}
    for rank in range(3):
        group = SimpleNamespace(world_size=3, rank_in_group=rank, cpu_group=None)
        monkeypatch.setattr(parallel_state, "get_tp_group", lambda group=group: group)
        config = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=3, data_parallel_rank=0),
            instance_id=gathered[rank][1],
        )
        placement = pool_placement.pool_placement(config)
        paths[rank] = placement.share.path
    assert paths[0] == paths[1] == host_memory.shared_pool_path("key-of-rank-0", 0, 0)
    assert paths[2] is None, "a node of one rank has a private pool"


def test_a_node_is_a_kernel_and_its_shared_memory(monkeypatch, tmp_path):
    from vllm.v1.hisparse import pool_placement

    first = pool_placement.node_id()
    monkeypatch.setattr(pool_placement, "SHARED_POOL_DIR", tmp_path)
    assert (os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev) == (pool_placement.node_id() == first)
