# SPDX-License-Identifier: Apache-2.0
"""The CUDA batched page copy: compiles for sm_90a here; matches the torch reference bit for bit on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_build import compile_for_sm90a, hisparse_ops

from vllm.v1.hisparse.page_copy import copy_pages


def test_page_copy_kernel_compiles_for_sm90a(tmp_path):
    compile_for_sm90a("hisparse_page_copy.cu", tmp_path)


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    return hisparse_ops(tmp_path_factory.mktemp("jit"))


def _case(seed: int, dtype: torch.dtype, device: str):
    """Block-outermost caches (each block strides past every layer, plus padding) and a pool."""
    gen = torch.Generator().manual_seed(seed)
    layers, blocks, host_pages, block, width = 1 + seed % 4, 6 + seed % 5, 5, 64, 576 + 80 * (seed % 2)
    storage = torch.randint(0, 120, (blocks, layers + 1, block, width), generator=gen).to(dtype)
    host = torch.randint(0, 120, (layers, host_pages, block, width), generator=gen).to(dtype)
    n = 1 + seed % host_pages
    pages = torch.randperm(host_pages, generator=gen)[:n]
    block_ids = torch.stack([torch.randperm(blocks, generator=gen)[:n] for _ in range(layers)], dim=1)
    storage = storage.to(device)
    host = host.pin_memory() if device == "cuda" else host
    return [storage[:, layer] for layer in range(layers)], storage, host, block_ids, pages


@pytest.mark.gpu
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
def test_kernel_matches_the_reference_bit_for_bit(kernel_ops, to_host, dtype):
    assert hasattr(kernel_ops, "copy_pages")
    for seed in range(12):
        ref_caches, ref_storage, ref_host, block_ids, pages = _case(seed, dtype, "cpu")
        copy_pages(ref_caches, ref_host, block_ids, pages, to_host)  # CPU tensors: the reference
        caches, storage, host, block_ids, pages = _case(seed, dtype, "cuda")
        copy_pages(caches, host, block_ids, pages, to_host, use_kernel=True)  # one launch
        torch.cuda.synchronize()
        assert torch.equal(storage.cpu(), ref_storage)
        assert torch.equal(host, ref_host)
