# SPDX-License-Identifier: Apache-2.0
"""The CUDA sparse-MLA backends resolve host pages through HiSparse (their glue, on CPU).

Each backend's real `forward_mqa` (patched by this distribution) runs here with
its GPU kernels replaced, at the seam, by torch versions of the same contract:
upstream's Triton index conversion by `dsa_torch.positions_to_slots`, the
attention kernels by `dsa_torch.sparse_mla_attention` over exactly the rows
they are given. A request with two pages in the host pool, the null block in
their place and their old device blocks overwritten must attend exactly as the
same request with every page resident, in a layout where other layers' pages
sit between this layer's blocks (so row and page-index spaces differ), with one
attention kernel call for the whole batch.
"""

from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import vllm  # noqa: F401  (platform set-up before the backends import)
from vllm.v1.attention.ops import dsa_torch
from vllm.v1.hisparse import resolution as hisparse_resolution
from vllm.v1.hisparse import sparse_mla
from vllm.v1.hisparse import worker as hisparse_worker
from vllm.v1.hisparse.plan import (
    HISPARSE_PLAN_VERSION,
    HiSparseStepPlan,
    HostPageRun,
    HotLeaseUpdate,
    StepStaging,
)
from vllm.v1.hisparse.resolution import impl_resolves

BLOCK = 64
LATENT = 512
WIDTH = LATENT + 64
FP8_WIDTH = 656
HEADS = 2
TOPK = 32
NUM_BLOCKS = 11
LAYER = "model.layers.0.self_attn.attn"
SCALE = WIDTH**-0.5
# Batch row 0 is fully resident; row 1 has pages 0 and 1 in host pages 0 and 1,
# whose device blocks 4 and 5 were freed and reused, a hot lease of block 8 and,
# for this step, staging rows in block 10.
RESIDENT_TABLE = [[1, 2, 3, 0], [4, 5, 6, 7]]
HISPARSE_TABLE = [[1, 2, 3, 0], [0, 0, 6, 7]]
DEMOTED = {0: 4, 1: 5}  # page -> its old block
HOT_BLOCK = 8
STAGING_BLOCK = 10
REQ_ID_PER_TOKEN = [0, 0, 1, 1, 1]  # three query tokens of the request with host pages


class Case:
    """One seeded batch: the KV cache, the queries and the indexer's selections."""

    def __init__(self, kind: str) -> None:
        """kind: "bf16"; "fp8_ds_mla" (FlashMLA's 656-byte rows with scales); "fp8"
        (576 fp8 values, stored as uint8 and seen by the backend as float8_e4m3fn)."""
        g = torch.Generator().manual_seed(7)
        self.kind = kind
        shape = (NUM_BLOCKS, 2 * BLOCK, FP8_WIDTH if kind == "fp8_ds_mla" else WIDTH)
        if kind == "fp8_ds_mla":
            storage = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif kind == "fp8":
            storage = torch.randn(shape, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            storage = torch.randn(shape, generator=g).to(torch.bfloat16)
        # Another layer's page sits after each block of this one: 128 rows per block.
        self.storage = storage
        self.cache = storage[:, :BLOCK]
        self.q = (
            torch.randn(len(REQ_ID_PER_TOKEN), HEADS, LATENT, generator=g).to(torch.bfloat16),
            torch.randn(len(REQ_ID_PER_TOKEN), HEADS, WIDTH - LATENT, generator=g).to(torch.bfloat16),
        )
        context = [3 * BLOCK, 4 * BLOCK]
        picks = []
        for t, r in enumerate(REQ_ID_PER_TOKEN):
            # Later tokens of a request overlap earlier picks: hot hits as well as misses.
            chosen = torch.randperm(context[r] if t % 2 else context[r] // 2, generator=g)[:TOPK]
            if t == 3:
                chosen[-5:] = -1  # a short selection, -1 padded
            picks.append(chosen)
        self.positions = torch.stack(picks).to(torch.int32)

    def seen_by_backend(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache as the attention layer hands it to the backend."""
        return cache.view(torch.float8_e4m3fn) if self.kind == "fp8" else cache

    def metadata(self, table, **extra) -> SimpleNamespace:
        return SimpleNamespace(
            req_id_per_token=torch.tensor(REQ_ID_PER_TOKEN, dtype=torch.int32),
            block_table=torch.tensor(table, dtype=torch.int32),
            block_size=BLOCK,
            topk_tokens=TOPK,
            **extra,
        )

    def demote(self) -> tuple[torch.Tensor, hisparse_worker.HiSparseWorker]:
        """The cache after HiSparse demoted pages 0 and 1, and a worker holding them."""
        cache = self.storage.clone()[:, :BLOCK]
        runner = SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=["full", "mixed"], req_id_to_index={"full": 0, "mixed": 1}),
            requests={},
        )
        worker = hisparse_worker.HiSparseWorker(
            runner, {LAYER: cache}, group_of_layer={LAYER: 0}, hot_rows=BLOCK, num_host_pages=4, max_pages=4
        )
        for page, block in DEMOTED.items():
            worker.host_pool[0, page] = cache[block]
            cache[block] = cache[9]  # the freed block now holds another request's rows
        return cache, worker


def plan(host_pages: tuple[tuple[int, int], ...]) -> SimpleNamespace:
    changes: dict = {"host_pages": (), "leases": (), "staging": ()}
    if host_pages:
        changes = {
            "host_pages": tuple(HostPageRun("mixed", page, (host,)) for page, host in host_pages),
            "leases": (HotLeaseUpdate("mixed", ((HOT_BLOCK,),)),),
            "staging": (StepStaging("mixed", BLOCK, ((STAGING_BLOCK,),)),),
        }
    return SimpleNamespace(
        hisparse_plan=HiSparseStepPlan(HISPARSE_PLAN_VERSION, 0, (0,), (), (), (), **changes),
        finished_req_ids=set(),
        preempted_req_ids=None,
        num_scheduled_tokens={"full": 2, "mixed": 3},
    )


class KernelCalls:
    def __init__(self) -> None:
        self.count = 0


def masked(rows: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    rows = rows.long().clone()
    if lengths is not None:
        rows[torch.arange(rows.shape[1]).unsqueeze(0) >= lengths.long().unsqueeze(1)] = -1
    return rows


def fake_convert(
    req_id,
    block_table,
    token_indices,
    BLOCK_SIZE=64,
    BLOCK_STRIDE_ROWS=None,
    NUM_TOPK_TOKENS=None,
    return_valid_counts=False,
    **kwargs,
):
    """Upstream's Triton conversion, in torch (the GPU seam)."""
    rows = dsa_torch.positions_to_slots(token_indices, req_id, block_table, BLOCK_SIZE, BLOCK_STRIDE_ROWS)
    rows = rows.to(torch.int32)
    return (rows, (rows >= 0).sum(-1, dtype=torch.int32)) if return_valid_counts else rows


@pytest.fixture(autouse=True)
def torch_index_conversion(monkeypatch):
    from vllm.v1.attention.backends.mla import sparse_utils

    monkeypatch.setattr(sparse_utils, "triton_convert_req_index_to_global_index", fake_convert)


def flashmla(monkeypatch, case: Case, calls: KernelCalls):
    fp8 = case.kind == "fp8_ds_mla"
    from vllm.v1.attention.backends.mla import flashmla_sparse as backend

    def sparse_fwd(q, kv, indices, sm_scale, topk_length=None, **_):
        calls.count += 1
        rows = masked(indices[:, 0], topk_length)
        out = dsa_torch.sparse_mla_attention(q, kv[:, 0], rows, sm_scale, LATENT)
        return out, None, torch.zeros(q.shape[0], q.shape[1])

    def with_kvcache(
        q,
        k_cache,
        block_table,
        head_dim_v,
        cache_seqlens,
        tile_scheduler_metadata,
        is_fp8_kvcache,
        indices,
        softmax_scale,
    ):
        calls.count += 1
        assert is_fp8_kvcache and head_dim_v == LATENT
        # Paged indices: block * 64 + offset, the block found through the cache's stride.
        rows = k_cache[:, :, 0].reshape(-1, FP8_WIDTH)[:, :WIDTH].float() / 64
        b, s, h, d = q.shape
        out = dsa_torch.sparse_mla_attention(
            q.reshape(b * s, h, d), rows, indices.reshape(b * s, -1).long(), softmax_scale, LATENT
        )
        return out.reshape(b, s, h, LATENT), torch.zeros(b, h, s)

    def concat_mla_q(ql_nope, q_pe, out):
        out[:, : ql_nope.shape[1]] = torch.cat([ql_nope, q_pe], dim=-1)

    monkeypatch.setattr(backend, "flash_mla_sparse_fwd", sparse_fwd)
    monkeypatch.setattr(backend, "flash_mla_with_kvcache", with_kvcache)
    monkeypatch.setattr(backend, "get_mla_metadata", lambda *a, **k: (object(), None))
    monkeypatch.setattr(backend.ops, "concat_mla_q", concat_mla_q)
    impl = backend.FlashMLASparseImpl.__new__(backend.FlashMLASparseImpl)
    impl.num_heads = HEADS
    impl.kv_lora_rank = LATENT
    impl.kv_cache_dtype = "fp8_ds_mla" if fp8 else "auto"
    impl.topk_indices_buffer = case.positions
    impl.prefill_padding = 64
    impl.fp8_decode_padded_heads = 64
    impl.softmax_scale = SCALE
    impl.dcp_world_size = 1
    impl.need_to_return_lse_for_decode = False
    # Padded to the bf16 kernel's 64 heads, as the backend sizes it.
    heads = HEADS if fp8 else 64
    impl.q_concat_buffer = torch.zeros(len(REQ_ID_PER_TOKEN), heads, WIDTH, dtype=torch.bfloat16)
    extra = {"fp8_use_mixed_batch": True, "fp8_extra_metadata": None}
    if fp8:
        extra["fp8_extra_metadata"] = backend.FlashMLASparseMetadata.FP8KernelMetadata(
            scheduler_metadata=object(),
            cache_lens=torch.full((1,), 4096, dtype=torch.int32),
            dummy_block_table=torch.zeros((1, 1), dtype=torch.int32),
        )
    return impl, extra


def flashinfer(monkeypatch, case: Case, calls: KernelCalls):
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse as backend
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    def trtllm_decode(query, kv_cache, block_tables, seq_lens, bmm1_scale, return_lse, **_):
        calls.count += 1
        assert not return_lse
        # Flat rows: other layers' pages between blocks are skipped by the row index.
        rows, _ = flat_kv_row_view(kv_cache[:, 0], BLOCK)
        out = dsa_torch.sparse_mla_attention(
            query[:, 0], rows, masked(block_tables[:, 0], seq_lens), bmm1_scale, LATENT
        )
        return out.unsqueeze(1)

    decode = types.ModuleType("flashinfer.decode")
    decode.trtllm_batch_decode_with_kv_cache_mla = trtllm_decode
    package = types.ModuleType("flashinfer")
    package.decode = decode
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    impl = backend.FlashInferMLASparseImpl.__new__(backend.FlashInferMLASparseImpl)
    impl.topk_indices_buffer = case.positions
    impl.dcp_world_size = 1
    impl.need_to_return_lse_for_decode = False
    impl._workspace_buffer = torch.empty(1)
    impl.bmm1_scale = impl.bmm2_scale = None
    impl.scale = SCALE
    impl.kv_cache_dtype = case.kind if case.kind == "fp8" else "auto"
    impl.kv_lora_rank = LATENT
    impl.qk_nope_head_dim = 128
    impl.qk_rope_head_dim = WIDTH - LATENT
    return impl, {}


def flashattn(monkeypatch, case: Case, calls: KernelCalls):
    def varlen(
        q,
        k,
        v,
        q_v,
        max_seqlen_q,
        cu_seqlens_q,
        max_seqlen_k,
        seqused_k,
        block_table,
        softmax_scale,
        causal,
        fa_version,
    ):
        calls.count += 1
        assert max_seqlen_q == 1 and causal
        rows = torch.cat([v[:, 0, 0], k[:, 0, 0]], dim=-1)
        return dsa_torch.sparse_mla_attention(
            torch.cat([q_v, q], dim=-1), rows, masked(block_table, seqused_k), softmax_scale, LATENT
        )

    # The FlashAttention extension is CUDA-only: its interface module is the seam.
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_func = varlen
    package = types.ModuleType("vllm.vllm_flash_attn")
    package.flash_attn_interface = interface
    name = "vllm.v1.attention.backends.mla.flashattn_mla_sparse"
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", package)
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn.flash_attn_interface", interface)
    monkeypatch.delitem(sys.modules, name, raising=False)
    backend = importlib.import_module(name)
    impl = backend.FlashAttnMLASparseImpl.__new__(backend.FlashAttnMLASparseImpl)
    impl.topk_indices_buffer = case.positions
    impl.dcp_world_size = 1
    impl.kv_lora_rank = LATENT
    impl.scale = SCALE
    return impl, {}


BACKENDS = {
    "flashmla-bf16": (flashmla, "bf16"),
    "flashmla-fp8": (flashmla, "fp8_ds_mla"),
    "flashinfer-bf16": (flashinfer, "bf16"),
    "flashinfer-fp8": (flashinfer, "fp8"),
    "flashattn-bf16": (flashattn, "bf16"),
}


@pytest.fixture(autouse=True)
def no_active_worker(monkeypatch):
    monkeypatch.setattr(hisparse_resolution, "_active", None)
    yield
    assert sparse_mla._resolving is None, "a resolving layer outlived its forward_mqa"


def backend(name: str, monkeypatch):
    """The named backend's impl on a seeded case, its kernel-call counter and metadata extras."""
    build, kind = BACKENDS[name]
    case = Case(kind)
    calls = KernelCalls()
    impl, extra = build(monkeypatch, case, calls)
    return case, calls, impl, extra


LAYER_HANDLE = SimpleNamespace(layer_name=LAYER, _q_scale_float=1.0, _k_scale_float=1.0)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_cuda_backend_with_host_pages_attends_once_like_the_all_resident_run(name, monkeypatch):
    case, calls, impl, extra = backend(name, monkeypatch)
    assert impl_resolves(impl)
    layer = LAYER_HANDLE

    expected, _ = impl.forward_mqa(
        case.q, case.seen_by_backend(case.cache), case.metadata(RESIDENT_TABLE, **extra), layer
    )

    cache, worker = case.demote()
    hisparse_metadata = case.metadata(HISPARSE_TABLE, **extra)
    unresolved, _ = impl.forward_mqa(case.q, case.seen_by_backend(cache), hisparse_metadata, layer)
    assert not torch.equal(unresolved[2:], expected[2:]), "the demoted pages matter to these tokens"

    worker.begin_step(plan(((0, 0), (1, 1))))
    calls.count = 0
    out, lse = impl.forward_mqa(case.q, case.seen_by_backend(cache), hisparse_metadata, layer)
    report = worker.finish_step(SimpleNamespace())

    assert lse is None
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-2)
    assert calls.count == 1, "one attention kernel call for the whole batch, no re-attention"
    counters = report.hisparse_counters
    assert counters["attention_calls"] == counters["resolver_calls"] == counters["resolution_plans"] == 1
    assert counters["rows_loaded"] > BLOCK and counters["rows_staged"] > 0, "more host rows than hot slots"


@pytest.mark.parametrize("name", list(BACKENDS))
def test_cuda_backend_without_host_pages_runs_untouched(name, monkeypatch):
    case, calls, impl, extra = backend(name, monkeypatch)
    layer = LAYER_HANDLE
    _, worker = case.demote()
    worker.begin_step(plan(()))

    impl.forward_mqa(case.q, case.seen_by_backend(case.cache), case.metadata(RESIDENT_TABLE, **extra), layer)
    report = worker.finish_step(SimpleNamespace())

    assert calls.count == 1
    counters = report.hisparse_counters
    assert counters["attention_calls"] == 1
    assert counters["resolver_calls"] == 0 and counters["rows_loaded"] == 0


def conversion_inside_a_resolving_layer(monkeypatch, **kwargs):
    """Call the index conversion as a resolving layer's backend would, with `kwargs`."""
    case = Case("bf16")
    _, worker = case.demote()
    worker.begin_step(plan(((0, 0), (1, 1))))
    resolution = hisparse_resolution.active_resolution()
    assert resolution is not None and resolution.resolves(LAYER)
    monkeypatch.setattr(
        sparse_mla,
        "_resolving",
        sparse_mla._ResolvingLayer(resolution, LAYER, case.cache, BLOCK, sparse_mla.flat_row_view),
    )
    try:
        return sparse_mla.convert_req_index_to_global_index(
            torch.tensor(REQ_ID_PER_TOKEN, dtype=torch.int32),
            torch.tensor(HISPARSE_TABLE, dtype=torch.int32),
            case.positions,
            **kwargs,
        )
    finally:
        monkeypatch.setattr(sparse_mla, "_resolving", None)
        worker.finish_step(SimpleNamespace())


def test_flashmla_prefill_workspace_is_refused_inside_a_resolving_layer(monkeypatch):
    with pytest.raises(NotImplementedError, match="mixed-batch path"):
        conversion_inside_a_resolving_layer(monkeypatch, BLOCK_SIZE=BLOCK, HAS_PREFILL_WORKSPACE=True)


def test_a_conversion_with_another_block_size_is_refused_inside_a_resolving_layer(monkeypatch):
    # HiSparse pages are 64 tokens; a backend converting with other blocks would resolve
    # the wrong rows, so it is refused by name rather than guessed at.
    with pytest.raises(NotImplementedError, match="pages are 64 tokens.*BLOCK_SIZE=32"):
        conversion_inside_a_resolving_layer(monkeypatch, BLOCK_SIZE=32)
