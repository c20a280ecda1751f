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
    last = memory._mapping[wanted - pool.element_size():]
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
