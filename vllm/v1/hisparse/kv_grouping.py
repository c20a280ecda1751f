# SPDX-License-Identifier: Apache-2.0
"""KV cache grouping for Hybrid HiSparse.

Owns how the layers of a DSA model are split into KV cache groups when
`hisparse_config` is set. Upstream puts every sparse-MLA layer and every
indexer K cache layer into one group, so one block id holds a page of both:
the sparse-MLA page could not leave the GPU while the indexer page, which the
indexer scores every step, stays. HiSparse instead uses k groups of sparse-MLA
layers plus one group of indexer layers, all with 64-token blocks from the one
shared block pool, in a block-outermost layout (BLHNC) so groups with
different page sizes overlay the same block bytes. A HiSparse page is then the
k sparse-MLA blocks at one position, freed and restored together, and the
indexer block at that position stays resident.

k is chosen for capacity: every page costs k + 1 blocks of the widest group's
width, so few wide groups waste the indexer group's share and many narrow
groups cost blocks; the sparse-MLA groups are kept at least as wide as the
indexer group so a block stride is a whole number of latent rows.

It also owns the start-up capacity rule with HiSparse on: one request at
max_model_len needs every indexer page on the device but only a few pages of
each sparse-MLA group (see `hisparse_device_blocks_per_request`).

It never allocates memory; it only returns group specs and block counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheSpec, MLAAttentionSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

INDEXER_LAYER_SUFFIX = ".indexer.k_cache"
# Block-outermost: groups with different page sizes share each block's bytes.
HISPARSE_KV_CACHE_LAYOUT = "BLHNC"


def relative_capacity(num_groups: int, num_mla_layers: int, mla_page: int, indexer_width: int) -> float:
    """Pages per byte with `num_groups` sparse-MLA groups, relative to one group for everything."""
    widest = max(math.ceil(num_mla_layers / num_groups) * mla_page, indexer_width)
    one_group = num_mla_layers * mla_page + indexer_width
    return one_group / ((num_groups + 1) * widest)


def choose_mla_group_count(num_mla_layers: int, mla_page: int, indexer_width: int) -> int:
    """The number of sparse-MLA groups that keeps the most capacity, MLA groups widest."""
    candidates = [
        k for k in range(1, num_mla_layers + 1)
        if math.ceil(num_mla_layers / k) * mla_page >= indexer_width
    ]
    return max(candidates, key=lambda k: (relative_capacity(k, num_mla_layers, mla_page, indexer_width), -k))


def hisparse_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec] | None:
    """HiSparse's groups for a DSA model, or None to let upstream group as usual."""
    if vllm_config.attention_config.hisparse_config is None or not kv_cache_spec:
        return None
    indexer = [name for name in kv_cache_spec if name.endswith(INDEXER_LAYER_SUFFIX)]
    mla = [name for name in kv_cache_spec if not name.endswith(INDEXER_LAYER_SUFFIX)]
    specs = [kv_cache_spec[name] for name in kv_cache_spec]
    if not indexer or not mla or not all(isinstance(s, MLAAttentionSpec) for s in specs):
        raise ValueError(
            "hisparse_config needs a DSA model whose KV cache is sparse-MLA layers plus "
            f"indexer layers ('*{INDEXER_LAYER_SUFFIX}'); got layers {sorted(kv_cache_spec)[:4]}..."
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise ValueError(
            "hisparse_config needs the hybrid KV cache manager (separate groups for the "
            "sparse-MLA and indexer caches); remove --disable-hybrid-kv-cache-manager"
        )
    mla_page = kv_cache_spec[mla[0]].page_size_bytes
    indexer_width = sum(kv_cache_spec[name].page_size_bytes for name in indexer)
    k = choose_mla_group_count(len(mla), mla_page, indexer_width)
    per_group = math.ceil(len(mla) / k)
    grouped = [mla[i : i + per_group] for i in range(0, len(mla), per_group)] + [indexer]
    logger.info(
        "Hybrid HiSparse: %d sparse-MLA KV cache group(s) of up to %d layers plus one indexer "
        "group (%.1f%% of single-group capacity).",
        len(grouped) - 1,
        per_group,
        100 * relative_capacity(len(grouped) - 1, len(mla), mla_page, indexer_width),
    )
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs

    return create_kv_cache_group_specs(kv_cache_spec, grouped)


def hisparse_device_blocks_per_request(vllm_config: VllmConfig, groups: list[KVCacheGroupSpec]) -> int:
    """Device blocks one request at max_model_len holds at most with HiSparse residency.

    The indexer group keeps every page of the context; each sparse-MLA group keeps
    the pages of the chunk being computed, the resident tail and the hot lease, as
    the residency manager leaves them; the rest of the context lives in the host pool.
    """
    from vllm.v1.hisparse.residency import RESIDENT_TAIL_PAGES

    hisparse = vllm_config.attention_config.hisparse_config
    assert hisparse is not None and hisparse.device_buffer_size is not None
    max_len = vllm_config.model_config.max_model_len
    chunk = min(vllm_config.scheduler_config.max_num_batched_tokens, max_len)
    total = 0
    for group in groups:
        block_size = group.kv_cache_spec.block_size
        if all(name.endswith(INDEXER_LAYER_SUFFIX) for name in group.layer_names):
            total += math.ceil(max_len / block_size)
        else:
            chunk_pages = math.ceil(chunk / block_size) + 1  # a chunk may straddle a page
            lease_pages = math.ceil(hisparse.device_buffer_size / block_size)
            total += min(math.ceil(max_len / block_size), chunk_pages + RESIDENT_TAIL_PAGES + lease_pages)
    return total


def hisparse_max_memory_usage(
    vllm_config: VllmConfig, groups: list[KVCacheGroupSpec], bytes_per_block: int
) -> Callable[[], int] | None:
    """The start-up KV memory need of one max_model_len request under HiSparse.

    None (upstream's full-residency rule applies) when HiSparse is off or the
    workers do not execute residency plans.

    Also refuses, naming the fields, a host pool that cannot hold such a request.
    """
    from vllm.v1.hisparse import scheduling

    hisparse = vllm_config.attention_config.hisparse_config
    if hisparse is None or not groups or not scheduling.plans_executable():
        return None
    from vllm.config.hisparse import SPARSE_MLA_PAGE_TOKENS, host_pool_pages

    max_len = vllm_config.model_config.max_model_len
    host_pages = host_pool_pages(vllm_config)
    needed_pages = math.ceil(max_len / SPARSE_MLA_PAGE_TOKENS)
    if host_pages < needed_pages:
        raise ValueError(
            f"hisparse_config.host_pool_gib={hisparse.host_pool_gib} holds {host_pages} pages "
            f"but one request at max_model_len={max_len} needs {needed_pages}; raise "
            "host_pool_gib or lower max_model_len"
        )
    return lambda: bytes_per_block * hisparse_device_blocks_per_request(vllm_config, groups)

