"""A KV connector's import with Hybrid HiSparse, in vLLM's real Scheduler.

ExampleConnector (the grouped one this distribution registers) as a decode
instance's `kv_consumer`: a prompt whose stored prefix is in its shared storage
is a connector hit of every KV cache group. The six-layer tiny GLM-5 model has
six sparse-MLA groups and one indexer group, so a page is seven blocks, one of
them the indexer's. Under pressure the sparse-MLA pages of the import land in
the host pool: the request is admitted with the indexer's blocks, its tail and
a hot lease, starts NONE, and the connector's metadata sends those pages' rows
to the host pages HiSparse allocated. With room on the device the import lands
there, as upstream. The harness plays the worker's part; no bytes move here
(the e2e P/D test moves them).
"""

from __future__ import annotations

import os

import pytest
import tiny_models
from scheduler_harness import HISPARSE, SchedulerHarness, tiny_glm5_dir

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.grouped_example_connector import (
    COMPLETE_MARKER,
    GroupedExampleConnectorMetadata,
)

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


def consumer(model: str, storage, hisparse: bool, role: str = "kv_consumer") -> SchedulerHarness:
    """A decode instance's scheduler over 6 MiB of KV cache: twelve pages either way."""
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )  # fmt: skip
    h = SchedulerHarness.create(
        model=model, memory_bytes=KV_CACHE_BYTES, attention_config=HISPARSE if hisparse else None,
        max_model_len=640, max_num_batched_tokens=1024, kv_transfer_config=transfer,
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
