# SPDX-License-Identifier: Apache-2.0
"""The host pool's memory: exactly the configured bytes in one mapping, checked against available RAM."""

from __future__ import annotations

import mmap

import pytest
import torch

from vllm.v1.hisparse.host_memory import HostPoolMemory, HostPoolMemoryError, available_host_bytes


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5, 64, 656), torch.uint8), ((2, 7, 64, 576), torch.bfloat16), ((1, 3, 64, 3), torch.float32)],
)
def test_the_pool_is_one_mapping_of_exactly_its_bytes(shape, dtype):
    memory = HostPoolMemory(shape, dtype, register=False)
    pool = memory.tensor
    wanted = pool.numel() * pool.element_size()
    assert tuple(pool.shape) == shape and pool.dtype == dtype and pool.is_contiguous()
    assert memory.nbytes == wanted
    assert len(memory._mapping) == wanted, "no rounding up (a power of two would be larger)"
    assert isinstance(memory._mapping, mmap.mmap)
    assert not memory.registered and not pool.any(), "anonymous memory starts zeroed"
    pool[-1, -1, -1, -1] = 1
    last = memory._mapping[wanted - pool.element_size() :]
    assert last.count(0) < pool.element_size(), "the tensor is the mapping"


def test_a_pool_larger_than_available_ram_fails_naming_the_setting_and_both_sizes():
    available = available_host_bytes()
    pages = available // (64 * 656) + 1024
    with pytest.raises(HostPoolMemoryError) as raised:
        HostPoolMemory((1, pages, 64, 656), torch.uint8, register=False, host_pool_gib=123.5)
    message = str(raised.value)
    assert "host_pool_gib=123.5" in message
    assert str(pages * 64 * 656) in message
    assert "are available" in message


def test_available_ram_is_a_plausible_figure():
    assert 0 < available_host_bytes() < 1 << 50


@pytest.mark.gpu
def test_on_cuda_the_mapping_is_registered_and_pinned_for_the_kernels():
    memory = HostPoolMemory((2, 3, 64, 656), torch.uint8, register=True)
    assert memory.registered and memory.tensor.is_pinned()
    device = torch.arange(64 * 656, dtype=torch.int32).to(torch.uint8).reshape(64, 656).cuda()
    memory.tensor[1, 2].copy_(device)
    assert torch.equal(memory.tensor[1, 2].cuda(), device)
    memory.release()
    assert not memory.registered


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_ram_check_honours_the_tightest_cgroup_v2_limit_up_the_tree(tmp_path):
    from vllm.v1.hisparse.host_memory import cgroup_memory_headroom

    root = tmp_path / "cgroup"
    _tree(
        root,
        {
            "ctr/job/memory.max": "1000000\n",
            "ctr/job/memory.current": "300000\n",
            "ctr/memory.max": "500000\n",
            "ctr/memory.current": "450000\n",
            "memory.max": "max\n",
            "memory.current": "7\n",
        },
    )
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/ctr/job\n")
    assert cgroup_memory_headroom(root, proc) == 50000, "the parent's 50 KB is the tighter room"
    assert available_host_bytes(root, proc) == 50000
    proc.write_text("0::/\n")
    assert cgroup_memory_headroom(root, proc) is None, "no limit at the root"


def test_the_ram_check_honours_a_cgroup_v1_memory_limit(tmp_path):
    from vllm.v1.hisparse.host_memory import cgroup_memory_headroom

    root = tmp_path / "cgroup"
    _tree(
        root,
        {
            "memory/box/memory.limit_in_bytes": "2000000\n",
            "memory/box/memory.usage_in_bytes": "500000\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "9\n",
        },
    )
    proc = tmp_path / "cgroup.txt"
    proc.write_text("9:name=systemd:/\n4:memory:/box\n0::/\n")
    assert cgroup_memory_headroom(root, proc) == 1500000


POOL_IN_A_CGROUP = """
import os, sys, torch
from vllm.v1.hisparse.host_memory import HostPoolMemory, HostPoolMemoryError
with open(sys.argv[1], "w") as procs:  # into the limited cgroup, after the imports
    procs.write(str(os.getpid()))
try:
    memory = HostPoolMemory((1, 12800, 64, 656), torch.uint8, register=False, host_pool_gib=0.5)
except HostPoolMemoryError as error:
    print(error)
    sys.exit(3)
memory.tensor.fill_(1)  # touches every page: past the limit, the kernel kills it here
print("mapped")
"""


def test_a_pool_larger_than_its_containers_memory_limit_is_refused_not_oom_killed(tmp_path):
    # A real memory cgroup (v1 or v2) limited to 256 MiB; the 512 MiB pool is refused with
    # the start-up message instead of an OOM kill. Skips where cgroups cannot be created.
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    group = None
    for base, limit in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
    ):
        candidate = base / f"hisparse-test-{uuid.uuid4().hex[:8]}"
        try:
            candidate.mkdir()
            (candidate / limit).write_text(str(256 << 20))
        except OSError:
            if candidate.exists():
                candidate.rmdir()
            continue
        group = candidate
        break
    if group is None:
        pytest.skip("this machine does not let the test create a memory cgroup (needs root and cgroupfs)")
    try:
        done = subprocess.run(
            [sys.executable, "-c", POOL_IN_A_CGROUP, str(group / "cgroup.procs")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        group.rmdir()
    assert done.returncode == 3, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "host_pool_gib=0.5" in done.stdout and "are available" in done.stdout


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None, "the mapping is in smaps"
    return flags


def test_the_pool_stays_out_of_core_dumps():
    # It holds every user's prompt KV: a core dump must not carry it.
    memory = HostPoolMemory((1, 64, 64, 656), torch.uint8, register=False)
    flags = _vm_flags(memory.tensor.data_ptr())
    assert "dd" in flags and memory.advice == ("dontdump",)
