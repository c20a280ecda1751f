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

An MTP drafter's layers (the checkpoint's own next-token layers, numbered after
the target model's) join the indexer group, its sparse-MLA layer included:
vLLM's proposer builds one set of attention metadata for all drafting layers,
so they must share a group, and that group stays resident. HiSparse manages
only the groups without an indexer layer (`hisparse_managed_group_ids`).

k is chosen for capacity: every page costs k + 1 blocks of the widest group's
width, so few wide groups waste the resident group's share and many narrow
groups cost blocks; the sparse-MLA groups are kept at least as wide as the
resident group so a block stride is a whole number of latent rows.

It also owns the start-up capacity rule with HiSparse on: one request at
max_model_len needs every indexer page on the device but only a few pages of
each sparse-MLA group (see `hisparse_device_blocks_per_request`).

It never allocates memory; it only returns group specs and block counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, get_args

from vllm.config.hisparse import (
    RESIDENT_TAIL_PAGES,
    SPARSE_MLA_PAGE_TOKENS,
    HiSparseKVLayout,
    hisparse_active,
    host_pool_pages,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

INDEXER_LAYER_SUFFIX = ".indexer.k_cache"
# The decoder layer index in a layer name ("model.layers.78.self_attn.attn").
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def hisparse_managed_group_ids(groups: Sequence[KVCacheGroupSpec]) -> tuple[int, ...]:
    """The groups whose pages HiSparse moves: the target model's sparse-MLA layers.

    The group holding the indexer layers (and an MTP drafter's layers) stays resident.
    """
    return tuple(
        i
        for i, group in enumerate(groups)
        if not any(name.endswith(INDEXER_LAYER_SUFFIX) for name in group.layer_names)
    )


def drafter_layer_names(vllm_config: VllmConfig, layer_names: Sequence[str]) -> list[str]:
    """The KV cache layers of an MTP drafter, which vLLM numbers after the target model's layers."""
    speculative = vllm_config.speculative_config
    if speculative is None or speculative.method != "mtp":
        return []
    num_target_layers = vllm_config.model_config.hf_config.num_hidden_layers
    return [
        name
        for name in layer_names
        if (match := _LAYER_INDEX.search(name)) is not None and int(match[1]) >= num_target_layers
    ]


def relative_capacity(num_groups: int, num_mla_layers: int, mla_page: int, resident_width: int) -> float:
    """Pages per byte with `num_groups` sparse-MLA groups, relative to one group for everything.

    `resident_width` is the page size of the resident group (indexer layers, and
    an MTP drafter's layers).
    """
    widest = max(math.ceil(num_mla_layers / num_groups) * mla_page, resident_width)
    one_group = num_mla_layers * mla_page + resident_width
    return one_group / ((num_groups + 1) * widest)


def choose_mla_group_count(num_mla_layers: int, mla_page: int, resident_width: int) -> int:
    """The number of sparse-MLA groups that keeps the most capacity, MLA groups widest."""
    candidates = [
        k for k in range(1, num_mla_layers + 1) if math.ceil(num_mla_layers / k) * mla_page >= resident_width
    ]
    if not candidates:
        raise ValueError(
            f"hisparse_config: {num_mla_layers} sparse-MLA layer(s) of {mla_page} bytes per page "
            f"cannot be grouped at least as wide as the resident group ({resident_width} bytes)"
        )
    return max(candidates, key=lambda k: (relative_capacity(k, num_mla_layers, mla_page, resident_width), -k))


def _hisparse_layers(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> tuple[list[str], list[str], list[str]] | None:
    """The sparse-MLA layers HiSparse moves, the resident layers (indexer layers, then an
    MTP drafter's layers) and the drafter's layers; None when HiSparse does not group."""
    if not hisparse_active(vllm_config) or not kv_cache_spec:
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
    # An MTP drafter's layers join the indexer layers in the resident group.
    drafter = drafter_layer_names(vllm_config, list(kv_cache_spec))
    mla = [name for name in mla if name not in drafter]
    resident = indexer + [name for name in drafter if name not in indexer]
    return mla, resident, drafter


def _resident_group(
    kv_cache_spec: dict[str, KVCacheSpec], resident: list[str], drafter: list[str]
) -> list[KVCacheGroupSpec]:
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs

    if not drafter:
        return create_kv_cache_group_specs(kv_cache_spec, [resident])
    # The drafter's sparse-MLA and indexer layers differ in width: one group of uniform type.
    resident_spec = UniformTypeKVCacheSpecs.from_specs({name: kv_cache_spec[name] for name in resident})
    if resident_spec is None:
        raise ValueError(f"hisparse_config: the indexer and MTP drafter layers {drafter} cannot be grouped")
    return [KVCacheGroupSpec(resident, resident_spec)]


# The grouping HiSparse gives vLLM: its k sparse-MLA groups ("groups"), or the page layout
# ("page"); `hisparse_config.kv_layout` chooses, unless `kv_layout` overrides it (the
# capacity simulator's `--kv-layout`).
KV_LAYOUTS: tuple[str, ...] = get_args(HiSparseKVLayout)
_kv_layout: str | None = None


@contextlib.contextmanager
def kv_layout(name: str) -> Iterator[None]:
    """Within the block, `hisparse_kv_cache_groups` gives the `name` layout's groups,
    whatever `hisparse_config.kv_layout` says."""
    global _kv_layout
    if name not in KV_LAYOUTS:
        raise ValueError(f"KV cache layout {name!r}: choose from {', '.join(KV_LAYOUTS)}")
    previous, _kv_layout = _kv_layout, name
    try:
        yield
    finally:
        _kv_layout = previous


def hisparse_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec] | None:
    """HiSparse's groups for a DSA model, or None to let upstream group as usual
    (HiSparse off, or its residency plans cannot run on this platform)."""
    layers = _hisparse_layers(vllm_config, kv_cache_spec)
    if layers is None:
        return None
    hisparse = vllm_config.attention_config.hisparse_config
    assert hisparse is not None
    if (_kv_layout or hisparse.kv_layout) == "page":
        return page_layout_kv_cache_groups(vllm_config, kv_cache_spec, layers)
    mla, resident, drafter = layers
    mla_page = kv_cache_spec[mla[0]].page_size_bytes
    resident_width = sum(kv_cache_spec[name].page_size_bytes for name in resident)
    k = choose_mla_group_count(len(mla), mla_page, resident_width)
    per_group = math.ceil(len(mla) / k)
    grouped = [mla[i : i + per_group] for i in range(0, len(mla), per_group)]
    logger.info(
        "Hybrid HiSparse: %d sparse-MLA KV cache group(s) of up to %d layers plus one resident "
        "group of the indexer%s layers (%.1f%% of single-group capacity).",
        len(grouped),
        per_group,
        " and MTP drafter" if drafter else "",
        100 * relative_capacity(len(grouped), len(mla), mla_page, resident_width),
    )
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs

    return [
        *create_kv_cache_group_specs(kv_cache_spec, grouped),
        *_resident_group(kv_cache_spec, resident, drafter),
    ]


# -- the page layout (the scheduler's side; docs/architecture.md, "The page layout") --


def page_layout_capacity(multiple: int, mla_width: int, resident_width: int) -> float:
    """Pages per byte in the page layout, relative to one group for everything.

    One sparse-MLA group holds every sparse-MLA layer, one block per page
    (`mla_width` bytes); the resident group's block holds `multiple` pages of the
    resident layers (`resident_width` bytes each). Both groups' blocks take the
    wider of the two, so a page costs 1 + 1/multiple blocks.
    """
    block = max(mla_width, multiple * resident_width)
    return (mla_width + resident_width) / ((1 + 1 / multiple) * block)


def choose_resident_block_multiple(mla_width: int, resident_width: int) -> int:
    """Pages per resident block in the page layout: the most capacity, the finer on a tie
    (a prefix hit ending inside a resident block copies it whole)."""
    upper = max(1, -(-mla_width // resident_width))
    return max(range(1, upper + 1), key=lambda m: (page_layout_capacity(m, mla_width, resident_width), -m))


def page_layout_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    layers: tuple[list[str], list[str], list[str]] | None = None,
) -> list[KVCacheGroupSpec] | None:
    """The page layout's groups: every sparse-MLA layer in one group, one block per page
    (so a page is one block, allocated, cached and freed once), and the resident layers
    in one group whose blocks hold `choose_resident_block_multiple` pages each, so both
    groups' blocks are about as wide and share the one pool at any ratio.

    `hisparse_config.kv_layout: "page"` chooses them. The workers lay each block out with
    `page_layout_block_bytes` and `interleave_resident_pages`. `layers`: the model's
    sparse-MLA, resident and drafter layers, where the caller has them already.
    """
    layers = layers or _hisparse_layers(vllm_config, kv_cache_spec)
    if layers is None:
        return None
    mla, resident, drafter = layers
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs

    mla_width = sum(kv_cache_spec[name].page_size_bytes for name in mla)
    resident_width = sum(kv_cache_spec[name].page_size_bytes for name in resident)
    multiple = choose_resident_block_multiple(mla_width, resident_width)
    from vllm.platforms import current_platform

    logger.info(
        "Hybrid HiSparse: the page layout, one sparse-MLA KV cache group plus a resident group "
        "of %d-page blocks (%.1f%% of single-group capacity).",
        multiple,
        100 * page_layout_capacity(multiple, mla_width, resident_width),
    )
    if current_platform.is_cuda():
        logger.warning(
            "Hybrid HiSparse: hisparse_config.kv_layout 'page' has been checked on CPU only; the "
            "CUDA indexer and sparse-MLA kernels read its resident pages at a stride this build "
            "has not run them on. Use kv_layout 'groups' (the default) for production."
        )
    coarse = {
        name: dataclasses.replace(spec, block_size=spec.block_size * multiple) if name in resident else spec
        for name, spec in kv_cache_spec.items()
    }
    return [*create_kv_cache_group_specs(coarse, [mla]), *_resident_group(coarse, resident, drafter)]


# The resident group's page slots are a multiple of this many bytes apart (and of every
# sparse-MLA layer's row), so every kernel page starts 16-byte aligned, as vector and TMA
# loads need, and a block stride is a whole number of latent rows.
PAGE_SLOT_ALIGNMENT = 16


def page_layout_multiple(groups: Sequence[KVCacheGroupSpec]) -> int | None:
    """Pages per resident block when `groups` are the page layout's (one sparse-MLA group of
    64-token pages, then a resident group of coarser blocks holding the indexer layers);
    None for any other grouping, upstream's included."""
    if len(groups) != 2 or hisparse_managed_group_ids(groups) != (0,):
        return None
    mla, resident_group = groups
    if not isinstance(mla.kv_cache_spec, MLAAttentionSpec):
        return None
    page, resident = mla.kv_cache_spec.block_size, resident_group.kv_cache_spec.block_size
    if page != SPARSE_MLA_PAGE_TOKENS or resident <= page or resident % page:
        return None
    return resident // page


def page_layout_block_bytes(groups: Sequence[KVCacheGroupSpec]) -> int | None:
    """Bytes of one block of the page layout's pool; None for any other grouping.

    A resident block is m page slots one after another, each holding one 64-token page
    of every resident layer, so the kernels that read 64-token pages see one page stride
    (a slot). A slot is as wide as the resident layers' pages, or as a sparse-MLA page's
    m-th part if that is wider, rounded up to a multiple of `PAGE_SLOT_ALIGNMENT` and of
    every latent row (the sparse-MLA kernels address rows at a block's stride); a block
    is m slots. The rounding costs at most m rows per block (0.3% for GLM-5.3).
    """
    multiple = page_layout_multiple(groups)
    if multiple is None:
        return None
    from vllm.v1.core.kv_cache_utils import _get_per_layer_spec as _layer_spec

    mla, resident = groups
    mla_width = sum(_layer_spec(mla, name).page_size_bytes for name in mla.layer_names)
    resident_width = sum(_layer_spec(resident, name).page_size_bytes for name in resident.layer_names)
    unit = PAGE_SLOT_ALIGNMENT
    for group in groups:
        for name in group.layer_names:
            if not name.endswith(INDEXER_LAYER_SUFFIX):
                spec = _layer_spec(group, name)
                unit = math.lcm(unit, spec.page_size_bytes // spec.block_size)
    slot = max(-(-mla_width // multiple), -(-resident_width // multiple))
    return multiple * -(-slot // unit) * unit


def interleave_resident_pages(
    groups: Sequence[KVCacheGroupSpec], tensors: list[KVCacheTensor]
) -> list[KVCacheTensor]:
    """The page layout's KV cache tensors: the resident layers' pages interleaved by slot.

    Upstream places each resident layer's whole m-page block after the previous layer's;
    here page j of every resident layer lies in slot j of the block (one 64-token page per
    layer, back to back), so a resident block splits into m kernel blocks one slot apart
    (`kernel_pages_interleaved`). Other groupings' tensors are returned unchanged.
    """
    multiple = page_layout_multiple(groups)
    if multiple is None:
        return tensors
    from vllm.v1.core.kv_cache_utils import _get_per_layer_spec as _layer_spec

    resident = groups[1]
    names = set(resident.layer_names)
    out, offset = [], 0
    for tensor in tensors:
        if not names.issuperset(tensor.layers):
            out.append(tensor)
            continue
        page = _layer_spec(resident, tensor.layers[0]).page_size_bytes
        if page % multiple:
            raise ValueError(
                f"the page layout cannot split {tensor.layers[0]}'s {page}-byte block into {multiple} pages"
            )
        kernel_page = page // multiple
        out.append(dataclasses.replace(tensor, layer_stride=kernel_page, offset=offset))
        offset += len(tensor.layers) * kernel_page
    return out


def kernel_pages_interleaved(tensor: KVCacheTensor, ratio: int, dense_page: int) -> bool:
    """Whether `tensor`'s layers keep each of a block's `ratio` kernel pages in its own slot
    (`interleave_resident_pages`), so kernel block k starts k slots in, a slot being the
    block stride / `ratio`: the split upstream makes only for one dense page per block."""
    slot, rest = divmod(tensor.block_stride, ratio)
    kernel_page = dense_page // ratio
    return (
        rest == 0
        and tensor.layer_stride >= kernel_page
        and tensor.offset + (len(tensor.layers) - 1) * tensor.layer_stride + kernel_page <= slot
    )


def hisparse_device_blocks_per_request(vllm_config: VllmConfig, groups: list[KVCacheGroupSpec]) -> int:
    """Device blocks one request at max_model_len holds at most with HiSparse residency.

    The resident group (indexer layers, an MTP drafter's layers) keeps every page
    of the context; each sparse-MLA group HiSparse manages keeps
    the pages of the chunk being computed, the resident tail and the hot lease, as
    the residency manager leaves them; the rest of the context lives in the host pool.
    """
    hisparse = vllm_config.attention_config.hisparse_config
    assert hisparse is not None and hisparse.device_buffer_size is not None
    max_len = vllm_config.model_config.max_model_len
    chunk = min(vllm_config.scheduler_config.max_num_batched_tokens, max_len)
    managed = hisparse_managed_group_ids(groups)
    total = 0
    for g, group in enumerate(groups):
        block_size = group.kv_cache_spec.block_size
        if g not in managed:
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
    hisparse = vllm_config.attention_config.hisparse_config
    if hisparse is None or not groups or not hisparse_active(vllm_config):
        return None
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
