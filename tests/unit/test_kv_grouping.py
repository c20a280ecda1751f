"""How HiSparse splits a DSA model's KV cache into groups."""

from __future__ import annotations

import math

import pytest

from vllm.v1.hisparse.kv_grouping import choose_mla_group_count, relative_capacity

# GLM-5 / DeepSeek-V3.2 sizes: 61 layers, bf16 latent 576 x 64 tokens per page,
# indexer 132 bytes x 64 tokens per page and layer.
REAL_LAYERS, REAL_MLA_PAGE, REAL_INDEXER_PAGE = 61, 576 * 2 * 64, 132 * 64


def test_the_released_models_keep_almost_all_capacity():
    k = choose_mla_group_count(REAL_LAYERS, REAL_MLA_PAGE, REAL_LAYERS * REAL_INDEXER_PAGE)
    assert k == 9
    assert relative_capacity(k, REAL_LAYERS, REAL_MLA_PAGE, REAL_LAYERS * REAL_INDEXER_PAGE) == pytest.approx(
        0.971, abs=1e-3
    )
    naive = relative_capacity(1, REAL_LAYERS, REAL_MLA_PAGE, REAL_LAYERS * REAL_INDEXER_PAGE)
    assert naive == pytest.approx(0.557, abs=1e-3), "one sparse-MLA group wastes most of the indexer's share"


@pytest.mark.parametrize("layers", [1, 2, 3, 7, 30, 61, 78])
@pytest.mark.parametrize("indexer_page", [132 * 64, 68 * 64])
def test_the_choice_is_the_best_one_that_keeps_latent_rows_whole(layers, indexer_page):
    indexer_width = layers * indexer_page
    k = choose_mla_group_count(layers, REAL_MLA_PAGE, indexer_width)
    assert math.ceil(layers / k) * REAL_MLA_PAGE >= indexer_width, "sparse-MLA groups are the widest"
    for other in range(1, layers + 1):
        if math.ceil(layers / other) * REAL_MLA_PAGE >= indexer_width:
            assert relative_capacity(other, layers, REAL_MLA_PAGE, indexer_width) <= relative_capacity(
                k, layers, REAL_MLA_PAGE, indexer_width
            )
