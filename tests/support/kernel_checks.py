# SPDX-License-Identifier: Apache-2.0
"""Production-shape checks of the HiSparse kernels against their torch references.

Plain functions on torch and the overlay's own modules (no pytest, no vLLM), so that
`tests/kernels` and `scripts/gpu_check.py` run the same checks: every case is built
on the CPU, resolved or copied there by the torch reference, and again on the device
by the kernels, and the results are compared byte for byte.

Shapes (DESIGN.md, the announcement): top-K 2048, hot buffer 4096 rows, 656-byte
fp8_ds_mla rows and 1152-byte bf16 rows, 128 decode requests, 8K-token prefill chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm.v1.hisparse.page_copy import copy_pages
from vllm.v1.hisparse.resolver import HotState, apply_resolution, check_resolution_error, plan_resolution

BLOCK = 64
TOPK = 2048
HOT_ROWS = 4096
ROW_BYTES = {"fp8_ds_mla": 656, "bf16": 1152}


@dataclass
class ResolutionCase:
    """One step of one top-K selection over M requests with HOST pages (CPU tensors)."""

    positions: torch.Tensor  # [T, K]
    token_requests: torch.Tensor  # [T]
    rows: torch.Tensor  # [T, K]: the backend's conversion (resident rows; HOST -> row 0)
    host_page_table: torch.Tensor  # [M, P]
    hot: HotState
    slot_rows: torch.Tensor  # [M, H + S]
    staging_slots: torch.Tensor  # [M]
    kv_rows: torch.Tensor  # [rows, width], the layer's cache as rows (uint8 or bf16 bits)
    host_rows: torch.Tensor  # [host rows, width]
    step: int
    selected_misses: float  # the fraction of host entries built to miss the hot buffer


def distinct_rows(num_rows: int, row_bytes: int, gen: torch.Generator) -> torch.Tensor:
    """[num_rows, row_bytes] uint8 rows that all differ: random patterns (4096 of them), each
    row's own index in its first 8 bytes, so a row copied from the wrong place shows. Far
    cheaper than random bytes for the gigabyte-sized host pools of production shapes."""
    patterns = torch.randint(0, 256, (min(num_rows, 4096), row_bytes), dtype=torch.uint8, generator=gen)
    rows = patterns[torch.randint(0, patterns.shape[0], (num_rows,), generator=gen)]
    rows[:, :8] = torch.arange(num_rows, dtype=torch.int64).view(torch.uint8).view(num_rows, 8)
    return rows


def resolution_case(
    requests: int,
    tokens_per_request: int,
    context: int,
    miss_fraction: float,
    row_bytes: int,
    seed: int = 0,
    topk: int = TOPK,
    hot_rows: int = HOT_ROWS,
) -> ResolutionCase:
    """Requests of `context` tokens whose last 2 pages are resident and the rest on HOST
    pages; each hot buffer starts full of host positions. Each token selects `topk`
    distinct positions: a `miss_fraction` of them host positions outside the hot buffer,
    the rest hot positions and resident ones."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-context // BLOCK)
    resident_pages = 2
    host_pages = pages - resident_pages
    host_positions = host_pages * BLOCK
    if host_positions < hot_rows + topk:
        raise ValueError("the context must hold the hot buffer and a step's misses on HOST pages")
    # Host page table: request m's page p -> host page m * host_pages + p, resident tail -1.
    table = torch.full((requests, pages), -1, dtype=torch.int64)
    table[:, :host_pages] = torch.arange(requests * host_pages).view(requests, host_pages)
    hot_positions = torch.stack(
        [torch.randperm(host_positions, generator=gen)[:hot_rows] for _ in range(requests)]
    )
    hot = HotState(hot_positions, torch.randint(0, 50, (requests, hot_rows), generator=gen))
    num_tokens = requests * tokens_per_request
    token_requests = torch.arange(requests).repeat_interleave(tokens_per_request)
    misses = int(topk * miss_fraction)
    resident = min(topk // 8, resident_pages * BLOCK)
    hits = topk - misses - resident
    positions = torch.empty((num_tokens, topk), dtype=torch.int64)

    def distinct(values: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        """[rows, k]: k distinct draws from `values` per row: a window of k at a random offset
        into one random permutation of them (distinct within a row, varied across rows)."""
        shuffled = values[torch.randperm(values.numel(), generator=gen)]
        offsets = torch.randint(0, values.numel(), (rows, 1), generator=gen)
        return shuffled[(offsets + torch.arange(k)) % values.numel()]

    # Generated in blocks of tokens with tensor operations (no loop per token), so the
    # production-sized cases build in seconds.
    resident_values = host_positions + torch.arange(resident_pages * BLOCK)
    for m in range(requests):
        held = hot_positions[m]
        not_held = torch.ones(host_positions, dtype=torch.bool)
        not_held[held] = False
        candidates = torch.nonzero(not_held).squeeze(1)
        for first in range(m * tokens_per_request, (m + 1) * tokens_per_request, 256):
            n = min(256, (m + 1) * tokens_per_request - first)
            draws = [distinct(candidates, n, misses), distinct(held, n, hits)]
            row = torch.cat([*draws, distinct(resident_values, n, resident)], dim=1)
            order = torch.rand((n, topk), generator=gen).argsort(dim=1)
            positions[first : first + n] = row.gather(1, order)
    # Staging for what cannot stay in the hot buffer: a step's distinct misses beyond its free slots.
    # (distinct positions - hot rows bounds the distinct misses beyond the eligible slots.)
    distinct = torch.tensor([torch.unique(positions[token_requests == m]).numel() for m in range(requests)])
    staging = (distinct - hot_rows).clamp(min=0) + topk // 4
    width_slots = hot_rows + int(staging.max())
    resident_rows = requests * resident_pages * BLOCK
    num_rows = 1 + resident_rows + requests * width_slots
    slot_rows = 1 + resident_rows + torch.arange(requests * width_slots).view(requests, width_slots)
    # The backend's own conversion: resident positions to their rows, host positions to row 0.
    on_resident = positions >= host_positions
    resident_row = 1 + token_requests.unsqueeze(1) * resident_pages * BLOCK + (positions - host_positions)
    rows = torch.where(on_resident, resident_row, 0)
    kv_rows = distinct_rows(num_rows, row_bytes, gen)
    host_rows = distinct_rows(requests * host_positions, row_bytes, gen)
    if row_bytes == ROW_BYTES["bf16"]:
        kv_rows, host_rows = kv_rows.view(torch.bfloat16), host_rows.view(torch.bfloat16)
    return ResolutionCase(
        positions,
        token_requests,
        rows,
        table,
        hot,
        slot_rows,
        staging,
        kv_rows,
        host_rows,
        step=100,
        selected_misses=misses / topk,
    )


def _on(case: ResolutionCase, device: str) -> ResolutionCase:
    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    host_rows = case.host_rows.pin_memory() if device == "cuda" else case.host_rows.clone()
    return ResolutionCase(
        to(case.positions),
        to(case.token_requests),
        to(case.rows),
        to(case.host_page_table),
        HotState(to(case.hot.positions).clone(), to(case.hot.stamps).clone()),
        to(case.slot_rows),
        to(case.staging_slots),
        to(case.kv_rows).clone(),
        host_rows,
        case.step,
        case.selected_misses,
    )


def most_tokens(case: ResolutionCase) -> int:
    """The most tokens any request has in the step (the host knows it from the scheduler);
    1 when no request has any, as the worker bounds it (`resolution.py`)."""
    requests = case.token_requests.cpu()
    valid = requests[requests >= 0]
    return int(torch.bincount(valid).max()) if valid.numel() else 1


def _resolve(case: ResolutionCase, fused: bool = False):
    plan = plan_resolution(
        case.positions,
        case.token_requests,
        case.host_page_table,
        BLOCK,
        case.hot,
        case.staging_slots,
        case.step,
        max_tokens_per_request=most_tokens(case) if fused else None,
    )
    error = torch.zeros((), dtype=torch.int64, device=case.positions.device)
    out = apply_resolution(plan, case.rows, case.slot_rows, case.kv_rows, case.host_rows, error=error)
    return plan, out, error


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for comparisons that hold for any bit pattern (NaNs included)."""
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t


def loads(plan) -> list[tuple[int, int, int]]:
    """A plan's row copies as (request, slot, host row), in a layout-free order."""
    chosen = plan.load.cpu()
    columns = [getattr(plan, name).cpu()[chosen] for name in ("load_request", "load_slot", "load_host_row")]
    return sorted(zip(*(c.tolist() for c in columns), strict=True))


def check_resolution(case: ResolutionCase, device: str = "cuda", fused: bool = False) -> dict:
    """Resolve `case` with the reference on the CPU and on `device` (with the fused plan
    kernel when `fused`); every decision, row and byte equal."""
    reference = _on(case, "cpu")
    ref_plan, ref_out, ref_error = _resolve(reference)
    check_resolution_error(int(ref_error) | int(ref_plan.error))
    dev = _on(case, device)
    plan, out, error = _resolve(dev, fused)
    if device == "cuda":
        torch.cuda.synchronize()
    # The fused plan marks each load at its first entry, the operations in sorted order:
    # the per-entry decisions and the set of copies are what must agree.
    fields = ("on_host", "entry_request", "entry_slot", "counts", "error", "request_error")
    if not fused:
        fields += ("load", "load_request", "load_slot", "load_host_row")
    mismatched = [f for f in fields if not torch.equal(getattr(plan, f).cpu(), getattr(ref_plan, f))]
    if loads(plan) != loads(ref_plan):
        mismatched.append("row copies")
    if not torch.equal(out.cpu(), ref_out):
        mismatched.append("resolved rows")
    if not torch.equal(bits(dev.kv_rows.cpu()), bits(reference.kv_rows)):
        mismatched.append("kv rows")
    if not (
        torch.equal(dev.hot.positions.cpu(), reference.hot.positions)
        and torch.equal(dev.hot.stamps.cpu(), reference.hot.stamps)
    ):
        mismatched.append("hot state")
    if int(error) != int(ref_error):
        mismatched.append("error word")
    return {
        "bit_exact": not mismatched,
        "mismatched": mismatched,
        "rows_loaded": int(ref_plan.rows_loaded),
        "rows_hit": int(ref_plan.rows_hit),
        "entries": ref_plan.on_host.numel(),
    }


def time_resolution(case: ResolutionCase, repeats: int = 20) -> dict:
    """CUDA time, in µs, of one step's plan (fused kernel, and torch operations) and of
    one layer's replay (row copies included), and the H2D GB/s of the misses' rows.

    Each figure three ways: one call between two events from an idle GPU (`*_us`: the
    host's launch work included, as the GPU waits for it), the host's own time per call
    (`*_host_us`, no synchronisation), and `repeats` calls back to back between two
    events, per call (`*_pipelined_us`: where the host launches faster than the GPU
    runs, the GPU's time). A step's plans and replays run in the forward with the host
    ahead of the GPU, so the pipelined figure is what they cost it."""
    import time

    dev = _on(case, "cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(call) -> float:
        samples = []
        for _ in range(repeats + 2):
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1000)
        samples = sorted(samples[2:])
        return samples[len(samples) // 2]

    def host_and_pipelined(call) -> tuple[float, float]:
        call()
        torch.cuda.synchronize()
        start.record()
        began = time.perf_counter()
        for _ in range(repeats):
            call()
        host_us = (time.perf_counter() - began) * 1e6 / repeats
        end.record()
        torch.cuda.synchronize()
        return host_us, start.elapsed_time(end) * 1000 / repeats

    def plan(fused: bool):
        hot = HotState(dev.hot.positions.clone(), dev.hot.stamps.clone())
        return plan_resolution(
            dev.positions,
            dev.token_requests,
            dev.host_page_table,
            BLOCK,
            hot,
            dev.staging_slots,
            dev.step,
            max_tokens_per_request=most_tokens(case) if fused else None,
        )

    fused_us = timed(lambda: plan(True))
    fused_host_us, fused_pipelined_us = host_and_pipelined(lambda: plan(True))
    torch_us = timed(lambda: plan(False))
    the_plan = plan(True)
    error = torch.zeros((), dtype=torch.int64, device="cuda")

    def replay():
        return apply_resolution(the_plan, dev.rows, dev.slot_rows, dev.kv_rows, dev.host_rows, error=error)

    apply_us = timed(replay)
    apply_host_us, apply_pipelined_us = host_and_pipelined(replay)
    check_resolution_error(int(error) | int(the_plan.error))
    row_bytes = dev.kv_rows.shape[1] * dev.kv_rows.element_size()
    loaded = int(the_plan.rows_loaded)
    return {
        "fused_plan_us": fused_us,
        "fused_plan_host_us": fused_host_us,
        "fused_plan_pipelined_us": fused_pipelined_us,
        "torch_plan_us": torch_us,
        "apply_us_per_layer": apply_us,
        "apply_host_us": apply_host_us,
        "apply_pipelined_us": apply_pipelined_us,
        "rows_loaded": loaded,
        "h2d_gbps": loaded * row_bytes / (apply_us * 1e3) if loaded else 0.0,
    }


@dataclass
class PageCopyCase:
    caches: list[torch.Tensor]  # per layer [blocks, BLOCK, width], block-strided in one allocation
    storage: torch.Tensor
    host_pool: torch.Tensor  # [layers, host pages, BLOCK, width]
    block_ids: torch.Tensor  # [pages, layers]
    host_pages: torch.Tensor  # [pages]


def page_copy_case(
    layers: int, pages: int, row_bytes: int, seed: int = 0, device: str = "cpu"
) -> PageCopyCase:
    """`pages` pages (an 8K-token chunk is 128) of `layers` layers, blocks strided past every layer."""
    gen = torch.Generator().manual_seed(seed)
    blocks, host_pages = pages * 2, pages * 2
    storage = torch.randint(0, 256, (blocks, layers + 1, BLOCK, row_bytes), dtype=torch.uint8, generator=gen)
    host = torch.randint(0, 256, (layers, host_pages, BLOCK, row_bytes), dtype=torch.uint8, generator=gen)
    block_ids = torch.stack([torch.randperm(blocks, generator=gen)[:pages] for _ in range(layers)], dim=1)
    chosen = torch.randperm(host_pages, generator=gen)[:pages]
    storage = storage.to(device)
    host = host.pin_memory() if device == "cuda" else host
    return PageCopyCase([storage[:, layer] for layer in range(layers)], storage, host, block_ids, chosen)


def check_page_copy(
    layers: int, pages: int, row_bytes: int, to_host: bool, seed: int = 0, device: str = "cuda"
) -> dict:
    reference = page_copy_case(layers, pages, row_bytes, seed)
    copy_pages(reference.caches, reference.host_pool, reference.block_ids, reference.host_pages, to_host)
    dev = page_copy_case(layers, pages, row_bytes, seed, device)
    copy_pages(dev.caches, dev.host_pool, dev.block_ids, dev.host_pages, to_host)
    if device == "cuda":
        torch.cuda.synchronize()
    exact = torch.equal(dev.storage.cpu(), reference.storage)
    exact = exact and torch.equal(dev.host_pool, reference.host_pool)
    return {"bit_exact": exact, "bytes": pages * layers * BLOCK * row_bytes}


def time_page_copy(layers: int, pages: int, row_bytes: int, to_host: bool, repeats: int = 10) -> dict:
    """One batched launch for every layer against one launch per layer, and the GB/s moved."""
    case = page_copy_case(layers, pages, row_bytes, device="cuda")
    error = torch.zeros((), dtype=torch.int64, device="cuda")
    nbytes = pages * layers * BLOCK * row_bytes

    def timed(call) -> float:
        samples = []
        for _ in range(repeats + 2):
            torch.cuda.synchronize()
            began = time.perf_counter()
            call()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - began) * 1e6)
        samples = sorted(samples[2:])
        return samples[len(samples) // 2]

    def batched():
        copy_pages(case.caches, case.host_pool, case.block_ids, case.host_pages, to_host, error=error)

    def per_layer():
        for layer in range(layers):
            copy_pages(
                case.caches[layer : layer + 1],
                case.host_pool[layer : layer + 1],
                case.block_ids[:, layer : layer + 1],
                case.host_pages,
                to_host,
                error=error,
            )

    batched_us, per_layer_us = timed(batched), timed(per_layer)
    check_resolution_error(int(error))
    return {
        "batched_us": batched_us,
        "per_layer_us": per_layer_us,
        "batched_gbps": nbytes / (batched_us * 1e3),
        "bytes": nbytes,
    }


def check_out_of_bounds_kernels() -> dict:
    """The kernels skip out-of-bounds indices and raise their bit; nothing is written."""
    from vllm.v1.hisparse.resolver import ERROR_PAGE_OUT_OF_BOUNDS, ERROR_ROW_OUT_OF_BOUNDS, copy_host_rows

    kv = torch.zeros((8, 656), dtype=torch.uint8, device="cuda")
    host = torch.full((4, 656), 7, dtype=torch.uint8).pin_memory()
    error = torch.zeros((), dtype=torch.int64, device="cuda")
    copy_host_rows(
        kv,
        torch.tensor([8, 1], device="cuda"),
        host,
        torch.tensor([0, 4], device="cuda"),
        torch.ones(2, dtype=torch.bool, device="cuda"),
        error=error,
    )
    torch.cuda.synchronize()
    rows_ok = int(error) == ERROR_ROW_OUT_OF_BOUNDS and not kv.any()
    # Two layers in one block-outermost allocation: layer 0's rows view spans layer 1's
    # pages between its blocks (block stride 8 rows, 4 of them layer 0's).
    storage = torch.zeros((3, 2, 4, 656), dtype=torch.uint8, device="cuda")
    error.zero_()
    copy_host_rows(
        storage.flatten().as_strided((2 * 8 + 4, 656), (656, 1)),
        torch.tensor([1, 8 + 5], device="cuda"),
        host,
        torch.tensor([0, 1], device="cuda"),
        torch.ones(2, dtype=torch.bool, device="cuda"),
        error=error,
        block_stride_rows=8,
        block_rows=4,
    )
    torch.cuda.synchronize()
    layer_ok = int(error) == ERROR_ROW_OUT_OF_BOUNDS and bool(storage[0, 0, 1].eq(7).all())
    layer_ok = layer_ok and not storage[:, 1].any()
    case = page_copy_case(2, 2, 656, device="cuda")
    expected = case.storage.cpu()
    expected[0, 0] = case.host_pool[0, 0]  # page 0 of layer 0 is in bounds and copied
    error.zero_()
    # copy_pages refuses out-of-bounds indices on the host before they reach the device;
    # hand the op device indices directly to reach the in-kernel checks.
    torch.ops._hisparse_C.copy_pages(
        case.caches,
        case.host_pool,
        torch.tensor([[0, 99], [1, 2]], device="cuda"),
        torch.tensor([0, 1000], device="cuda"),
        False,
        error,
    )
    torch.cuda.synchronize()
    pages_ok = int(error) == ERROR_PAGE_OUT_OF_BOUNDS and torch.equal(case.storage.cpu(), expected)
    return {
        "row_copy_flags_and_skips": rows_ok,
        "row_copy_stays_in_its_layer": layer_ok,
        "page_copy_flags_and_skips": pages_ok,
    }


WORKER_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def worker_step(device: str, seed: int = 0) -> dict:
    """One step of the worker's resolution glue (`HiSparseResolution`: a plan's deltas,
    the step's start, both layers' resolution, the step's end) on `device`, over seeded
    inputs built on the CPU: a 100-token prefill chunk over four HOST pages, with staging
    for all of them, beside two decodes with one HOST page each, top-K 64, 656-byte rows;
    then its post-forward page copies (two pages of both layers into host pages 6 and 7)
    as the worker launches them (`PageCopyStream`: on CUDA a copy stream).
    Returns each layer's resolved rows and cache, the device counters and error word (on
    `device`: reading them is the caller's, after the step), the host counters and the
    copies' launch (None where they ran in place)."""
    from types import SimpleNamespace

    from vllm.v1.hisparse.page_copy import PageCopyStream
    from vllm.v1.hisparse.plan import HostPageRun, HotLeaseUpdate, StepStaging
    from vllm.v1.hisparse.resolution import HiSparseResolution

    g = torch.Generator().manual_seed(seed)
    topk, hot_rows, blocks, width = 64, 128, 40, 656
    order = ["d0", "long", "d1"]
    scheduled = {"d0": 1, "long": 100, "d1": 1}
    # Context before the step's tokens, and the HOST pages of each request.
    context = {"d0": 200, "long": 320, "d1": 150}
    host_pages = {"d0": [0], "long": [0, 1, 2, 3], "d1": [0]}
    pool_shape = (len(WORKER_LAYERS), 8, BLOCK, width)
    host_pool = torch.randint(0, 256, pool_shape, dtype=torch.uint8, generator=g)
    if device == "cuda":
        host_pool = host_pool.pin_memory()
    caches = [torch.zeros((blocks * BLOCK, width), dtype=torch.uint8, device=device) for _ in WORKER_LAYERS]
    batch = SimpleNamespace(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)})
    resolution = HiSparseResolution(
        SimpleNamespace(input_batch=batch),
        dict.fromkeys(WORKER_LAYERS, 0),
        dict.fromkeys(WORKER_LAYERS, 0),
        BLOCK,
        hot_rows,
        host_pool,
        torch.device(device),
        max_pages=16,
    )
    next_host = iter(range(8))
    updates = [HostPageRun(r, p, (next(next_host),)) for r in order for p in host_pages[r]]
    leases = [HotLeaseUpdate(r, ((1 + 2 * i, 2 + 2 * i),)) for i, r in enumerate(order)]
    staging = [StepStaging("long", 2 * BLOCK, ((10, 11),))]
    positions = torch.cat(
        [torch.randint(0, context[r] + n, (n, topk), generator=g) for r, n in scheduled.items()]
    ).to(torch.int32)
    counts = torch.tensor([scheduled[r] for r in order])
    batch_rows = torch.repeat_interleave(torch.arange(len(order)), counts)
    rows = torch.zeros_like(positions, dtype=torch.int64)  # the backend's conversion: HOST -> the null block
    on = {"positions": positions, "batch_rows": batch_rows, "rows": rows}
    on = {k: v.to(device, non_blocking=True) for k, v in on.items()}
    resolution.update(updates, leases, staging)
    resolution.start_step(scheduled)
    resolved = []
    for layer, cache in zip(WORKER_LAYERS, caches, strict=True):
        assert resolution.resolves(layer)
        resolved.append(
            resolution.resolve_rows(layer, on["positions"], on["batch_rows"], on["rows"], cache, BLOCK)
        )
    device_counts, error, host_counts, _ = resolution.end_step()
    # The post-forward copies: blocks 1 and 3 (the decodes' hot rows, just filled) of both
    # layers into host pages 6 and 7, on the index tensors the worker pins.
    block_ids, pages = torch.tensor([[1, 1], [3, 3]]), torch.tensor([6, 7])
    if device == "cuda":
        block_ids, pages = block_ids.pin_memory(), pages.pin_memory()
    copies_out = PageCopyStream(torch.device(device)).launch(
        lambda word: copy_pages(
            [c.view(blocks, BLOCK, width) for c in caches],
            host_pool,
            block_ids,
            pages,
            to_host=True,
            error=word,
        ),
        error,
    )
    return {
        "resolved": resolved,
        "caches": caches,
        "device_counts": device_counts,
        "error": error,
        "host_counts": host_counts,
        "positions": positions,
        "host_pool": host_pool,
        "host_pages": {r: [p for u in updates if u.request_id == r for p in u.host_pages] for r in order},
        "order": order,
        "scheduled": scheduled,
        "copies_out": copies_out,
    }


def on_the_host(step: dict) -> dict:
    """A `worker_step` result with its device values read (after the step and its copies)."""
    copies_out = step["copies_out"]
    if copies_out is not None:
        copies_out.event.synchronize()
    return {
        "resolved": [r.cpu() for r in step["resolved"]],
        "caches": [c.cpu() for c in step["caches"]],
        "device_counts": step["device_counts"].cpu(),
        "error": int(step["error"]) | (int(copies_out.error[0]) if copies_out is not None else 0),
        "host_counts": step["host_counts"],
        "copied": step["host_pool"][:, 6:8].clone(),
    }


def host_entries_read_true_rows(step: dict) -> bool:
    """Whether every selected position on a HOST page resolved to a cache row holding that
    position's row of the host pool, in every layer."""
    positions, pool = step["positions"], step["host_pool"].cpu()
    token = 0
    for request in step["order"]:
        pages = step["host_pages"][request]
        for _ in range(step["scheduled"][request]):
            for k, p in enumerate(positions[token].tolist()):
                if p // BLOCK >= len(pages):
                    continue  # a resident position: the backend's own row
                for layer, (resolved, cache) in enumerate(zip(step["resolved"], step["caches"], strict=True)):
                    row = cache[int(resolved[token, k])].cpu()
                    if not torch.equal(row, pool[layer, pages[p // BLOCK], p % BLOCK]):
                        return False
            token += 1
    return True


def check_worker_step_without_host_waits() -> dict:
    """The worker step on CUDA under `torch.cuda.set_sync_debug_mode("error")` (any call
    that makes the host wait for the GPU raises), against the same step on the CPU."""
    reference = on_the_host(worker_step("cpu"))
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = worker_step("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    on_gpu = on_the_host(step)
    same = all(
        torch.equal(a, b)
        for key in ("resolved", "caches")
        for a, b in zip(on_gpu[key], reference[key], strict=True)
    ) and torch.equal(on_gpu["device_counts"], reference["device_counts"])
    # The copies landed, off the model's stream: the host pages hold the blocks' bytes.
    same = same and torch.equal(on_gpu["copied"], reference["copied"])
    true_rows = host_entries_read_true_rows(step)
    return {"bit_exact": same and true_rows and on_gpu["error"] == reference["error"] == 0, "host_waits": 0}


def check_registered_host_pool(layers: int = 2, pages: int = 4, row_bytes: int = 656) -> dict:
    """The production host pool (`HostPoolMemory`: one mmap, `cudaHostRegister`ed, not a torch
    pinned allocation) passes the ops' pinned checks and is read by the row copy kernel and
    both page copy directions, byte for byte."""
    from vllm.v1.hisparse.host_memory import HostPoolMemory
    from vllm.v1.hisparse.resolver import copy_host_rows

    g = torch.Generator().manual_seed(6)
    memory = HostPoolMemory((layers, pages, BLOCK, row_bytes), torch.uint8, register=True)
    try:
        pool = memory.tensor
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, generator=g))
        # Row copies: host rows 5 and 200 of layer 0 into device rows 3 and 7.
        kv = torch.zeros((16, row_bytes), dtype=torch.uint8, device="cuda")
        error = torch.zeros((), dtype=torch.int64, device="cuda")
        host_rows = pool[0].flatten(0, 1)
        copy_host_rows(
            kv,
            torch.tensor([3, 7]).cuda(),
            host_rows,
            torch.tensor([5, 200]).cuda(),
            torch.ones(2, dtype=torch.bool).cuda(),
            error=error,
        )
        rows_ok = torch.equal(kv[3].cpu(), host_rows[5]) and torch.equal(kv[7].cpu(), host_rows[200])
        # Page copies: host page 1 -> device block 2 of each layer, then back into host page 3.
        caches = [torch.zeros((4, BLOCK, row_bytes), dtype=torch.uint8, device="cuda") for _ in range(layers)]
        blocks = torch.full((1, layers), 2, dtype=torch.int64)
        copy_pages(caches, pool, blocks, torch.tensor([1]), to_host=False, use_kernel=True, error=error)
        copy_pages(caches, pool, blocks, torch.tensor([3]), to_host=True, use_kernel=True, error=error)
        torch.cuda.synchronize()
        pages_ok = all(torch.equal(caches[lay][2].cpu(), pool[lay, 1]) for lay in range(layers))
        pages_ok = pages_ok and torch.equal(pool[:, 3], pool[:, 1])
        return {
            "bit_exact": rows_ok and pages_ok and int(error) == 0,
            "is_pinned": bool(pool.is_pinned()),
            "rows": rows_ok,
            "pages": pages_ok,
        }
    finally:
        memory.release()
