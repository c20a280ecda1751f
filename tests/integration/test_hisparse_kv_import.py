# SPDX-License-Identifier: Apache-2.0
"""A KV connector's import with Hybrid HiSparse, in vLLM's real Scheduler.

ExampleConnector (the grouped one this distribution registers) as a decode
instance's `kv_consumer`: a prompt whose stored prefix is in its shared storage
is a connector hit of every KV cache group. The six-layer tiny GLM-5 model has
six sparse-MLA groups and one indexer group, so a page is seven blocks, one of
them the indexer's. Under pressure the sparse-MLA pages of the import land in
the host pool: the request is admitted with the indexer's blocks, its tail and
a hot lease, starts NONE, and the connector's metadata sends those pages' rows
to the host pages HiSparse allocated. With room on the device the import lands
there, as upstream.

NixlConnector as a `kv_consumer`: a request that a prefill instance computed
arrives with the remote blocks in its `kv_transfer_params`, and NIXL reads them
asynchronously while the request waits. Under pressure the connector's metadata
tells the workers which host page each landed page takes, and the device read
covers only the indexer's pages and the tail; once the read is reported done,
the request is admitted NONE on exactly those host pages. A HiSparse producer
does not offer a request whose sparse-MLA pages are not all on its device. A
read that fails is recomputed; an import that landed in the host pool is
recomputed whole.

The harness plays the worker's part; no bytes move here (the e2e P/D test
moves them, over UCX for NIXL).
"""

from __future__ import annotations

import os

import pytest
import tiny_models
from scheduler_harness import HISPARSE, SchedulerHarness, record_lease_attempts, tiny_glm5_dir

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.grouped_example_connector import (
    COMPLETE_MARKER,
    GroupedExampleConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
    NULL_BLOCK_ID,
    HostLandingNixlConnector,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

BLOCK = 64
MLA_GROUPS = 6
PAGE_BLOCKS = MLA_GROUPS + 1
SIX_LAYERS = tiny_models.TinyModelSpec(arch="glm5", index_topk=32, num_hidden_layers=6)
KV_CACHE_BYTES = 6 << 20  # with HiSparse, twelve pages and the null block


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_glm5_dir(SIX_LAYERS))


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 10 for i in range(length)]


def consumer(
    model: str,
    storage,
    hisparse: bool,
    role: str = "kv_consumer",
    engine_args: dict | None = None,
    **transfer_args,
) -> SchedulerHarness:
    """A decode instance's scheduler over 6 MiB of KV cache: twelve pages either way."""
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(storage)}, **transfer_args,
    )  # fmt: skip
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, attention_config=HISPARSE if hisparse else None,
        max_model_len=640, max_num_batched_tokens=1024, kv_transfer_config=transfer, **(engine_args or {}),
    )  # fmt: skip
    assert h.kv_cache_config.num_blocks == (12 * PAGE_BLOCKS + 1 if hisparse else 12)
    return h


def store(h: SchedulerHarness, tokens: list[int]) -> int:
    """Mark the stored prefix of `tokens` complete in the connector's storage (as a producer
    would after writing its layers); its length in tokens."""
    connector = h.scheduler.connector
    folder = connector.prompt_folder(tokens, [])
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, COMPLETE_MARKER), "w").close()
    return connector.stored_prefix(len(tokens))


def busy(h: SchedulerHarness) -> None:
    """A locally computed request holding eight of the twelve pages, decoding."""
    h.add_request(prompt(0, 500), max_tokens=40, request_id="local")
    while h.requests["local"].num_output_tokens < 2:
        h.step()


def load_rows(scheduler_output, request_id: str):
    meta = scheduler_output.kv_connector_metadata
    assert isinstance(meta, GroupedExampleConnectorMetadata)
    (transfer,) = [t for t in meta.requests if t.request_id == request_id and not t.is_store]
    return transfer.rows


def test_under_pressure_an_import_lands_in_the_host_pool_and_is_admitted_at_once(model, tmp_path):
    h = consumer(model, tmp_path, hisparse=True)
    busy(h)
    free = h.num_free_blocks()
    tokens = prompt(1, 400)
    prefix = store(h, tokens)
    pages = prefix // BLOCK
    assert pages * PAGE_BLOCKS > free, "the import's pages exceed the free device blocks"
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens.get("imported") == len(tokens) - prefix
    residency = h.hisparse.residency.requests["imported"]
    landing = {i: page.host_page for i, page in enumerate(residency.pages) if page.block_ids is None}
    assert sorted(landing) == list(range(pages)), "every page of the import is HOST"
    rows = load_rows(output, "imported")
    mla_groups = set(h.hisparse.mla_group_ids)
    on_host = [r for r in rows if r.on_host]
    assert {r.group_id for r in on_host} == mla_groups and all(len(r.tokens) == prefix for r in on_host)
    expected = [landing[t // BLOCK] * BLOCK + t % BLOCK for t in range(prefix)]
    assert all(r.slots.tolist() == expected for r in on_host), "rows go to the host pages HiSparse allocated"
    device = [r for r in rows if not r.on_host]
    indexer_groups = set(range(h.num_groups)) - mla_groups
    assert {r.group_id for r in device} == indexer_groups, "the indexer lands on device"
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    stats = h.hisparse.stats()
    assert stats["pages_imported_to_host"] == pages and stats["requests_started_none"] == 1
    assert h.hisparse.residency.requests["imported"].state.value == "none"
    h.run_until_done()
    assert h.total_preemptions == 0
    assert all(req.num_output_tokens == req.max_tokens for req in h.requests.values())
    stats = h.hisparse.stats()
    assert stats["host_pages_used"] == 0 and stats["pages_host"] == 0, "everything returned"
    assert h.hisparse.residency.host_pool.lookup(h.requests["imported"].block_hashes[0]) is not None, (
        "the imported pages stay indexed for a later turn"
    )


@pytest.mark.parametrize("fails", [False, True], ids=["load-done", "load-fails"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_pages_that_land_during_the_forward_are_published_only_once_the_load_is_confirmed(
    model, tmp_path, policy, fails
):
    """Under pressure a connector that loads during the forward lands the import's pages in
    the host pool. They were published under the prompt's hashes when the request was
    scheduled, before the load ran: a failed load left them published, never filled, and
    with "recompute" the request recomputed its prompt into the placeholders of its table
    (the null block) while reading those host pages. Now they are published once the
    step's output confirms the load; a failed one ends the request with an error whatever
    the policy (a recompute cannot write pages the table holds as placeholders), and none
    of its pages is published."""
    h = consumer(model, tmp_path, hisparse=True, kv_load_failure_policy=policy)
    busy(h)
    tokens = prompt(1, 400)
    prefix = store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens.get("imported") == len(tokens) - prefix, "loaded in this forward"
    landed = [
        i for i, page in enumerate(h.hisparse.residency.requests["imported"].pages) if page.block_ids is None
    ]
    assert landed == list(range(prefix // BLOCK)), "every page of the import lands in the host pool"
    pool = h.hisparse.residency.host_pool
    hashes = h.requests["imported"].block_hashes
    assert all(pool.lookup(hashes[i]) is None for i in landed), "not published before the load has run"
    report = h.model_runner_output(output)
    if fails:
        loaded = {b for group in h.block_ids("imported") for b in group[: prefix // BLOCK] if b != 0}
        report.kv_connector_output = KVConnectorOutput(invalid_block_ids=loaded)
    h.scheduler.update_from_output(output, report)
    request = h.requests["imported"]
    published = [i for i in landed if pool.lookup(hashes[i]) is not None]
    if fails:
        assert request.status == RequestStatus.FINISHED_ERROR
        assert published == []
    else:
        assert published == landed, "published once the load is confirmed"
    h.run_until_done()
    assert all(
        r.num_output_tokens == r.max_tokens for rid, r in h.requests.items() if rid != "imported" or not fails
    )
    assert pool.num_referenced == 0 and h.num_free_blocks() == h.kv_cache_config.num_blocks - 1


def test_without_hisparse_the_same_import_waits_for_device_blocks(model, tmp_path):
    h = consumer(model, tmp_path, hisparse=False)
    busy(h)
    tokens = prompt(1, 400)
    store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert "imported" not in output.num_scheduled_tokens


def test_with_room_on_the_device_an_import_lands_there_as_upstream(model, tmp_path):
    h = consumer(model, tmp_path, hisparse=True)
    tokens = prompt(1, 200)
    prefix = store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens["imported"] == len(tokens) - prefix
    rows = load_rows(output, "imported")
    assert {r.group_id for r in rows} == set(range(h.num_groups)) and not any(r.on_host for r in rows)
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    assert h.hisparse.stats()["pages_imported_to_host"] == 0
    assert h.hisparse.residency.requests["imported"].state.value == "full"


def test_a_full_host_pool_lands_the_import_on_the_device(model, tmp_path):
    h = consumer(model, tmp_path, hisparse=True)
    busy(h)
    pool = h.hisparse.residency.host_pool
    taken = [pool.allocate() for _ in range(pool.num_available - 1)]
    tokens = prompt(1, 400)
    store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    rows = load_rows(output, "imported") if "imported" in output.num_scheduled_tokens else []
    assert not any(r.on_host for r in rows)
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    assert h.hisparse.stats()["pages_imported_to_host"] == 0
    for page in taken:
        pool.release(page)
    h.run_until_done()
    assert all(req.num_output_tokens == req.max_tokens for req in h.requests.values())
    assert h.hisparse.stats()["pages_imported_to_host"] == 0


@pytest.mark.parametrize("hisparse", [False, True])
def test_only_an_instance_without_hisparse_stores_prompts(model, tmp_path, hisparse):
    """A store is planned in one step and runs after that step's forward; with HiSparse the
    prompt's pages could leave the device in between, so such an instance stores nothing."""
    h = consumer(model, tmp_path, hisparse=hisparse, role="kv_both")
    h.add_request(prompt(2, 300), max_tokens=4, request_id="new")
    output = h.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, GroupedExampleConnectorMetadata)
    assert [t.request_id for t in meta.requests if t.is_store] == ([] if hisparse else ["new"])


def nixl_instance(model: str, role: str, hisparse: bool = True, **transfer_args) -> SchedulerHarness:
    """An instance over NixlConnector, with the same KV cache as `consumer`'s."""
    transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, **transfer_args)
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, attention_config=HISPARSE if hisparse else None,
        max_model_len=640, max_num_batched_tokens=1024, kv_transfer_config=transfer,
    )  # fmt: skip
    assert isinstance(h.scheduler.connector, HostLandingNixlConnector)
    return h


def remote_prefill(num_tokens: int, num_groups: int) -> dict:
    """kv_transfer_params of a request a prefill instance computed: its blocks per group."""
    pages = -(-num_tokens // BLOCK)
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [[100 * g + p + 1 for p in range(pages)] for g in range(num_groups)],
        "remote_engine_id": "prefill-engine", "remote_request_id": "remote-1",
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": num_tokens,
    }  # fmt: skip


def test_under_pressure_nixl_reads_the_landed_pages_into_the_host_pages_hisparse_allocated(model):
    h = nixl_instance(model, "kv_consumer")
    busy(h)
    tokens = prompt(1, 400)
    pages = -(-len(tokens) // BLOCK)
    assert pages * PAGE_BLOCKS > h.num_free_blocks(), "the import exceeds the free device blocks"
    h.add_request(
        tokens,
        max_tokens=8,
        request_id="imported",
        extra_args={"kv_transfer_params": remote_prefill(len(tokens), h.num_groups)},
    )
    output = h.schedule()
    assert "imported" not in output.num_scheduled_tokens, "the request waits for its read"
    meta = output.kv_connector_metadata
    landing = meta.host_landing["imported"]
    last_page = (len(tokens) - 1) // BLOCK
    assert sorted(landing) == list(range(last_page)), "whole pages before the last prompt page land"
    assert len(set(landing.values())) == len(landing)
    local = meta.reqs_to_recv["imported"].local_block_ids
    mla_groups = h.hisparse.mla_group_ids
    for g in range(h.num_groups):
        expected = pages - len(landing) if g in mla_groups else pages
        assert len(local[g]) == expected, f"group {g}: device blocks only for what lands on the device"
        assert NULL_BLOCK_ID not in local[g]
    h.scheduler.update_from_output(output, h.model_runner_output(output))

    # The workers report the read done: the request is admitted NONE on those host pages.
    done = h.schedule()
    finished = h.model_runner_output(done)
    finished.kv_connector_output = KVConnectorOutput(finished_recving={"imported"})
    h.scheduler.update_from_output(done, finished)
    admitted = h.schedule()
    tail = len(tokens) - last_page * BLOCK
    assert 0 < admitted.num_scheduled_tokens.get("imported", 0) <= tail, "only the tail is computed"
    residency = h.hisparse.residency.requests["imported"]
    on_host = {i: page.host_page for i, page in enumerate(residency.pages) if page.block_ids is None}
    assert on_host == landing, "the pages NIXL wrote are the pages the request reads"
    assert residency.state.value == "none"
    h.scheduler.update_from_output(admitted, h.model_runner_output(admitted))
    assert h.hisparse.stats()["pages_imported_to_host"] == len(landing)
    h.run_until_done()
    assert h.total_preemptions == 0
    assert all(req.num_output_tokens == req.max_tokens for req in h.requests.values())


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_an_import_from_a_peer_with_decode_context_parallelism_lands_on_the_device(model, dcp_size):
    """The same import under pressure, from a prefill instance with decode context
    parallelism (each rank holds an interleaved slice of the tokens, read rank by rank):
    its pages cannot land in the host pool, read whole from one rank, and the worker
    refuses such a read. So it lands on the device, as upstream's: it waits for room, and
    is then read and served. From a peer without it, the import lands in the host pool."""
    transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer")
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, attention_config=HISPARSE, max_model_len=640,
        max_num_batched_tokens=1024, kv_transfer_config=transfer, nixl_read_fails=lambda: False,
    )  # fmt: skip
    busy(h)
    tokens = prompt(1, 400)
    params = {**remote_prefill(len(tokens), h.num_groups), "dcp_size": dcp_size}
    h.add_request(tokens, max_tokens=8, request_id="imported", extra_args={"kv_transfer_params": params})
    h.run_until_done()
    assert h.nixl_counts["reads"] == 1
    assert h.nixl_counts["reads_landing_on_host"] == (dcp_size == 1)
    assert (h.hisparse.stats()["pages_imported_to_host"] > 0) == (dcp_size == 1)
    assert all(r.num_output_tokens == r.max_tokens for r in h.requests.values())


def test_with_room_on_the_device_nixl_reads_every_page_there_as_upstream(model):
    h = nixl_instance(model, "kv_consumer")
    tokens = prompt(1, 200)
    pages = -(-len(tokens) // BLOCK)
    h.add_request(
        tokens,
        max_tokens=8,
        request_id="imported",
        extra_args={"kv_transfer_params": remote_prefill(len(tokens), h.num_groups)},
    )
    meta = h.schedule().kv_connector_metadata
    assert meta.host_landing == {}
    assert [len(group) for group in meta.reqs_to_recv["imported"].local_block_ids] == [pages] * h.num_groups


def start_import(h: SchedulerHarness, tokens: list[int], max_tokens: int):
    """`tokens` as request "imported", which a prefill instance computed: the step that
    starts its read, in which it waits."""
    h.add_request(
        tokens, max_tokens=max_tokens, request_id="imported",
        extra_args={"kv_transfer_params": remote_prefill(len(tokens), h.num_groups)},
    )  # fmt: skip
    output = h.schedule()
    assert "imported" not in output.num_scheduled_tokens, "the request waits for its read"
    return output


def report_failed_read(h: SchedulerHarness, output, invalid: set[int]) -> None:
    """The read's step is processed; the next step's output reports the read done, failed,
    naming `invalid`."""
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    failing = h.schedule()
    report = h.model_runner_output(failing)
    report.kv_connector_output = KVConnectorOutput(finished_recving={"imported"}, invalid_block_ids=invalid)
    h.scheduler.update_from_output(failing, report)


def failed_read(meta, request_id: str, every_group: bool) -> set[int]:
    """The blocks a failed NIXL read names: the request's blocks of the first KV cache group,
    as upstream's worker names them, or of every group, as HostLandingNixlWorker does."""
    local = meta.reqs_to_recv[request_id].local_block_ids
    return {b for group in (local if every_group else local[:1]) for b in group}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("every_group", [True, False], ids=["every-group", "first-group"])
@pytest.mark.parametrize(
    ("hisparse", "lands_on_host"),
    [(False, False), (True, False), (True, True)],
    ids=["upstream", "device-landing", "host-landing"],
)
def test_a_failed_nixl_read_is_recomputed_and_its_landed_pages_never_read(
    model, hisparse, lands_on_host, every_group, policy
):
    """A decode instance's NIXL read fails (a prefill node lost, a transfer error): the
    request's blocks come back named invalid with it in `finished_recving`. Upstream's
    scan reads one KV cache group only and raised with HiSparse's groups, stopping the
    engine for every user. Now, with `kv_load_failure_policy` "recompute", the request
    recomputes from its first failed page, as upstream's does; an import that landed in
    the host pool is recomputed whole (its landed pages are placeholders in its table and
    their host pages were never filled). With "fail" (the default) it ends with an error,
    alone. Either way none of the landed pages is ever registered, read or published, and
    everything returns."""
    h = nixl_instance(model, "kv_consumer", hisparse, kv_load_failure_policy=policy)
    if lands_on_host:
        busy(h)
    tokens = prompt(1, 400 if lands_on_host else 200)
    output = start_import(h, tokens, max_tokens=8)
    meta = output.kv_connector_metadata
    landing = dict(meta.host_landing.get("imported", {}))
    assert bool(landing) == lands_on_host
    report_failed_read(h, output, failed_read(meta, "imported", every_group))
    request = h.requests["imported"]
    loaded = (len(tokens) - 1) // BLOCK * BLOCK
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
    elif lands_on_host:
        assert request.num_computed_tokens == 0, "an import that landed on the host is recomputed whole"
    else:
        assert request.num_computed_tokens < loaded, "the failed pages are recomputed"
    h.run_until_done()
    failed = {"imported"} if policy == "fail" else set()
    assert all(r.num_output_tokens == r.max_tokens for rid, r in h.requests.items() if rid not in failed)
    if hisparse:
        pool = h.hisparse.residency.host_pool
        # A landed page is published only once registered (residency's imported HOST pages).
        assert h.hisparse.stats()["pages_imported_to_host"] == 0, "no landed page was registered"
        assert pool.num_referenced == 0 and not list(h.hisparse.admissions.records())
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1, "every device block returns"


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("layout", ["groups", "page"])
def test_a_failed_read_past_a_local_hit_goes_back_to_the_hit_on_either_layout(model, layout, policy):
    """A decode instance holds the first 512 tokens of a prompt (a whole resident block of
    the page layout); NIXL reads the rest, and the read fails. Upstream's scan reads a
    table of one block id per `block_size` tokens; HiSparse hands it one per 64-token page
    while the page layout's `block_size` is a resident block's 512, so the scan looked at
    the first few pages only and missed the failure: with "recompute" the request kept
    every token, never written; with "fail" it went on, and the never-written blocks were
    cached for the next request of the same prompt. The scan now counts in pages."""
    transfer = KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_consumer", kv_load_failure_policy=policy
    )
    h = SchedulerHarness.create(
        model=model, num_blocks=600, max_model_len=2048, max_num_batched_tokens=2048,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05, "kv_layout": layout}},
        kv_transfer_config=transfer,
    )  # fmt: skip
    assert h.hisparse.blocks.resident_multiple == (8 if layout == "page" else 1)
    if layout == "page":
        assert h.scheduler.block_size == 8 * BLOCK
    local = prompt(1, 8 * BLOCK)
    h.add_request([*local, *prompt(2, 30)], max_tokens=1, request_id="local")
    h.run_until_done()
    tokens = [*local, *prompt(3, 1200 - len(local))]
    output = start_import(h, tokens, max_tokens=4)
    invalid = failed_read(output.kv_connector_metadata, "imported", every_group=True)
    report_failed_read(h, output, invalid)
    request = h.requests["imported"]
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
    else:
        assert request.num_computed_tokens == len(local), "the read's pages are recomputed"
    h.run_until_done()
    if policy == "fail":
        cached = sorted(b for b in invalid if h.block_pool.blocks[b].block_hash is not None)
        assert not cached, f"never-written blocks in the prefix cache: {cached}"
    h.add_request(tokens, max_tokens=1, request_id="again")
    again = h.schedule()
    if policy == "fail":  # its hit is the local history only: the failed pages are computed
        assert again.num_scheduled_tokens["again"] == len(tokens) - len(local)
    h.scheduler.update_from_output(again, h.model_runner_output(again))
    h.run_until_done()
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1, "every device block returns"


@pytest.mark.parametrize("hisparse", [False, True])
def test_a_failed_synchronous_load_takes_every_groups_blocks_out_of_the_prefix_cache(
    model, tmp_path, hisparse
):
    """A connector that loads during the forward (ExampleConnector's way) reports its load
    failed, and `kv_load_failure_policy` is "fail": every block the load was to fill was
    cached when it was allocated and must leave the prefix cache, or the next request of
    the prompt takes blocks whose KV was never written. Upstream's scan named one block
    per page, so with HiSparse's groups the other groups' blocks stayed cached."""
    h = consumer(model, tmp_path, hisparse, kv_load_failure_policy="fail")
    tokens = prompt(1, 200)
    prefix = store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens["imported"] == len(tokens) - prefix, "loaded in this forward"
    loaded = {b for group in h.block_ids("imported") for b in group[: prefix // BLOCK]}
    assert all(h.block_pool.blocks[b].block_hash is not None for b in loaded), "cached when allocated"
    report = h.model_runner_output(output)
    report.kv_connector_output = KVConnectorOutput(invalid_block_ids=loaded)
    h.scheduler.update_from_output(output, report)
    assert h.requests["imported"].status == RequestStatus.FINISHED_ERROR
    cached = sorted(b for b in loaded if h.block_pool.blocks[b].block_hash is not None)
    assert not cached, f"never-written blocks in the prefix cache: {cached}"
    h.run_until_done()
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_request_sharing_an_unconfirmed_loads_blocks_does_not_copy_them_either(model, tmp_path, policy):
    """vLLM caches a load's blocks when it allocates them, so a request admitted in the same
    step with the same prefix shares them through its device prefix hit. Its copies of
    those pages ran after the forward, and a failed load's pages were published through
    them, never written. Pages whose blocks an unconfirmed load fills wait for the load's
    output in whichever request holds them; a failed load's, as long as a request holds
    them: with "recompute" upstream lets one request recompute a shared failed block and
    the others count it computed meanwhile, and the recompute may take several steps
    (here chunks of 64 tokens), during which a copy would still read it unwritten."""
    h = consumer(
        model, tmp_path, hisparse=True, kv_load_failure_policy=policy,
        engine_args={"long_prefill_token_threshold": 64},
    )  # fmt: skip
    tokens = prompt(1, 200)
    prefix = store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    h.add_request([*tokens[:prefix], *prompt(5, 70)], max_tokens=8, request_id="sharer")
    output = h.schedule()
    assert output.num_scheduled_tokens["imported"] == len(tokens) - prefix, "loaded in this forward"
    loaded = {b for group in h.block_ids("imported") for b in group[: prefix // BLOCK]}
    assert {b for group in h.block_ids("sharer") for b in group} >= loaded, "the sharer's hit holds them"
    assert not [c for c in output.hisparse_plan.copies if set(c.block_ids) & loaded]
    report = h.model_runner_output(output)
    report.kv_connector_output = KVConnectorOutput(invalid_block_ids=loaded)
    h.scheduler.update_from_output(output, report)
    recomputing = h.requests["imported"]
    while h.busy():
        h.step()
        for copy in h.observations[-1].hisparse_plan.copies:
            if set(copy.block_ids) & loaded and not recomputing.is_finished():
                assert recomputing.num_computed_tokens >= (copy.page_index + 1) * BLOCK, (
                    f"{copy.request_id}'s page {copy.page_index} copied before the recompute wrote it"
                )
    pool = h.hisparse.residency.host_pool
    hashes = h.requests["imported"].block_hashes
    published = [i for i in range(prefix // BLOCK) if pool.lookup(hashes[i]) is not None]
    if policy == "fail":
        assert published == [], "nothing of the failed load reaches the host pool"
    assert pool.num_referenced == 0 and h.num_free_blocks() == h.kv_cache_config.num_blocks - 1


def test_a_failed_loads_pages_leave_the_prefix_cache_from_the_first_failed_one(model, tmp_path):
    """With "recompute" upstream leaves a failed load's blocks in the prefix cache for the
    request that recomputes them; aborted before it does, they stayed cached unwritten, and
    the next request of the prompt took them as its hit (and could copy them to the host
    pool). HiSparse takes the failed pages' blocks out of the prefix cache in every group,
    from the first failed page on: the pages before it were loaded and stay cached."""
    h = consumer(model, tmp_path, hisparse=True, kv_load_failure_policy="recompute")
    tokens = prompt(1, 200)
    prefix = store(h, tokens)
    assert prefix == 3 * BLOCK
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens["imported"] == len(tokens) - prefix, "loaded in this forward"
    table = h.block_ids("imported")
    page = {i: {group[i] for group in table} for i in range(3)}
    report = h.model_runner_output(output)
    report.kv_connector_output = KVConnectorOutput(invalid_block_ids=page[2])
    h.scheduler.update_from_output(output, report)
    assert h.requests["imported"].num_computed_tokens == 2 * BLOCK, "it recomputes from page 2"
    blocks = h.block_pool.blocks
    assert all(blocks[b].block_hash is None for b in page[2]), "the failed page left the prefix cache"
    assert all(blocks[b].block_hash is not None for b in page[0] | page[1]), "the loaded pages stay"
    h.abort(["imported"])  # before it recomputed page 2
    h.run_until_done()
    pool = h.hisparse.residency.host_pool
    assert pool.lookup(h.requests["imported"].block_hashes[2]) is None, "page 2 never reached the host pool"
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1 and pool.num_referenced == 0


@pytest.mark.parametrize("fails", [False, True], ids=["load-done", "load-fails"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_pages_a_load_fills_during_the_forward_are_copied_only_once_the_load_is_confirmed(
    model, tmp_path, policy, fails
):
    """A connector that loads during the forward (ExampleConnector's way) fills the pages of
    a request the step schedules; HiSparse's proactive copies run after that same forward.
    Copied in the load's own step, a failed load's pages reached the host pool and were
    published under the prompt's hashes, never written: with "recompute" they backed the
    recomputing request's BOTH pages, and either way another request's host hit could read
    them. Now the pages wait for the step's output: copied once the load is confirmed, and
    never when it failed."""
    h = consumer(model, tmp_path, hisparse=True, kv_load_failure_policy=policy)
    tokens = prompt(1, 200)
    prefix = store(h, tokens)
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens["imported"] == len(tokens) - prefix, "loaded in this forward"
    assert not [c for c in output.hisparse_plan.copies if c.page_index < prefix // BLOCK]
    loaded = {b for group in h.block_ids("imported") for b in group[: prefix // BLOCK]}
    report = h.model_runner_output(output)
    if fails:
        report.kv_connector_output = KVConnectorOutput(invalid_block_ids=loaded)
    h.scheduler.update_from_output(output, report)
    h.run_until_done()
    request = h.requests["imported"]
    assert request.status == (
        RequestStatus.FINISHED_ERROR if fails and policy == "fail" else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    pool = h.hisparse.residency.host_pool
    published = [i for i in range(prefix // BLOCK) if pool.lookup(request.block_hashes[i]) is not None]
    if fails and policy == "fail":
        assert published == [], "nothing of a failed load reaches the host pool"
    else:  # confirmed, or recomputed: its pages are copied, as any page
        assert published == list(range(prefix // BLOCK))
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1 and pool.num_referenced == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("lands", ["device", "host"])
def test_a_page_computed_past_a_failed_load_is_neither_cached_nor_copied(model, tmp_path, policy, lands):
    """A 448-token prompt whose 384-token prefix is stored: the step loads pages 0-5 and
    computes page 6 whole, attending over them. Under pressure the loaded pages land in
    the host pool, where a page has no device block to hold back, so page 6 was copied in
    that same step and published when the load failed; on the device it stayed cached
    (only the load's own pages left the prefix cache). Now page 6 waits for the load like
    its pages, and when the load fails it leaves the prefix cache and is never copied."""
    h = consumer(model, tmp_path, hisparse=True, kv_load_failure_policy=policy)
    if lands == "host":
        busy(h)
    tokens = prompt(1, 7 * BLOCK)
    assert store(h, tokens) == 6 * BLOCK
    h.add_request(tokens, max_tokens=8, request_id="imported")
    output = h.schedule()
    assert output.num_scheduled_tokens["imported"] == BLOCK, "page 6 is computed in the load's step"
    landed = [p.block_ids is None for p in h.hisparse.residency.requests["imported"].pages][:6]
    assert landed == [lands == "host"] * 6
    assert not [c for c in output.hisparse_plan.copies if c.request_id == "imported"]
    table = h.block_ids("imported")
    page6 = {group[6] for group in table}
    report = h.model_runner_output(output)
    report.kv_connector_output = KVConnectorOutput(
        invalid_block_ids={b for group in table for b in group[2:6]} - {NULL_BLOCK_ID}
    )
    h.scheduler.update_from_output(output, report)
    assert all(h.block_pool.blocks[b].block_hash is None for b in page6), "page 6 left the prefix cache"
    h.abort(["imported"])  # before a recompute wrote page 6 again
    h.run_until_done()
    pool = h.hisparse.residency.host_pool
    hashes = h.requests["imported"].block_hashes
    assert all(pool.lookup(hashes[i]) is None for i in range(2, 7)), "nothing past page 1 is published"
    assert h.num_free_blocks() == h.kv_cache_config.num_blocks - 1 and pool.num_referenced == 0
    # An OffloadingConnector beside the loading one may have stored their indexer keys.
    refused = [pool.is_withdrawn(hashes[i]) for i in range(7)]
    assert refused == [False, False] + [True] * 5, "a connector's hit stops before the failed pages"


def finished_producer_request(h: SchedulerHarness, request_id: str):
    """A prompt a producer computed for remote decode, finished after its one token."""
    request = h.add_request(
        prompt(3, 300),
        max_tokens=1,
        request_id=request_id,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    for _ in range(10):
        if request.is_finished():
            return request
        h.step()
    raise AssertionError(f"{request_id} did not finish: {request.status}")


@pytest.mark.parametrize("hisparse", [True, False])
def test_a_producer_offers_only_requests_whose_pages_are_all_on_its_device(model, hisparse):
    h = nixl_instance(model, "kv_producer", hisparse=hisparse)
    request = finished_producer_request(h, "prefilled")
    connector = h.scheduler.connector
    blocks = tuple([b + 1 for b in range(5)] for _ in range(h.num_groups))
    delay, params = connector.request_finished_all_groups(request, blocks)
    assert delay and params["remote_block_ids"] == blocks
    managed = h.hisparse.mla_group_ids if hisparse else (0,)
    placeholder = tuple(
        [NULL_BLOCK_ID, *group[1:]] if g == managed[0] else group for g, group in enumerate(blocks)
    )
    request.kv_transfer_params["do_remote_decode"] = True
    delay, params = connector.request_finished_all_groups(request, placeholder)
    if hisparse:
        assert (delay, params) == (False, None), "a page held only on the host is not offered"
        assert connector.connector_scheduler.declined_sends == 1
    else:
        assert delay and params["remote_block_ids"] == placeholder


def test_an_import_after_a_walk_that_found_no_room_for_a_lease_does_not_ask_again(
    model, tmp_path, monkeypatch
):
    """A session's next turn on a decode instance: the device still caches its history's
    indexer pages and the host pool its sparse-MLA pages, and the connector's storage holds
    the whole turn. The walk reaches the first host page, finds no room for a hot lease
    (demotion made none) and ends there; the connector then offers its import. That import
    lands on the device without asking for the lease a second time in the step: nothing
    that could make room has happened since, and a second relief would only mark more
    pages for demotion for the same turn."""
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )  # fmt: skip
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, max_model_len=640, max_num_batched_tokens=1024,
        attention_config={"hisparse_config": {**HISPARSE["hisparse_config"], "mode": "always"}},
        kv_transfer_config=transfer,
    )  # fmt: skip
    h.add_request(prompt(2, 300), max_tokens=2, request_id="E1")
    h.step()
    mla_blocks = {b for g in h.hisparse.mla_group_ids for b in h.block_ids("E1")[g]}
    h.run_until_done()
    h.kv_cache_manager.evict_blocks(mla_blocks)
    history = [*h.requests["E1"].prompt_token_ids, *h.requests["E1"].output_token_ids]
    pool = h.hisparse.residency.host_pool
    assert pool.lookup(h.requests["E1"].block_hashes[0]) is not None, "the host pool holds E1"
    admissions = h.hisparse.admissions
    monkeypatch.setattr(admissions, "_lease_blocks_for", lambda request: h.block_pool.num_gpu_blocks + 1)
    # Another request runs, so E2's hit is not capped as a lone request's is.
    h.add_request(prompt(4, 100), max_tokens=60, request_id="E-other")
    h.step()
    calls = record_lease_attempts(monkeypatch, admissions)
    turn = [*history, *prompt(3, 60)]
    assert store(h, turn) > len(history) // BLOCK * BLOCK, "the import covers the history"
    h.add_request(turn, max_tokens=4, request_id="E2")
    output = h.schedule()
    assert output.num_scheduled_tokens.get("E2"), "admitted, its import landing on the device"
    assert calls == ["walk"], f"lease attempts in E2's admission: {calls}"
    assert not any(r.on_host for r in load_rows(output, "E2")), "no lease: nothing lands on the host"
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    h.run_until_done()
    h.hisparse.check_ownership()


def landed_pages(scheduler_output) -> dict[str, set[int]]:
    """Request -> the host pages the step's ExampleConnector loads write."""
    meta = scheduler_output.kv_connector_metadata
    found: dict[str, set[int]] = {}
    for transfer in meta.requests:
        if not transfer.is_store:
            for rows in transfer.rows:
                if rows.on_host:
                    pages = {slot // BLOCK for slot in rows.slots.tolist()}
                    found.setdefault(transfer.request_id, set()).update(pages)
    return found


def test_a_landing_takes_no_host_page_a_forward_still_in_flight_may_read(model, tmp_path):
    """Under asynchronous scheduling a step is scheduled while the one before runs. A's
    import landed in the host pool and A reads those pages in the step in flight when it
    is aborted; its pages go back to the pool. The connector writes a landing's pages from
    the host as the next step starts, outside the device's stream order, so B's landing
    must not take them before that step's output is in: it took them, and would have
    overwritten rows A's forward could still be reading. Once the output is processed
    the pages are B's to take."""
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )  # fmt: skip
    page_gib = MLA_GROUPS * BLOCK * 576 * 2 / (1 << 30)
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, max_model_len=640, max_num_batched_tokens=1024,
        attention_config={"hisparse_config": {"host_pool_gib": 16.5 * page_gib}}, kv_transfer_config=transfer,
        async_scheduling=True,
    )  # fmt: skip
    outputs = []
    schedule = h.schedule
    h.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    busy(h)
    a, b = prompt(1, 7 * BLOCK), prompt(2, 7 * BLOCK)
    assert store(h, a) == store(h, b) == 6 * BLOCK
    h.add_request(a, max_tokens=30, request_id="A")
    for _ in range(20):
        if "A" in landed_pages(outputs[-1]):
            break
        h.step()
    a_pages = landed_pages(outputs[-1])["A"]
    assert len(a_pages) == 6, "A's import landed in the host pool"
    for _ in range(20):
        if h.requests["A"].num_output_tokens >= 2:
            break
        h.step()
    assert h._batches and "A" in h._batches[0][0].num_scheduled_tokens, "a step reading A's pages runs"
    h.abort(["A"])
    h.add_request(b, max_tokens=8, request_id="B")
    in_flight = len(h._batches)
    h.step()
    assert not landed_pages(outputs[-1]).get("B", set()) & a_pages, "B's landing writes pages A still reads"
    assert in_flight, "the step that read A's pages was still in flight"
    h.run_until_done()
    assert h.requests["B"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.hisparse.residency.host_pool.num_referenced == 0


def test_a_second_request_naming_a_peers_request_already_read_computes_its_prompt_here(model):
    """Signed parameters are accepted once per API server process (its record of used
    signatures is its own), so with several a replay reached the engine twice, and both
    requests read the peer's blocks, which the peer frees for its other requests once the
    first read is done. The engine reads a peer's request once: the second computes its
    prompt here, and the first is read as before."""
    h = nixl_instance(model, "kv_consumer")
    tokens = prompt(1, 200)
    params = remote_prefill(len(tokens), h.num_groups)
    for request_id in ("first", "replayed"):
        transfer = {"kv_transfer_params": dict(params)}
        h.add_request(tokens, max_tokens=4, request_id=request_id, extra_args=transfer)
    output = h.schedule()
    assert set(output.kv_connector_metadata.reqs_to_recv) == {"first"}, "the peer's blocks are read once"
    assert output.num_scheduled_tokens.get("replayed") == len(tokens), "the replay computes its prompt"
    assert h.scheduler.connector.connector_scheduler.repeated_reads_refused == 1
    h.scheduler.update_from_output(output, h.model_runner_output(output))
    done = h.schedule()
    finished = h.model_runner_output(done)
    finished.kv_connector_output = KVConnectorOutput(finished_recving={"first"})
    h.scheduler.update_from_output(done, finished)
    h.run_until_done()
    assert all(r.num_output_tokens == 4 for r in h.requests.values())


def test_a_stored_prompt_is_found_only_by_requests_of_its_own_cache_salt(model, tmp_path):
    """vLLM keeps cache salts (tenants) apart in its prefix cache; upstream's
    ExampleConnector named a stored prompt by its tokens alone, so another tenant's
    request of the same prompt loaded it (and under pressure its pages landed in the host
    pool, published under that request's hashes). The store is now named by the salt
    too (and by the LoRA adapter, which changes every layer's KV)."""
    producer = consumer(model, tmp_path, hisparse=False, role="kv_producer")  # one with HiSparse stores none
    tokens = prompt(1, 200)
    producer.add_request(tokens, max_tokens=1, request_id="stored", cache_salt="tenant-a")
    output = producer.schedule()
    (stored,) = [t for t in output.kv_connector_metadata.requests if t.is_store]
    assert stored.mm_hashes == ["cache_salt:8:tenant-a"], "the store is named by its salt"
    h = consumer(model, tmp_path, hisparse=True)
    folder = h.scheduler.connector.prompt_folder(tokens, ["cache_salt:8:tenant-a"])
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, COMPLETE_MARKER), "w").close()
    for request_id, salt in (("other", "tenant-b"), ("unsalted", None), ("own", "tenant-a")):
        h.add_request(tokens, max_tokens=2, request_id=request_id, cache_salt=salt)
        output = h.schedule()
        loads = {t.request_id for t in output.kv_connector_metadata.requests if not t.is_store}
        assert (request_id in loads) == (salt == "tenant-a"), f"{request_id} loads tenant-a's prompt"
        h.scheduler.update_from_output(output, h.model_runner_output(output))
        h.run_until_done()


def test_a_producers_request_keeps_its_pages_on_the_device_for_the_send(model):
    """A P/D producer's request (do_remote_decode) is sent from its device blocks once it
    ends. Mode "always" demoted its pages while it prefilled, the send found null blocks in
    its table and was declined, and the decode instance computed the whole prompt again.
    Mode "always" now leaves such a request's pages on the device (pressure still may not:
    `test_a_prompt_longer_than_the_device_that_asks_for_a_remote_decode_still_finishes`)."""
    transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer")
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, max_model_len=640, max_num_batched_tokens=128,
        attention_config={"hisparse_config": {**HISPARSE["hisparse_config"], "mode": "always"}},
        kv_transfer_config=transfer,
    )  # fmt: skip
    local = h.add_request(prompt(4, 400), max_tokens=4, request_id="local")
    request = finished_producer_request(h, "prefilled")
    assert h.scheduler.connector.connector_scheduler.declined_sends == 0, "the send found null blocks"
    assert NULL_BLOCK_ID not in h.block_ids("prefilled")[h.hisparse.mla_group_ids[0]]
    for _ in range(8):  # the connector holds its blocks for the reader meanwhile
        h.step()
    assert local.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.hisparse.stats()["pages_demoted"] > 0, "mode always demoted the local request's pages"
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
