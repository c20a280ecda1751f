# SPDX-License-Identifier: Apache-2.0
"""The descriptors NixlConnector's host landing reads with: layers located in the
registered regions, and each landed page of each layer read from the remote block
that holds it into its host page.

The descriptors are carried out here byte for byte (ctypes.memmove from each
remote descriptor to its local one), over two KV cache layouts: one packed region
whose block row holds every layer's page (DSA groups in a block-outermost layout),
and one region per layer. The host pages must then hold exactly the remote rows.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
    NULL_BLOCK_ID,
    RegionLayout,
    check_remote_layout,
    landing_descriptors,
    locate_layers,
    names_null_block,
)

NUM_BLOCKS, BLOCK, WIDTH = 12, 4, 6
LAYERS = {"layers.0.attn": 0, "layers.1.attn": 1}  # one layer per sparse-MLA group


def packed_cache(seed: int) -> tuple[dict[str, torch.Tensor], RegionLayout]:
    """One region: each block row holds both layers' pages, then an indexer page."""
    generator = torch.Generator().manual_seed(seed)
    storage = torch.randn(NUM_BLOCKS, 3, BLOCK, WIDTH, generator=generator)
    caches = {name: storage[:, i] for i, name in enumerate(LAYERS)}
    row = storage[0].numel() * storage.element_size()
    return caches, RegionLayout((storage.data_ptr(),), (row,), (row,))


def per_layer_cache(seed: int) -> tuple[dict[str, torch.Tensor], RegionLayout]:
    generator = torch.Generator().manual_seed(seed)
    caches = {name: torch.randn(NUM_BLOCKS, 1, BLOCK, WIDTH, generator=generator) for name in LAYERS}
    page = BLOCK * WIDTH * 4
    bases = tuple(cache.data_ptr() for cache in caches.values())
    return caches, RegionLayout(bases, (page,) * len(bases), (page,) * len(bases))


def carry_out(local: np.ndarray, remote: np.ndarray) -> None:
    assert local.shape == remote.shape and (local[:, 1] == remote[:, 1]).all()
    for (dst, length, _), (src, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        ctypes.memmove(dst, src, length)


@pytest.mark.parametrize("layout", [packed_cache, per_layer_cache])
def test_landed_pages_hold_the_remote_blocks_rows(layout):
    local_caches, local_regions = layout(0)
    remote_caches, remote_regions = layout(1)
    layers = locate_layers(local_caches, LAYERS, local_regions)
    assert [layer.group for layer in layers] == [0, 1]
    check_remote_layout(local_regions, remote_regions)
    host = torch.zeros(len(LAYERS), 5, BLOCK, WIDTH)
    host_pages = {name: host[i] for i, name in enumerate(LAYERS)}
    # The remote request's blocks per group; pages 0 and 2 land in host pages 4 and 1.
    remote_blocks = [[7, 3, 9, 2], [5, 11, 8, 6]]
    landing = {0: 4, 2: 1}
    local, remote = landing_descriptors(layers, landing, remote_blocks, remote_regions, host_pages)
    assert len(local) == len(LAYERS) * len(landing)
    carry_out(local, remote)
    for i, (name, group) in enumerate(LAYERS.items()):
        remote_pages = remote_caches[name].reshape(NUM_BLOCKS, BLOCK, WIDTH)
        for page, host_page in landing.items():
            assert torch.equal(host[i, host_page], remote_pages[remote_blocks[group][page]])
        untouched = [p for p in range(5) if p not in landing.values()]
        assert not host[i, untouched].any(), "no other host page is written"


def test_a_layer_outside_every_region_is_refused():
    caches, regions = per_layer_cache(0)
    elsewhere = RegionLayout(regions.bases[:1], regions.strides[:1], regions.lengths[:1])
    with pytest.raises(ValueError, match="layers.1.attn"):
        locate_layers(caches, LAYERS, elsewhere)


def test_a_remote_laid_out_otherwise_is_refused():
    _, local = packed_cache(0)
    _, remote = per_layer_cache(1)
    with pytest.raises(ValueError, match="same model"):
        check_remote_layout(local, remote)


def test_a_landed_page_without_a_remote_device_block_is_refused():
    caches, regions = packed_cache(0)
    layers = locate_layers(caches, LAYERS, regions)
    host = torch.zeros(len(LAYERS), 2, BLOCK, WIDTH)
    host_pages = {name: host[i] for i, name in enumerate(LAYERS)}
    with pytest.raises(ValueError, match="no device block"):
        landing_descriptors(layers, {1: 0}, [[3, NULL_BLOCK_ID], [4, 5]], regions, host_pages)
    with pytest.raises(ValueError, match="has 2 blocks"):
        landing_descriptors(layers, {2: 0}, [[3, 4], [4, 5]], regions, host_pages)


def test_the_null_block_is_named_only_in_the_groups_asked_about():
    blocks = ([1, 2], [NULL_BLOCK_ID, 3], [4, 5])
    assert names_null_block(blocks, (0, 1))
    assert not names_null_block(blocks, (0, 2))


# -- peer-supplied block ids, checked before any descriptor is built ------------------


@pytest.mark.parametrize(
    "block_ids, problem",
    [
        ([[1, 2], [3, 4]], None),
        ([[0, 11], []], None),
        ([[1, 2]], "name 1 KV cache groups"),
        ({"0": [1]}, "name dict KV cache groups"),
        ([[1, 2], 5], "group 1 are not a list"),
        ([[-5, 2], [3]], "block -5 in group 0"),
        ([[1, 12], [3]], "block 12 in group 0"),
        ([[1], [123456]], "block 123456 in group 1"),
        ([[1], [True]], "block True"),
        ([[1], ["3"]], "block '3'"),
        ([[1], [2.0]], "block 2.0"),
        ([[*range(12), 1], [1]], "names 13 blocks in group 0"),
    ],
)
def test_a_peers_block_ids_must_lie_within_its_announced_blocks(block_ids, problem):
    from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
        remote_block_ids_problem,
    )

    found = remote_block_ids_problem(block_ids, 2, NUM_BLOCKS)
    assert (found is None) if problem is None else (problem in found), found


def test_a_peer_naming_fewer_blocks_than_this_instance_reads_fails_the_load_not_the_engine(monkeypatch):
    """Upstream's read asserts that the peer names at least as many blocks per group as the
    decode instance reads, where each side's logical block is one physical block of the
    same tokens: a peer that named fewer stopped the engine. Where the sides count blocks
    differently (a peer with more physical blocks per logical one, decode context
    parallelism), upstream pairs them itself and the counts are not compared."""
    from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
        remote_block_ids_problem,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    found = remote_block_ids_problem([[1, 2], [3]], 2, NUM_BLOCKS, local_counts=[2, 2])
    assert found is not None and "1 blocks in group 1, fewer than the 2" in found
    assert remote_block_ids_problem([[1, 2], [3, 4, 5]], 2, NUM_BLOCKS, local_counts=[2, 2]) is None
    reads = []
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", lambda self, r, m: reads.append(r))
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS})
    worker._read_blocks_for_req("req", _meta([[1, 2], [3]]))
    assert reads == [] and worker.failures[-1] == ("failed", "req"), "the load fails, nothing is read"
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS}, remote_dcp=4)
    worker._landings = {}  # nothing lands in the host pool (a peer with DCP cannot)
    worker._read_blocks_for_req("req", _meta([[1], [3]]))
    assert not worker.failures, "the peer's blocks hold four times the tokens: not compared"


def _worker_stand_in(dst_num_blocks, ratio=1, remote_dcp=1):
    """A HostLandingNixlWorker without NIXL: the state `_read_blocks_for_req` reads, and its
    failure calls recorded."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
        HostLandingNixlWorker,
    )

    worker = object.__new__(HostLandingNixlWorker)
    worker.dst_num_blocks = dst_num_blocks
    worker.dcp_size = 1
    info = SimpleNamespace(remote_physical_blocks_per_logical=ratio, remote_dcp_size=remote_dcp)
    worker.transfer_topo = SimpleNamespace(get_engine_info=lambda engine_id: info)
    worker._landings = {"req": {0: 1}}
    worker.failures = []
    worker._log_failure = lambda **kw: worker.failures.append(("log", kw["failure_type"], kw["msg"]))
    worker._handle_failed_transfer = lambda req_id, handle: worker.failures.append(("failed", req_id))
    return worker


def _meta(remote_block_ids, num_groups=2):
    from types import SimpleNamespace

    remote = SimpleNamespace(engine_id="prefill-0", block_ids=remote_block_ids)
    return SimpleNamespace(remote=remote, local_block_ids=[[5, 6]] * num_groups)


def test_a_peer_naming_blocks_outside_its_handshake_fails_the_request_and_reads_nothing(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    reads = []
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req",
                        lambda self, req_id, meta: reads.append(req_id))  # fmt: skip
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS})
    worker._read_blocks_for_req("req", _meta([[1, 2], [-5, 123456]]))
    assert reads == []
    assert [f[0] for f in worker.failures] == ["log", "failed"]
    assert worker.failures[0][1] == "remote_block_ids_out_of_range" and "-5" in worker.failures[0][2]
    assert "req" not in worker._landings, "the landing of a refused read is dropped"
    # Physical blocks per logical block: the peer's logical count is its blocks / ratio.
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS}, ratio=4)
    worker._read_blocks_for_req("req", _meta([[1, 2], [3, 2]]))
    assert reads == [] and "block 3" in worker.failures[0][2]
    # Ids within the peer's blocks: upstream's read runs.
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS})
    worker._read_blocks_for_req("req", _meta([[1, 2], [3, 11]]))
    assert reads == ["req"] and worker.failures == []


def test_pages_do_not_land_from_a_peer_with_decode_context_parallelism(monkeypatch):
    """A peer with decode context parallelism holds an interleaved slice of the tokens on
    each rank, read one rank at a time; the landed pages are read whole from one rank. A
    request whose pages would land fails (the scheduler recomputes it or ends it, by
    `kv_load_failure_policy`); one landing nothing reads as upstream."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    reads = []
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req",
                        lambda self, req_id, meta: reads.append(req_id))  # fmt: skip
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS}, remote_dcp=2)
    worker._read_blocks_for_req("req", _meta([[1, 2], [3, 11]]))
    assert reads == [] and [f[0] for f in worker.failures] == ["log", "failed"]
    assert "decode context parallelism" in worker.failures[0][2]
    worker = _worker_stand_in({"prefill-0": NUM_BLOCKS}, remote_dcp=2)
    worker._landings = {}
    worker._read_blocks_for_req("req", _meta([[1, 2], [3, 11]]))
    assert reads == ["req"] and worker.failures == []


def test_only_an_instance_that_reads_imports_registers_its_host_pool(monkeypatch):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1 import host_landing_nixl_connector as landing

    def config(role):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(
            is_kv_consumer=role in ("kv_consumer", "kv_both")))  # fmt: skip

    assert [landing.lands_imports(config(r)) for r in ("kv_producer", "kv_consumer", "kv_both")] == [
        False, True, True,
    ]  # fmt: skip
    assert not landing.lands_imports(SimpleNamespace(kv_transfer_config=None))
    caches, regions = packed_cache(0)
    waited = []
    monkeypatch.setattr(landing, "when_host_pool_registered", waited.append)
    monkeypatch.setattr(landing.NixlPullConnectorWorker, "register_kv_caches", lambda self, kv: None)
    for role in ("kv_producer", "kv_consumer"):
        worker = object.__new__(landing.HostLandingNixlWorker)
        worker._group_of_landed_layer = LAYERS
        worker._lands_imports = landing.lands_imports(config(role))
        worker.engine_id, worker.tp_rank, worker.device_id = "e", 0, 0
        worker.kv_caches_base_addr = {"e": {0: list(regions.bases)}}
        worker.block_stride_per_layer = list(regions.strides)
        worker.block_len_per_layer = list(regions.lengths)
        worker.register_kv_caches(caches)
    assert len(waited) == 1, "the producer never waits to register the host pool; the consumer does"


@pytest.mark.parametrize("hisparse", [True, False])
def test_a_failed_read_names_the_requests_blocks_of_every_group_with_hisparse(hisparse):
    """Upstream's worker names a failed read's blocks of the first KV cache group only. With
    HiSparse that group is a sparse-MLA one, which lists none of the pages landing in the
    host pool: an import whose pages all landed would fail naming nothing. The worker names
    the request's blocks of every group (the resident group's name every imported page),
    never the null block; without HiSparse it names what upstream names."""
    import queue
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.host_landing_nixl_connector import (
        HostLandingNixlWorker,
    )

    worker = object.__new__(HostLandingNixlWorker)
    worker._recving_metadata = {"req": SimpleNamespace(local_block_ids=[[], [], [0, 9, 10, 11]])}
    worker._group_of_landed_layer = {"model.layers.0.self_attn.attn": 0} if hisparse else {}
    worker._is_hma_required = False
    worker._invalid_block_ids = queue.Queue()
    worker._failed_recv_reqs = queue.Queue()
    worker._recving_transfers, worker._failed_reads = {}, set()
    worker.xfer_stats = SimpleNamespace(record_failed_transfer=lambda: None)
    worker._handle_failed_transfer("req", None)
    assert worker.get_block_ids_with_load_errors() == ({9, 10, 11} if hisparse else set())
    assert worker._failed_recv_reqs.get_nowait() == "req"


class _FakeNixl:
    """The NIXL calls a landing request's two reads make; each read's state set by the test."""

    def __init__(self, device_setup_fails: bool):
        self.states: dict[str, str] = {}
        self.released: list[str] = []
        self.device_setup_fails = device_setup_fails

    def initialize_xfer(self, *args, **kwargs) -> str:
        self.states["landing"] = "PROC"
        return "landing"

    def get_xfer_descs(self, descs, memory_type):
        return descs

    def transfer(self, handle) -> None:
        pass

    def check_xfer_state(self, handle) -> str:
        return self.states[handle]

    def get_xfer_telemetry(self, handle):
        return None

    def release_xfer_handle(self, handle) -> None:
        self.released.append(handle)


def _two_read_worker(monkeypatch, *, landing_setup_fails=False, device_setup_fails=False):
    """A HostLandingNixlWorker without NIXL for request R, whose pages 0-1 land in host pages
    3-4: upstream's device read and `get_finished` run as they are, the device read's NIXL
    calls played (or its setup failing, as upstream's `transfer_setup_failed` branch does)."""
    import queue
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1 import host_landing_nixl_connector as landing

    worker = object.__new__(landing.HostLandingNixlWorker)
    worker.nixl_wrapper = _FakeNixl(device_setup_fails)
    worker._recving_transfers = {"R": []}
    remote = SimpleNamespace(engine_id="P", block_ids=[[1, 2, 3], [1, 2, 3]])
    worker._recving_metadata = {
        "R": SimpleNamespace(
            local_block_ids=[[9], [7, 8, 9]], local_physical_block_ids=[[9], [7, 8, 9]], remote=remote
        )
    }
    worker._group_of_landed_layer = {"model.layers.0.self_attn.attn": 0}
    worker._is_hma_required = False
    worker._invalid_block_ids, worker._failed_recv_reqs = queue.Queue(), queue.Queue()
    worker._failed_reads, worker._landing_not_started = set(), set()
    worker.xfer_stats = SimpleNamespace(
        record_failed_transfer=lambda: None, record_transfer=lambda result: None
    )
    worker.failures = []
    worker._log_failure = lambda **kw: worker.failures.append(kw["failure_type"])
    worker._landings = {"R": {0: 3, 1: 4}}
    worker._host_pages = {} if landing_setup_fails else {"model.layers.0.self_attn.attn": None}
    worker._landed_layers = []
    worker._remote_regions = {("P", 0): None}
    worker._remote_agents = {"P": {(0, 0): "agent"}}
    engine = SimpleNamespace(remote_block_size=BLOCK, remote_physical_blocks_per_logical=1)
    worker.transfer_topo = SimpleNamespace(
        get_engine_info=lambda engine_id: engine, block_size_ratio=lambda size: 1
    )
    worker._physical_blocks_per_logical_kv_block = 1
    worker.enable_permute_local_kv = worker.enable_heterogeneous_attn_post_process = False
    worker.use_host_buffer = False
    worker._get_new_notifs = set
    worker._sync_device_after_mamba_recv = lambda done, failed: None
    worker._reqs_to_send = {}
    worker.tp_rank = 0
    worker.nixl_memory_type = "VRAM"
    monkeypatch.setattr(landing, "landing_descriptors", lambda *args, **kwargs: ([], []))

    def device_read(self, read_spec, dst_engine_id, request_id, *args):
        if self.nixl_wrapper.device_setup_fails:
            self._log_failure(failure_type="transfer_setup_failed")
            self._handle_failed_transfer(request_id, None)
        else:
            self.nixl_wrapper.states["device"] = "PROC"
            self._recving_transfers[request_id].append("device")

    monkeypatch.setattr(landing.NixlPullConnectorWorker, "_read_blocks", device_read)
    read_spec = SimpleNamespace(remote_rank=0, remote_block_ids=remote.block_ids)
    worker._read_blocks(read_spec, "P", "R", "remote-R", 0, 0, 1)
    return worker


@pytest.mark.parametrize(
    "case",
    ["landing-setup-fails", "device-setup-fails", "landing-read-fails", "device-read-fails", "both-done"],
)
def test_a_landing_request_is_reported_finished_once_no_read_of_it_writes(monkeypatch, case):
    """A request whose pages land in the host pool has two NIXL reads: its device blocks and
    its landed host pages. Upstream reports a request finished at its first failed read,
    even with another read of it in flight: the scheduler then freed (policy "fail") or
    recomputed into (policy "recompute") device blocks and host pages the other read still
    wrote, and when that read ended the worker reported the request again and failed its
    assertion on the metadata it had already dropped. Now a failed read names the blocks
    at once (the scheduler holds a waiting request's blocks until it is reported finished),
    and the request is reported finished, failed, once none of its reads is in flight; one
    whose landing read cannot start starts no device read."""
    from types import SimpleNamespace

    worker = _two_read_worker(
        monkeypatch,
        landing_setup_fails=case == "landing-setup-fails",
        device_setup_fails=case == "device-setup-fails",
    )
    states = worker.nixl_wrapper.states
    if case == "landing-setup-fails":
        assert states == {}, "no read starts"
        # Upstream reads once per remote rank it reads from: a later rank's read starts
        # nothing either (its landing went with the first).
        read_spec = SimpleNamespace(remote_rank=1, remote_block_ids=[[4, 5, 6], [4, 5, 6]])
        worker._read_blocks(read_spec, "P", "R", "remote-R", 0, 0, 1)
        assert states == {}, "no read starts for another rank"
        assert worker.get_finished()[1] == {"R"}, "failed at once: nothing of it is in flight"
        assert worker.get_block_ids_with_load_errors() == {7, 8, 9}
        return
    if case == "landing-read-fails":
        states["landing"] = "ERR"
    elif case == "device-read-fails":
        states["device"] = "ERR"
    elif case == "both-done":
        states.update(landing="DONE", device="DONE")
    reads_left = [h for h in ("landing", "device") if states.get(h) == "PROC"]
    if reads_left:
        assert worker.get_finished()[1] == set(), f"{reads_left} still writes: R is not finished"
        assert worker.get_block_ids_with_load_errors() == {7, 8, 9}, "its blocks are named failed at once"
        assert worker._recving_transfers["R"] == reads_left
        for handle in reads_left:
            states[handle] = "DONE"
    # Reported once, with no read left; a failed one as failed (upstream's get_finished then
    # skips its post-processing).
    assert worker.get_finished()[1] == {"R"}
    assert "R" not in worker._recving_transfers and "R" not in worker._recving_metadata
    assert worker.get_finished()[1] == set()
    assert sorted(worker.nixl_wrapper.released) == sorted(h for h in ("landing", "device") if h in states)
    assert (case == "both-done") == (not worker.failures)
