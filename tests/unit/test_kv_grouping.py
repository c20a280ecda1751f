# SPDX-License-Identifier: Apache-2.0
"""How HiSparse splits a DSA model's KV cache into groups."""

from __future__ import annotations

import math

import pytest

from vllm.config.hisparse import FP8_SPARSE_MLA_BYTES_PER_TOKEN, SPARSE_MLA_PAGE_TOKENS
from vllm.v1.hisparse.capacity import planner
from vllm.v1.hisparse.kv_grouping import (
    choose_mla_group_count,
    choose_resident_block_multiple,
    page_layout_capacity,
    relative_capacity,
)

# GLM-5 / DeepSeek-V3.2 sizes: 61 layers, bf16 latent 576 x 64 tokens per page,
# indexer 132 bytes x 64 tokens per page and layer.
REAL_LAYERS, REAL_MLA_PAGE, REAL_INDEXER_PAGE = 61, 576 * 2 * 64, 132 * 64
REAL_INDEXER = REAL_LAYERS * REAL_INDEXER_PAGE


def test_the_released_models_keep_almost_all_capacity():
    k = choose_mla_group_count(REAL_LAYERS, REAL_MLA_PAGE, REAL_INDEXER)
    assert k == 9
    assert relative_capacity(k, REAL_LAYERS, REAL_MLA_PAGE, REAL_INDEXER) == pytest.approx(0.971, abs=1e-3)
    naive = relative_capacity(1, REAL_LAYERS, REAL_MLA_PAGE, REAL_INDEXER)
    assert naive == pytest.approx(0.557, abs=1e-3), "one sparse-MLA group wastes most of the indexer's share"


def test_an_mtp_drafter_in_the_resident_group_costs_little_capacity():
    # Its sparse-MLA layer and its indexer join the indexer layers: no extra block per page.
    resident = REAL_INDEXER + REAL_MLA_PAGE + REAL_INDEXER_PAGE
    k = choose_mla_group_count(REAL_LAYERS, REAL_MLA_PAGE, resident)
    assert k == 7, "the sparse-MLA groups widen to stay at least as wide as the resident group"
    assert relative_capacity(k, REAL_LAYERS, REAL_MLA_PAGE, resident) == pytest.approx(0.960, abs=1e-3)


def test_sparse_mla_layers_too_narrow_for_the_resident_group_are_refused():
    with pytest.raises(ValueError, match="cannot be grouped at least as wide as the resident group"):
        choose_mla_group_count(1, REAL_MLA_PAGE, REAL_MLA_PAGE + 2 * REAL_INDEXER_PAGE)


# (layers, resident group width): indexer layers alone, or with an MTP drafter's two layers;
# one target layer with a drafter is left out: it cannot be grouped (refused, tested above).
GROUPABLE = [
    (layers, layers * page + drafter * (REAL_MLA_PAGE + page))
    for layers in (1, 2, 3, 7, 30, 61, 78)
    for page in (132 * 64, 68 * 64)
    for drafter in (0, 1)
    if (layers, drafter) != (1, 1)
]


@pytest.mark.parametrize(("layers", "resident"), GROUPABLE)
def test_the_choice_is_the_best_one_that_keeps_latent_rows_whole(layers, resident):
    k = choose_mla_group_count(layers, REAL_MLA_PAGE, resident)
    assert math.ceil(layers / k) * REAL_MLA_PAGE >= resident, "sparse-MLA groups are the widest"
    for other in range(1, layers + 1):
        if math.ceil(layers / other) * REAL_MLA_PAGE >= resident:
            assert relative_capacity(other, layers, REAL_MLA_PAGE, resident) <= relative_capacity(
                k, layers, REAL_MLA_PAGE, resident
            )


# ----------------------------------------------------------------------------- the page layout


def glm53_widths() -> tuple[int, int, int]:
    """GLM-5.3's sparse-MLA layers, and the page widths of all of them and of the resident
    group (its indexer layers plus the MTP layer's latent and indexer), fp8 KV."""
    config = planner.glm53_preset_config()
    layers = config["num_hidden_layers"]
    hf = type("HF", (), config)
    indexers = sum(planner.layer_has_indexer(hf, i) for i in range(layers))
    latent = FP8_SPARSE_MLA_BYTES_PER_TOKEN * SPARSE_MLA_PAGE_TOKENS
    indexer = 132 * SPARSE_MLA_PAGE_TOKENS  # fp8 keys and one float32 scale per 128 values
    return layers, layers * latent, (indexers + 1) * indexer + latent


def test_the_page_layout_keeps_more_capacity_than_the_groups_for_glm_5_3():
    layers, mla_width, resident_width = glm53_widths()
    m = choose_resident_block_multiple(mla_width, resident_width)
    assert m == 14, "a resident block holds 14 pages of the indexer and MTP layers"
    assert m * resident_width <= mla_width < (m + 1) * resident_width
    page = page_layout_capacity(m, mla_width, resident_width)
    k = choose_mla_group_count(layers, mla_width // layers, resident_width)
    assert page == pytest.approx(0.998, abs=1e-3)
    assert page > relative_capacity(k, layers, mla_width // layers, resident_width)


@pytest.mark.parametrize(("layers", "resident"), GROUPABLE)
def test_the_page_layouts_multiple_is_the_best_and_the_finest_of_equals(layers, resident):
    mla_width = layers * REAL_MLA_PAGE
    m = choose_resident_block_multiple(mla_width, resident)
    best = page_layout_capacity(m, mla_width, resident)
    for other in range(1, 4 * m + 4):
        capacity = page_layout_capacity(other, mla_width, resident)
        assert capacity <= best
        if other < m:
            assert capacity < best, "a finer resident block with the same capacity is chosen"
    if mla_width >= 8 * resident:
        assert best > 0.95, "a wide sparse-MLA group wastes little"


def test_a_resident_group_wider_than_the_sparse_mla_one_gets_one_page_blocks():
    assert choose_resident_block_multiple(REAL_MLA_PAGE, 3 * REAL_MLA_PAGE) == 1
    assert page_layout_capacity(1, REAL_MLA_PAGE, 3 * REAL_MLA_PAGE) == pytest.approx(4 / 6)


def glm53_page_layout_groups() -> list:
    """GLM-5.3's page layout at fp8: 78 sparse-MLA layers of 656-byte rows, and a resident
    group of 14-page blocks of its indexer layers (132-byte rows) and its MTP layer."""
    import dataclasses

    import torch

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    layers, mla_width, resident_width = glm53_widths()
    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype=torch.uint8)
    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
    num_indexers = (resident_width - latent.page_size_bytes) // indexer.page_size_bytes
    m = choose_resident_block_multiple(mla_width, resident_width)
    mla_names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    resident = {f"model.layers.{i}.self_attn.indexer.k_cache": indexer for i in range(num_indexers)}
    resident[f"model.layers.{layers}.self_attn.attn"] = latent
    resident = {name: dataclasses.replace(spec, block_size=64 * m) for name, spec in resident.items()}
    return [
        KVCacheGroupSpec(mla_names, latent),
        KVCacheGroupSpec(list(resident), UniformTypeKVCacheSpecs.from_specs(resident)),
    ]


def test_a_page_layout_block_is_m_aligned_slots_of_whole_latent_rows_and_costs_little():
    from vllm.v1.hisparse.kv_grouping import (
        PAGE_SLOT_ALIGNMENT,
        page_layout_block_bytes,
        page_layout_multiple,
    )

    groups = glm53_page_layout_groups()
    _, mla_width, resident_width = glm53_widths()
    m = page_layout_multiple(groups)
    assert m == 14
    block = page_layout_block_bytes(groups)
    slot, rest = divmod(block, m)
    assert rest == 0 and slot % PAGE_SLOT_ALIGNMENT == 0
    assert slot % FP8_SPARSE_MLA_BYTES_PER_TOKEN == 0, "the drafter's latent rows are whole in a slot"
    assert block >= mla_width and slot >= resident_width
    assert block <= mla_width + m * FP8_SPARSE_MLA_BYTES_PER_TOKEN, "at most a row per slot"
    # The current layout's groups (one block size) are not the page layout.
    assert page_layout_multiple(groups[:1]) is None and page_layout_block_bytes(groups[:1]) is None
    # Nor are another model's two groups of other block sizes (not 64-token sparse-MLA pages).
    import dataclasses

    import torch

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    dense = FullAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert page_layout_multiple([KVCacheGroupSpec(["a"], dense), groups[1]]) is None
    wider = dataclasses.replace(groups[0].kv_cache_spec, block_size=128)
    assert page_layout_multiple([KVCacheGroupSpec(groups[0].layer_names, wider), groups[1]]) is None
