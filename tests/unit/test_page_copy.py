# SPDX-License-Identifier: Apache-2.0
"""The batched page copy's torch reference against a page-by-page model of its contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.hisparse.page_copy import PageCopyError, copy_pages

BLOCK, WIDTH = 4, 6


def block_strided_caches(num_layers: int, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Layer views into one allocation whose blocks stride past every layer (block-outermost)."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(num_blocks, num_layers + 1, BLOCK, WIDTH, generator=gen)
    return [storage[:, layer] for layer in range(num_layers)]


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    num_blocks=st.integers(2, 9),
    num_host=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    to_host=st.booleans(),
    data=st.data(),
)
def test_every_page_of_every_layer_lands_where_the_contract_says(
    num_layers, num_blocks, num_host, seed, to_host, data
):
    caches = block_strided_caches(num_layers, num_blocks, seed)
    host = torch.randn(num_layers, num_host, BLOCK, WIDTH, generator=torch.Generator().manual_seed(seed + 1))
    n = data.draw(st.integers(0, min(num_host, num_blocks)))
    host_pages = data.draw(st.permutations(range(num_host)))[:n]
    # Distinct blocks per layer, so a restore writes each block once (order-free).
    per_layer = [data.draw(st.permutations(range(num_blocks)))[:n] for _ in range(num_layers)]
    rows = [[per_layer[layer][i] for layer in range(num_layers)] for i in range(n)]
    expected_caches = [c.clone() for c in caches]
    expected_host = host.clone()
    for page, blocks in zip(host_pages, rows, strict=True):
        for layer, block in enumerate(blocks):
            if to_host:
                expected_host[layer, page] = caches[layer][block]
            else:
                expected_caches[layer][block] = host[layer, page]
    copy_pages(
        caches,
        host,
        torch.tensor(rows, dtype=torch.int64).reshape(len(host_pages), num_layers),
        torch.tensor(host_pages, dtype=torch.int64),
        to_host,
    )
    assert torch.equal(host, expected_host)
    for layer in range(num_layers):
        assert torch.equal(caches[layer], expected_caches[layer])


def test_a_restore_writes_through_the_strided_view_into_the_shared_allocation():
    storage = torch.zeros(3, 2, BLOCK, WIDTH)
    caches = [storage[:, 0], storage[:, 1]]
    host = torch.arange(2 * 1 * BLOCK * WIDTH, dtype=torch.float32).reshape(2, 1, BLOCK, WIDTH)
    copy_pages(caches, host, torch.tensor([[2, 1]]), torch.tensor([0]), to_host=False)
    assert torch.equal(storage[2, 0], host[0, 0]) and torch.equal(storage[1, 1], host[1, 0])
    assert storage[0].abs().sum() == 0 and storage[2, 1].abs().sum() == 0 and storage[1, 0].abs().sum() == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, h, b, p: (c[:1], h, b, p), "KV caches for a host pool of 2 layers"),
        (lambda c, h, b, p: (c, torch.zeros(2, 2, BLOCK - 1, WIDTH), b, p), "pages must be"),
        (lambda c, h, b, p: (c, h[:, :, :2], b, p), "must be a contiguous"),
        (lambda c, h, b, p: (c, h.double(), b, p), "the host pool torch.float64"),
        (lambda c, h, b, p: (c, h, b[:, :1], p), "block_ids must be"),
        (lambda c, h, b, p: (c, h, b.float(), p), "block_ids must be"),
        (lambda c, h, b, p: (c, h, b, p[:0]), "host_pages must be"),
        (lambda c, h, b, p: ([x.transpose(1, 2) for x in c], h, b, p), "pages must be"),
    ],
)
def test_bad_arguments_are_refused_with_what_was_wrong(change, message):
    caches = block_strided_caches(2, 3, 0)
    host = torch.zeros(2, 2, BLOCK, WIDTH)
    args = change(caches, host, torch.tensor([[0, 1]]), torch.tensor([1]))
    with pytest.raises(ValueError, match=message):
        copy_pages(*args, to_host=True)


@pytest.mark.parametrize(
    ("block_ids", "host_pages", "to_host", "message"),
    [
        ([[3, 0]], [1], True, "a block of layer 0 is outside"),
        ([[0, -1]], [1], False, "a block of layer 1 is outside"),
        ([[0, 1]], [2], True, "a host page is outside"),
        ([[0, 1]], [-1], False, "a host page is outside"),
        ([[0, 1], [2, 2]], [1, 1], True, "a host page is the destination of two pages"),
        ([[0, 1], [0, 2]], [0, 1], False, "a block of layer 0 is the destination of two pages"),
    ],
)
def test_out_of_bounds_and_duplicate_destinations_are_refused_before_anything_is_written(
    block_ids, host_pages, to_host, message
):
    caches = block_strided_caches(2, 3, 0)
    host = torch.randn(2, 2, BLOCK, WIDTH)
    before = [c.clone() for c in caches], host.clone()
    with pytest.raises(PageCopyError, match=message):
        copy_pages(caches, host, torch.tensor(block_ids), torch.tensor(host_pages), to_host)
    assert all(torch.equal(c, b) for c, b in zip(caches, before[0], strict=True))
    assert torch.equal(host, before[1])


def test_one_host_page_may_be_the_source_of_several_restores():
    caches = block_strided_caches(1, 3, 0)
    host = torch.randn(1, 2, BLOCK, WIDTH)
    copy_pages(caches, host, torch.tensor([[0], [2]]), torch.tensor([1, 1]), to_host=False)
    assert torch.equal(caches[0][0], host[0, 1]) and torch.equal(caches[0][2], host[0, 1])


def test_device_index_tensors_are_refused():
    caches = block_strided_caches(1, 3, 0)
    host = torch.randn(1, 2, BLOCK, WIDTH)
    with pytest.raises(ValueError, match="must be host tensors"):
        copy_pages(caches, host, torch.tensor([[0]], device="meta"), torch.tensor([1]), to_host=True)
