# SPDX-License-Identifier: Apache-2.0
"""Plan memory: a step's resolution plans cover only the tokens of requests with HOST pages,
one top-K owner's plans live at a time, and the step's peak stays under the documented bound.

The step is the issue's shape scaled in top-K: one 8K-token prefill chunk of a request with
HOST pages beside 64 decodes (half of them with HOST pages), four sparse-MLA layers in two
top-K owners. The resolution runs as the worker runs it (the plan path that CUDA takes:
the planned tokens come from ranges known on the host), on CPU tensors; the runner is the
one seam stood in for (the persistent batch's order). Peak bytes are the allocator's, read
from torch's memory profiler.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from vllm.v1.hisparse.plan import HostPageRun, HotLeaseUpdate, StepStaging
from vllm.v1.hisparse.resolution import HiSparseResolution, plan_memory_bound, topk_owner_of_layer

BLOCK = 64
TOPK = 64
HOT_ROWS = 2 * TOPK
WIDTH = 4
CHUNK = 8192
DECODES = 64
HOST_PAGES = 96  # of the long request: its first 96 pages
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def peak_bytes(fn) -> tuple[int, object]:
    """The most CPU bytes allocated at once while `fn` runs (beyond what was held before)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak, out


class _Runner:
    """The persistent batch's order: the one thing the resolution reads from its runner."""

    def __init__(self, req_ids: list[str]) -> None:
        index = {r: i for i, r in enumerate(req_ids)}
        self.input_batch = SimpleNamespace(req_ids=req_ids, req_id_to_index=index)


def _step(indexer_layers: list[str], long_on_host: bool = True, seed: int = 0):
    """A resolution after one step's deltas, and the step's per-layer inputs."""
    g = torch.Generator().manual_seed(seed)
    decodes = [f"decode-{i}" for i in range(DECODES)]
    # The chunk sits in the middle of the batch, as the runner's decode-first order leaves it
    # only when it is the batch's one prefill: its range is not the batch's start.
    order = [*decodes[: DECODES // 2], "long", *decodes[DECODES // 2 :]]
    scheduled = {rid: 1 for rid in decodes} | {"long": CHUNK}
    mixed = (["long"] if long_on_host else []) + decodes[::2]
    blocks = 4096
    kv = [torch.zeros(blocks * BLOCK, WIDTH) for _ in LAYERS]
    host_pool = torch.randn(len(LAYERS), 2 * HOST_PAGES + DECODES, BLOCK, WIDTH)
    owners = topk_owner_of_layer(LAYERS, indexer_layers)
    resolution = HiSparseResolution(
        _Runner(order),
        dict.fromkeys(LAYERS, 0),
        owners,
        BLOCK,
        HOT_ROWS,
        host_pool,
        torch.device("cpu"),
        max_pages=(2 * CHUNK) // BLOCK + 2,
    )
    next_block = iter(range(1, blocks))
    host_pages, leases, staging = [], [], []
    for rid in mixed:
        pages = HOST_PAGES if rid == "long" else 1
        first = 0 if rid == "long" else HOST_PAGES + int(rid.split("-")[1])
        host_pages.append(HostPageRun(rid, 0, tuple(first + p for p in range(pages))))
        leases.append(HotLeaseUpdate(rid, ((next(next_block), next(next_block)),)))
    # Staging for every host row of the long request: one pass.
    if long_on_host:
        blocks_of_long = tuple(next(next_block) for _ in range(HOST_PAGES))
        staging.append(StepStaging("long", HOST_PAGES * BLOCK, (blocks_of_long,)))
    resolution.update(host_pages, leases, staging)
    resolution.start_step(scheduled)
    # Each token's selection: the long request's chunk (positions CHUNK..2*CHUNK) reads its
    # whole context; a decode (context 3 pages) reads its own.
    rows_per_token = []
    for rid in order:
        n = scheduled[rid]
        context = 2 * CHUNK if rid == "long" else 3 * BLOCK
        rows_per_token.append(torch.randint(0, context, (n, TOPK), generator=g))
    positions = torch.cat(rows_per_token)
    batch_rows = torch.cat([torch.full((scheduled[r],), i) for i, r in enumerate(order)])
    rows = torch.zeros_like(positions)  # the backend's own conversion: HOST entries at the null block
    return resolution, positions, batch_rows, rows, kv, mixed, scheduled


def _run_step(resolution, positions, batch_rows, rows, kv) -> None:
    """Every layer resolves, as the forward calls it (attention consumes each layer's rows)."""
    for layer, cache in zip(LAYERS, kv, strict=True):
        assert resolution.resolves(layer)
        resolution.resolve_rows(layer, positions, batch_rows, rows, cache, BLOCK)
        assert resolution.num_passes(layer) == 1


@pytest.mark.parametrize("long_on_host", [True, False], ids=["chunk with host pages", "resident chunk"])
@pytest.mark.parametrize("indexers", [1, 2], ids=["one owner", "two owners"])
def test_a_steps_plans_cover_the_tokens_with_host_pages_and_stay_under_the_bound(indexers, long_on_host):
    indexer_layers = LAYERS[:: len(LAYERS) // indexers][:indexers]
    resolution, positions, batch_rows, rows, kv, mixed, scheduled = _step(indexer_layers, long_on_host)
    planned_tokens = sum(scheduled[r] for r in mixed)
    batch_tokens = positions.shape[0]
    # A first step makes the standing state (each owner's hot state); the second is measured.
    _run_step(resolution, positions, batch_rows, rows, kv)
    resolution.end_step()
    resolution.start_step(scheduled)
    peak, _ = peak_bytes(lambda: _run_step(resolution, positions, batch_rows, rows, kv))
    device, _, host, _ = resolution.end_step()
    copied_per_layer = -(-int(device[0]) // len(LAYERS))  # rows_loaded, over the layers

    one_owner_plan = 42 * planned_tokens * TOPK + 8 * len(mixed) + 32
    # Plans of the decodes without HOST pages are not made, and one owner's plans live at
    # a time: the second owner plans after the first owner's last layer freed its plans.
    assert host["max_plan_bytes"] == one_owner_plan
    assert host["resolution_plans"] == indexers
    bound = plan_memory_bound(
        planned_tokens, TOPK, len(mixed), batch_tokens, HOT_ROWS, copied_per_layer, WIDTH * 4
    )
    assert peak <= bound, f"peak {peak} B over the documented bound {bound} B"


def test_the_memory_profile_holds_the_resolvers_bound_across_its_dummy_forward(monkeypatch):
    """profile_run (patch 0008) keeps profile_reserve's bytes alive while the dummy forward
    runs, so the profiled peak, and so the KV cache size, counts them; they go after."""
    import weakref

    import vllm.v1.hisparse.worker as hisparse_worker
    from vllm.v1.worker import gpu_model_runner

    reserve = {}

    def fake_reserve(runner):
        tensor = torch.empty(1 << 20, dtype=torch.uint8)
        reserve["ref"] = weakref.ref(tensor)
        return tensor

    held_in_forward = []

    class Runner:
        supports_mm_inputs = False
        max_num_tokens = 8

        def __init__(self):
            self.encoder_cache = {}

        def _dummy_run(self, num_tokens, is_profile=False):
            held_in_forward.append(reserve["ref"]() is not None)
            return torch.zeros(num_tokens), torch.zeros(num_tokens)

        def _sync_device(self):
            pass

    monkeypatch.setattr(hisparse_worker, "profile_reserve", fake_reserve)
    monkeypatch.setattr(gpu_model_runner, "get_pp_group", lambda: SimpleNamespace(is_last_rank=False))
    gpu_model_runner.GPUModelRunner.profile_run(Runner())
    assert held_in_forward == [True]
    assert reserve["ref"]() is None, "the reserve is released once the profile has its peak"


def test_the_profile_reserve_is_the_plan_bound_and_the_standing_state_for_the_configured_batch():
    from scheduler_harness import HISPARSE, make_vllm_config

    from vllm.v1.hisparse.resolution import standing_state_bytes
    from vllm.v1.hisparse.worker import profile_reserve, profile_reserve_bytes

    def config_with(attention_config):
        return make_vllm_config(
            max_model_len=4096,
            max_num_batched_tokens=1024,
            max_num_seqs=16,
            attention_config=attention_config,
        )

    assert profile_reserve_bytes(config_with(None), 6) is None, "nothing without hisparse_config"
    config = config_with(HISPARSE)
    hf = config.model_config.hf_text_config
    hot_rows = config.attention_config.hisparse_config.device_buffer_size

    def expected(requests, rows):
        return plan_memory_bound(1024, hf.index_topk, requests, 1024, hot_rows) + standing_state_bytes(
            rows, hot_rows, 6, 4096 // 64, -(-hot_rows // 64)
        )

    # max_num_seqs requests, the tables' rows rounded up as they grow (from 8, doubling).
    assert profile_reserve_bytes(config, 6) == expected(16, 16)
    # Fewer when the memory can hold fewer hot leases.
    assert profile_reserve_bytes(config, 6, max_leases=5) == expected(5, 8)
    runner = SimpleNamespace(vllm_config=config, device=torch.device("cpu"))
    assert profile_reserve(runner) is None, "the CPU KV cache is not sized by a profile: nothing held"


def test_the_planned_tokens_from_host_ranges_resolve_as_the_counted_ones_do():
    """The tokens found from the scheduler's ranges (the chunk mid-batch, decodes around it)
    are the ones a count of the batch's rows finds: every layer resolves the same rows."""

    def resolve_all(ranges_known: bool) -> list[torch.Tensor]:
        resolution, positions, batch_rows, rows, kv, _, _ = _step(LAYERS[:2])
        if not ranges_known:
            resolution.start_step(None)  # no counts: the rows are found by a count
        out = [
            resolution.resolve_rows(layer, positions, batch_rows, rows, cache, BLOCK)
            for layer, cache in zip(LAYERS, kv, strict=True)
        ]
        assert (resolution._step().planned_tokens(positions.shape[0]) is not None) == ranges_known
        return out

    from_ranges, counted = resolve_all(True), resolve_all(False)
    for a, b in zip(from_ranges, counted, strict=True):
        assert torch.equal(a, b)
    assert (from_ranges[0] != 0).any(), "host entries were resolved to rows"
