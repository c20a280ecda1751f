# SPDX-License-Identifier: Apache-2.0
"""The page layout's KV cache groups under vLLM's real scheduler and HiSparse's.

One sparse-MLA group holds every sparse-MLA layer, so a page is one block; the
resident group's blocks hold several pages. benchmarks/page_layout.py measures
what that saves the scheduler; these tests hold that the real scheduler and
HiSparse's ownership check run on those groups, that the block pool's work per
page falls as the benchmark counts it, and that prefix hits (the device's and
the host prefix walk's) end on any page, a hit inside a resident block taking a
private copy of it.
"""

from __future__ import annotations

import collections
import json
import random
import sys

import pytest
import scheduler_harness as sh
import tiny_models
import torch

from vllm.v1.hisparse.kv_grouping import (
    INDEXER_LAYER_SUFFIX,
    choose_resident_block_multiple,
    hisparse_managed_group_ids,
)

sys.path.insert(0, str(sh.REPO / "benchmarks"))
import itertools

import page_layout

HISPARSE = {"hisparse_config": {"host_pool_gib": 0.05}}
PAGE = 64


def harness(layout: str) -> sh.SchedulerHarness:
    with page_layout.layout(layout):
        return sh.SchedulerHarness.create(
            num_blocks=600, attention_config=HISPARSE, max_num_batched_tokens=256, max_num_seqs=8
        )


def test_the_page_layout_is_one_sparse_mla_group_and_a_resident_group_of_wider_blocks():
    h = harness("page")
    groups = h.kv_cache_config.kv_cache_groups
    assert len(groups) == 2
    mla, resident = groups
    assert hisparse_managed_group_ids(groups) == (0,)
    assert mla.layer_names == [n for n in h.specs if not n.endswith(INDEXER_LAYER_SUFFIX)]
    assert resident.layer_names == [n for n in h.specs if n.endswith(INDEXER_LAYER_SUFFIX)]
    widths = [sum(h.specs[n].page_size_bytes for n in g.layer_names) for g in groups]
    m = choose_resident_block_multiple(*widths)
    assert m > 1
    assert mla.kv_cache_spec.block_size == PAGE
    assert resident.kv_cache_spec.block_size == m * PAGE
    assert resident.kv_cache_spec.page_size_bytes <= mla.kv_cache_spec.page_size_bytes


def byte_range(page) -> tuple[int, int]:
    """The bytes one block's (or kernel block's) view of one layer covers, as [start, end)."""
    assert page.is_contiguous(), "a page's rows are one run of bytes"
    start = page.storage_offset() * page.element_size()
    return start, start + page.numel() * page.element_size()


def test_the_workers_views_give_each_block_of_a_group_bytes_of_its_own_and_split_resident_blocks_into_pages():
    """The KV cache the workers allocate for the page layout, viewed as the kernels see it:
    a sparse-MLA layer's page per block, and each resident layer's 64-token kernel pages
    (m per block, vLLM's block table numbering block b's as b*m ... b*m + m - 1). Within a
    block of either group, no two views share a byte, and every view stays inside its block.
    Upstream's views refuse to split a block that several layers share."""
    import dataclasses

    from vllm.v1.hisparse.kv_grouping import page_layout_block_bytes
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    config = harness("page").kv_cache_config
    groups = config.kv_cache_groups
    block_bytes = page_layout_block_bytes(groups)
    assert block_bytes == config.kv_cache_tensors[0].block_stride
    num_blocks = 4
    small = dataclasses.replace(
        config,
        num_blocks=num_blocks,
        kv_cache_tensors=[
            dataclasses.replace(t, size=num_blocks * block_bytes) for t in config.kv_cache_tensors
        ],
    )
    views = allocate_kv_cache(
        small, torch.device("cpu"), KVCacheLayout.BLHNC, kernel_block_sizes=[PAGE, PAGE]
    )
    m = groups[1].kv_cache_spec.block_size // PAGE
    base = next(iter(views.values())).untyped_storage().data_ptr()
    for group, kernel_pages in ((groups[0], 1), (groups[1], m)):
        for block in range(num_blocks):
            ranges = []
            for name in group.layer_names:
                view = views[name]
                assert view.untyped_storage().data_ptr() == base, "every group overlays one allocation"
                assert view.shape[0] == num_blocks * kernel_pages
                ranges += [byte_range(view[block * kernel_pages + j]) for j in range(kernel_pages)]
            ranges.sort()
            assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges)), (
                group.layer_names,
                block,
            )
            assert block * block_bytes <= ranges[0][0] and ranges[-1][1] <= (block + 1) * block_bytes
    # The resident kernel pages are one slot apart, each with every resident layer's page.
    slot = block_bytes // m
    name = groups[1].layer_names[0]
    starts = [byte_range(views[name][k])[0] for k in range(num_blocks * m)]
    assert [b - a for a, b in itertools.pairwise(starts)] == [slot] * (num_blocks * m - 1)


LENGTHS = (150, 300, 70, 500, 640)
MAX_TOKENS = 24
PAGES = [-(-(n + MAX_TOKENS) // PAGE) for n in LENGTHS]  # each request's pages at its end


def run(layout: str) -> tuple[sh.SchedulerHarness, collections.Counter[str]]:
    """Five requests of one seed to the end, counting the block pool's work."""
    h = harness(layout)
    rng = random.Random(3)
    for n in LENGTHS:
        h.add_request([rng.randrange(1, 1000) for _ in range(n)], MAX_TOKENS)
    counts: collections.Counter[str] = collections.Counter()
    with page_layout.counting(counts):
        observations = h.run_until_done(max_steps=300)
    assert observations[-1].total_preemptions == 0
    assert all(len(r.output_token_ids) == MAX_TOKENS for r in h.requests.values())
    return h, counts


def test_requests_finish_in_the_page_layout_with_a_block_per_page_instead_of_one_per_group():
    groups, group_counts = run("groups")
    page, page_counts = run("page")
    num_groups = len(groups.kv_cache_config.kv_cache_groups)
    assert num_groups > 2
    assert group_counts["blocks allocated"] >= num_groups * sum(PAGES)
    m = page.kv_cache_config.kv_cache_groups[1].kv_cache_spec.block_size // PAGE
    # A page is one sparse-MLA block; each request's resident blocks cover its pages m at a time.
    assert page_counts["blocks allocated"] == sum(PAGES) + sum(-(-n // m) for n in PAGES)
    assert page_counts["blocks allocated"] * (num_groups - 1) < group_counts["blocks allocated"]


def scheduled_copies(h: sh.SchedulerHarness) -> list:
    """Records the block copies every step's scheduler output asks the workers for."""
    copies: list = []
    schedule = h.schedule

    def recording():
        output = schedule()
        copies.extend(output.kv_cache_block_copies or ())
        return output

    h.schedule = recording
    return copies


@pytest.mark.parametrize("layout", ["groups", "page"])
def test_a_repeated_prompt_hits_the_prefix_cache_to_the_page_in_either_layout(layout):
    """The page layout's resident block holds m pages; a hit ending inside one takes a
    private copy of it (vLLM's copy-on-write), which the workers make before the step."""
    h = harness(layout)
    copies = scheduled_copies(h)
    rng = random.Random(5)
    tokens = [rng.randrange(1, 1000) for _ in range(1000)]
    first = h.add_request(tokens, 4)
    while not first.is_finished():
        first_blocks = h.block_ids(first.request_id)
        h.step()
    assert not copies
    h.add_request(tokens, 4, request_id="again")
    hit = h.step().new_request_cached_tokens["again"]
    assert hit == (len(tokens) - 1) // PAGE * PAGE
    resident = h.kv_cache_config.kv_cache_groups[-1].kv_cache_spec.block_size
    if layout == "groups":
        assert resident == PAGE and not copies
    else:
        # The hit ends in the first request's second resident block: the new request's table
        # holds a copy of it.
        assert hit % resident
        (copy,) = copies
        again = h.block_ids("again")
        assert copy.src_block_id == first_blocks[-1][hit // resident]
        assert copy.dst_block_id == again[-1][hit // resident] != copy.src_block_id
    h.run_until_done(max_steps=100)


SIX_LAYERS = tiny_models.TinyModelSpec(arch="glm5", index_topk=32, num_hidden_layers=6)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 10 for i in range(length)]


def test_a_history_only_the_host_pool_holds_comes_back_to_the_page():
    """A finished request's 640-token prefix (ten pages) whose sparse-MLA blocks left the
    device prefix cache, its resident blocks still cached there and its pages in the host
    pool: the next request's walk takes the host pages of the resident blocks the device
    caches, to the last page the second block's partial entry holds (pages 0-9), and
    recomputes the rest."""
    with page_layout.layout("page"):
        h = sh.SchedulerHarness.create(
            model=sh.tiny_glm5_dir(SIX_LAYERS), memory_bytes=64 << 20, attention_config=HISPARSE
        )
    resident = h.kv_cache_config.kv_cache_groups[1].kv_cache_spec.block_size
    m = resident // PAGE
    assert m == 8, "six sparse-MLA layers against six indexer layers"
    shared = prompt(3, 640)
    first = h.add_request(shared + prompt(4, 20), max_tokens=8)
    h.step()
    mla_blocks = set(h.block_ids(first.request_id)[0])
    first_resident = h.block_ids(first.request_id)[1]
    h.run_until_done(max_steps=100)
    # vLLM caches a hybrid layout's blocks up to a whole resident block (hits end on one);
    # HiSparse commits the sparse-MLA pages beyond it too, so all ten complete pages of the
    # 668 tokens are copied (upstream's alignment alone left pages 8 and 9 uncopyable).
    assert h.hisparse.stats()["pages_copied_to_host"] == 668 // PAGE
    h.kv_cache_manager.evict_blocks(mla_blocks)

    copies = scheduled_copies(h)
    second = h.add_request(shared + prompt(5, 30), max_tokens=8)
    admitted = h.step()
    assert admitted.new_request_cached_tokens[second.request_id] == 640
    assert admitted.num_scheduled_tokens[second.request_id] == 670 - 640
    # Its second resident block is a copy of the first request's (pages 8 and 9 of it).
    (copy,) = copies
    assert copy.src_block_id == first_resident[1]
    assert copy.dst_block_id == h.block_ids(second.request_id)[1][1] != copy.src_block_id
    # It starts from host pages alone: its one page on the device, page 10, is not complete.
    assert h.hisparse.requests_started_none == 1
    assert admitted.hisparse_states[second.request_id] == "none"
    h.run_until_done(max_steps=100)
    stats = h.hisparse.stats()
    assert stats["host_prefix_pages_reused"] == 640 // PAGE and stats["hot_leases"] == 1
    assert h.total_preemptions == 0


def test_the_simulator_runs_the_page_layout_when_asked_and_says_so(tmp_path, monkeypatch):
    from vllm.v1.hisparse import kv_grouping
    from vllm.v1.hisparse.capacity.simulate import main

    calls = []
    page_groups = kv_grouping.page_layout_kv_cache_groups

    def spy(vllm_config, kv_cache_spec, layers=None):
        groups = page_groups(vllm_config, kv_cache_spec, layers)
        if groups is not None:  # None where HiSparse is off (the planner's other configurations)
            calls.append(len(groups))
        return groups

    monkeypatch.setattr(kv_grouping, "page_layout_kv_cache_groups", spy)
    argv = ["--model", "glm-5.3", "-tp", "8", "--workload", "openhands", "--concurrency", "2", "--turns", "2"]
    argv += ["--jobs", "1"]
    results = {}
    for layout in ("groups", "page"):
        out = tmp_path / f"{layout}.json"
        assert (
            main(
                [
                    *argv,
                    "--configs",
                    "hybrid",
                    "--kv-layout",
                    layout,
                    "--format",
                    "json",
                    "--output",
                    str(out),
                ]
            )
            == 0
        )
        results[layout] = json.loads(out.read_text())
        if layout == "groups":
            assert not calls, "HiSparse's own groups unless the page layout is asked for"
    assert calls and set(calls) == {2}, "one sparse-MLA group and the resident group"
    assert kv_grouping._kv_layout is None, "the choice ends with the run"
    assert [r["kv_layout"] for r in results.values()] == ["groups", "page"]
    for result in results.values():
        (record,) = result["records"]
        assert record["sessions_completed"] == 2 and record["requests_failed"] == 0
    # The serve flags' hisparse_config.kv_layout chooses it as well.
    text = tmp_path / "page.md"
    served = {"hisparse_config": {"host_pool_gib": 384, "kv_layout": "page"}}
    calls.clear()
    assert (
        main(
            [
                *argv,
                "--configs",
                "hybrid",
                "--attention-config",
                json.dumps(served),
                "--format",
                "markdown",
                "--output",
                str(text),
            ]
        )
        == 0
    )
    assert text.read_text().startswith("KV cache layout: page")
    assert calls and set(calls) == {2}


def test_an_unknown_kv_layout_is_refused():
    from vllm.v1.hisparse.kv_grouping import kv_layout

    with pytest.raises(ValueError, match="choose from groups, page"), kv_layout("pages"):
        pass


def test_no_hit_ends_inside_a_resident_block_that_a_request_writes_in_the_same_step():
    """The workers copy a block for a hit inside it before the step's forward, so a block
    whose pages a request computes in that step cannot be copied yet. With an MTP drafter
    (a hit drops its last page): a request sharing the first resident block of a prompt
    computed in the same step would end its hit inside that block; it ends at the block's
    first page instead. Once the block is computed, the same prefix hits to the page."""
    with page_layout.layout("page"):
        h = sh.SchedulerHarness.create(
            model=sh.tiny_glm5_dir(tiny_models.TINY_GLM53),
            num_blocks=600,
            attention_config=HISPARSE,
            max_num_batched_tokens=512,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
            accepted_drafts=lambda n: n,
            drafter_layers=True,
        )
    copies = scheduled_copies(h)
    resident = h.kv_cache_config.kv_cache_groups[-1].kv_cache_spec.block_size
    assert resident > PAGE
    rng = random.Random(6)
    tokens = [rng.randrange(1, 1000) for _ in range(2 * resident - 10)]
    first = h.add_request(tokens, 4)
    h.add_request(tokens[:resident] + [rng.randrange(1, 1000) for _ in range(40)], 4, request_id="sharing")
    step = h.step()
    assert step.num_scheduled_tokens[first.request_id] == len(tokens)
    assert step.new_request_cached_tokens["sharing"] == 0
    assert not copies
    first_resident = h.block_ids(first.request_id)[-1]
    h.run_until_done(max_steps=100)
    h.add_request(tokens[:resident] + [rng.randrange(1, 1000) for _ in range(40)], 4, request_id="later")
    assert h.step().new_request_cached_tokens["later"] == resident - PAGE
    (copy,) = copies
    assert copy.src_block_id == first_resident[0]
    h.run_until_done(max_steps=100)


def test_the_benchmark_runs_each_layout_it_names(tmp_path):
    """`benchmarks/page_layout.py` asks the simulator for each layout by its flag: the page
    layout's block pool allocates a block per page plus one per m pages, not 14 per page
    (when the simulator's own `--kv-layout` default overrode a layout set around it, both
    rows were HiSparse's groups)."""
    out = tmp_path / "page_layout.json"
    argv = ["--concurrency", "2", "--turns", "1", "--repeats", "1", "--scenarios", "pressure"]
    assert page_layout.main([*argv, "--output", str(out)]) == 0
    layouts = json.loads(out.read_text())["scenarios"]["pressure"]["layouts"]
    groups, page = (layouts[name]["work_per_step"]["blocks allocated"] for name in ("groups", "page"))
    assert page * 10 < groups
    assert layouts["page"]["new_prompt_tokens"] == layouts["groups"]["new_prompt_tokens"] > 0


def test_registering_a_history_in_the_page_layout_keeps_no_object_per_page():
    """A new turn's history is thousands of pages. With one sparse-MLA group, a page's
    entry is one block id, a tuple shared by every page of that block: registering the
    history allocates none, so it brings no young collection of the garbage collector
    nearer (each walks the new requests' token lists)."""
    import gc

    with page_layout.layout("page"):
        h = sh.SchedulerHarness.create(
            num_blocks=600,
            attention_config=HISPARSE,
            max_num_batched_tokens=1024,
            max_num_seqs=8,
            max_model_len=4096,
        )
    tokens = prompt(3, 3000)
    first = h.add_request(tokens, 2)
    while not first.is_finished():
        h.step()
    hisparse = h.scheduler.hisparse
    register = hisparse._register_pages
    kept: list[tuple[int, int]] = []  # (pages registered, objects the collector tracks more)

    def counting(request_id, record):
        pages_before = len(hisparse.residency.requests[request_id].pages)
        before = gc.get_count()[0]
        register(request_id, record)
        kept.append(
            (len(hisparse.residency.requests[request_id].pages) - pages_before, gc.get_count()[0] - before)
        )

    hisparse._register_pages = counting
    # Python reuses freed one-element tuples (up to 2,000) without counting them as
    # allocations; a long-running engine keeps its pages' tuples, so none are left to reuse.
    drained = [(i,) for i in range(4000)]
    gc.disable()
    try:
        h.add_request(tokens, 2, request_id="again")
        h.step()
    finally:
        gc.enable()
    del drained
    h.run_until_done(max_steps=100)
    pages, objects = kept[0]
    assert pages >= (len(tokens) - 1) // PAGE - 1, "the history hit the prefix cache and registered at once"
    assert objects < pages / 2, f"{objects} objects kept for {pages} pages"


def test_without_prefix_caching_the_page_layout_runs_and_publishes_nothing():
    """Without prefix caching vLLM hashes in the scheduler's block (a resident block, wider
    than the page): no page has a hash of its own, so none is published."""
    with page_layout.layout("page"):
        h = sh.SchedulerHarness.create(
            num_blocks=600, attention_config=HISPARSE, max_num_batched_tokens=256, max_num_seqs=8,
            enable_prefix_caching=False,
        )  # fmt: skip
    request = h.add_request(prompt(1, 700), max_tokens=4)
    h.run_until_done(max_steps=100)
    assert request.num_output_tokens == 4 and h.hisparse.stats()["pages_copied_to_host"] > 0
    assert all(h.hisparse.residency.host_pool.lookup(x) is None for x in request.block_hashes)


def loading_consumer(tmp_path, async_scheduling: bool = False) -> sh.SchedulerHarness:
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)}, kv_load_failure_policy="recompute",
    )  # fmt: skip
    with page_layout.layout("page"):
        return sh.SchedulerHarness.create(
            num_blocks=600, attention_config=HISPARSE, max_num_batched_tokens=4096, max_num_seqs=8,
            max_model_len=4096, kv_transfer_config=transfer, async_scheduling=async_scheduling,
        )  # fmt: skip


def stored(h: sh.SchedulerHarness, tokens: list[int]) -> None:
    import os

    from vllm.distributed.kv_transfer.kv_connector.v1.grouped_example_connector import COMPLETE_MARKER

    folder = h.scheduler.connector.prompt_folder(tokens, [])
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, COMPLETE_MARKER), "w").close()


def test_a_hit_inside_a_resident_block_a_load_fills_in_the_same_step_copies_none_of_it(tmp_path):
    """Y's stored prompt loads three resident blocks during this step's forward; S, admitted
    in the same step, shares Y's first 512 tokens, and its hit ended inside Y's first
    resident block, taking a copy of it. The workers copy blocks before the connector
    loads, so the copy read what the load had not written yet. A block a load fills this
    step is not final: S's hit stops before it."""
    h = loading_consumer(tmp_path)
    resident = h.kv_cache_config.kv_cache_groups[-1].kv_cache_spec.block_size
    y = prompt(1, 3 * resident + 10)
    stored(h, y)
    h.add_request(y, 4, request_id="Y")
    h.add_request(y[:resident], 4, request_id="S")
    output = h.schedule()
    assert output.num_scheduled_tokens["Y"] == 10, "Y loads its stored prefix in this forward"
    loaded = set(h.block_ids("Y")[-1][:3])
    sources = {c.src_block_id for c in output.kv_cache_block_copies or ()}
    assert not sources & loaded, "a copy reads a resident block before the load writes it"
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    h.run_until_done(max_steps=100)


def test_a_hit_takes_no_copy_of_a_resident_block_whose_load_is_not_confirmed(tmp_path):
    """Under asynchronous scheduling S's hit is scheduled before the output of the step
    that loaded Y's resident block; that load fails. S took a copy of the block, which no
    failure scan follows (they look for the failed block ids), and kept its unwritten KV
    as computed. A block of a load not yet confirmed is not final: S takes no copy."""
    from vllm.v1.outputs import KVConnectorOutput

    h = loading_consumer(tmp_path, async_scheduling=True)
    resident = h.kv_cache_config.kv_cache_groups[-1].kv_cache_spec.block_size
    y = prompt(1, 3 * resident + 10)
    stored(h, y)
    h.add_request(y, 4, request_id="Y")
    load_step = h.schedule()
    load_output = h.model_runner_output(load_step)
    first = h.block_ids("Y")[-1][0]
    h.add_request(y[:resident], 4, request_id="S")
    next_step = h.schedule()
    assert not [c for c in next_step.kv_cache_block_copies or () if c.src_block_id == first]
    computed = h.requests["S"].num_computed_tokens
    load_output.kv_connector_output = KVConnectorOutput(invalid_block_ids={first})
    h.scheduler.update_from_output(load_step, load_output)
    assert h.requests["Y"].num_computed_tokens == 0, "Y recomputes from its failed block"
    s_blocks = set(h.block_ids("S")[-1])
    assert first not in s_blocks or h.requests["S"].num_computed_tokens < computed, (
        "S counts the failed block's pages computed"
    )
    h.scheduler.update_from_output(next_step, h.model_runner_output(next_step))
    h.run_until_done(max_steps=200)
