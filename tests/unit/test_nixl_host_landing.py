"""The descriptors NixlConnector's host landing reads with: layers located in the
registered regions, and each landed page of each layer read from the remote block
that holds it into its host page.

The descriptors are carried out here byte for byte (ctypes.memmove from each
remote descriptor to its local one), over two KV cache layouts: one packed region
whose block row holds every layer's page (DSA groups in a block-outermost layout),
and one region per layer. The host pages must then hold exactly the remote rows.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
    NULL_BLOCK_ID,
    RegionLayout,
    check_remote_layout,
    landing_descriptors,
    locate_layers,
    names_null_block,
)

NUM_BLOCKS, BLOCK, WIDTH = 12, 4, 6
LAYERS = {"layers.0.attn": 0, "layers.1.attn": 1}  # one layer per sparse-MLA group


def packed_cache(seed: int) -> tuple[dict[str, torch.Tensor], RegionLayout]:
    """One region: each block row holds both layers' pages, then an indexer page."""
    generator = torch.Generator().manual_seed(seed)
    storage = torch.randn(NUM_BLOCKS, 3, BLOCK, WIDTH, generator=generator)
    caches = {name: storage[:, i] for i, name in enumerate(LAYERS)}
    row = storage[0].numel() * storage.element_size()
    return caches, RegionLayout((storage.data_ptr(),), (row,), (row,))


def per_layer_cache(seed: int) -> tuple[dict[str, torch.Tensor], RegionLayout]:
    generator = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(NUM_BLOCKS, 1, BLOCK, WIDTH, generator=generator) for name in LAYERS}
    page = BLOCK * WIDTH * 4
    bases = tuple(cache.data_ptr() for cache in caches.values())
    return caches, RegionLayout(bases, (page,) * len(bases), (page,) * len(bases))


def carry_out(local: np.ndarray, remote: np.ndarray) -> None:
    assert local.shape == remote.shape and (local[:, 1] == remote[:, 1]).all()
    for (dst, length, _), (src, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        ctypes.memmove(dst, src, length)


@pytest.mark.parametrize("layout", [packed_cache, per_layer_cache])
def test_landed_pages_hold_the_remote_blocks_rows(layout):
    local_caches, local_regions = layout(0)
    remote_caches, remote_regions = layout(1)
    layers = locate_layers(local_caches, LAYERS, local_regions)
    assert [layer.group for layer in layers] == [0, 1]
    check_remote_layout(local_regions, remote_regions)
    host = torch.zeros(len(LAYERS), 5, BLOCK, WIDTH)
    host_pages = {name: host[i] for i, name in enumerate(LAYERS)}
    # The remote request's blocks per group; pages 0 and 2 land in host pages 4 and 1.
    remote_blocks = [[7, 3, 9, 2], [5, 11, 8, 6]]
    landing = {0: 4, 2: 1}
    local, remote = landing_descriptors(layers, landing, remote_blocks, remote_regions, host_pages)
    assert len(local) == len(LAYERS) * len(landing)
    carry_out(local, remote)
    for i, (name, group) in enumerate(LAYERS.items()):
        remote_pages = remote_caches[name].reshape(NUM_BLOCKS, BLOCK, WIDTH)
        for page, host_page in landing.items():
            assert torch.equal(host[i, host_page], remote_pages[remote_blocks[group][page]])
        untouched = [p for p in range(5) if p not in landing.values()]
        assert not host[i, untouched].any(), "no other host page is written"


def test_a_layer_outside_every_region_is_refused():
    caches, regions = per_layer_cache(0)
    elsewhere = RegionLayout(regions.bases[:1], regions.strides[:1], regions.lengths[:1])
    with pytest.raises(ValueError, match="layers.1.attn"):
        locate_layers(caches, LAYERS, elsewhere)


def test_a_remote_laid_out_otherwise_is_refused():
    _, local = packed_cache(0)
    _, remote = per_layer_cache(1)
    with pytest.raises(ValueError, match="same model"):
        check_remote_layout(local, remote)


def test_a_landed_page_without_a_remote_device_block_is_refused():
    caches, regions = packed_cache(0)
    layers = locate_layers(caches, LAYERS, regions)
    host = torch.zeros(len(LAYERS), 2, BLOCK, WIDTH)
    host_pages = {name: host[i] for i, name in enumerate(LAYERS)}
    with pytest.raises(ValueError, match="no device block"):
        landing_descriptors(layers, {1: 0}, [[3, NULL_BLOCK_ID], [4, 5]], regions, host_pages)
    with pytest.raises(ValueError, match="has 2 blocks"):
        landing_descriptors(layers, {2: 0}, [[3, 4], [4, 5]], regions, host_pages)


def test_the_null_block_is_named_only_in_the_groups_asked_about():
    blocks = ([1, 2], [NULL_BLOCK_ID, 3], [4, 5])
    assert names_null_block(blocks, (0, 1))
    assert not names_null_block(blocks, (0, 2))
