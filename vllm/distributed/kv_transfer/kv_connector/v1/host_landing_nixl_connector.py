# SPDX-License-Identifier: Apache-2.0
"""NixlConnector that lands an import's sparse-MLA pages in the Hybrid HiSparse host pool.

Upstream's pull-mode NixlConnector registers each KV cache tensor with NIXL as
one region and reads a remote prefix block for block into the decode
instance's device blocks. With Hybrid HiSparse on a decode instance under
pressure, the scheduler lands the whole pages of an import in the host pool
instead (vllm/v1/hisparse/kv_import.py): their sparse-MLA groups hold null
placeholders, which upstream's scheduler drops from the block lists it sends,
so the device read covers only the tail and the indexer's pages. This class
keeps upstream's device read and adds a second one, straight into the host
pool:
- worker side: on an instance that reads imports (kv_consumer, kv_both) the
  host pool is registered with NIXL as host memory (DRAM) when the HiSparse
  worker announces it; a producer never registers it. Before any read, the
  peer's block ids are checked against the block count its handshake
  announced (`remote_block_ids_problem`): a request naming blocks outside
  them fails its load, and nothing is read. For each request with landed pages,
  one READ moves each landed page of each sparse-MLA layer from the remote
  block that holds it into the layer's host page (`landing_descriptors`);
- the producer frees its blocks once every read of the request notified it:
  both reads carry the notification, and each counts twice the usual number
  of consumers, so neither completing alone frees anything;
- scheduler side: the decode instance tells its workers the landed pages per
  request (`host_landing`, set by HiSparse's scheduler side), and a producer
  with HiSparse declines to send a request whose sparse-MLA pages are not all
  on its device (its block lists would name the null block): the decode
  instance then computes that prompt itself.

Both instances must have the same KV cache layout (the same model, dtype and
hisparse_config grouping), as upstream's NixlConnector already requires; a
remote whose regions differ from the local ones is refused at the handshake.
Host staging buffers (`kv_buffer_device: "cpu"`) are refused with
hisparse_config. Push mode (NixlPushConnector) is not changed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorMetadata,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.logger import init_logger
from vllm.v1.hisparse.kv_grouping import hisparse_managed_group_ids
from vllm.v1.hisparse.kv_import import HostLanding, when_host_pool_registered
from vllm.v1.hisparse.trust import MAX_VALID_S

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# The block id of BlockPool's null block (the first block it hands out): a placeholder
# for a page with no device block.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class LandedLayer:
    """Where one sparse-MLA layer's page of a block lies in the registered KV cache.

    `region`: the NIXL region (one per registered KV cache tensor, or one for a
    packed layout) holding the layer; `offset`: the page's byte offset within one
    block of that region; `group`: the layer's KV cache group.
    """

    name: str
    group: int
    region: int
    offset: int
    page_bytes: int


@dataclass(frozen=True)
class RegionLayout:
    """The regions one instance registered: base address, block stride and block length."""

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    lengths: tuple[int, ...]
    device_id: int = 0


def locate_layers(
    caches: Mapping[str, torch.Tensor], group_of_layer: Mapping[str, int], regions: RegionLayout
) -> list[LandedLayer]:
    """The region and offset of each layer in `group_of_layer`, from its cache tensor.

    A layer's page of block b starts at `bases[region] + b * strides[region] + offset`.
    """
    located = []
    for name, group in group_of_layer.items():
        cache = caches[name]
        page = cache[0]
        if not page.is_contiguous():
            raise ValueError(f"HiSparse NIXL landing: the page of layer {name} is not contiguous")
        page_bytes = page.numel() * cache.element_size()
        stride = cache.stride(0) * cache.element_size()
        address = cache.data_ptr()
        found = [
            (r, address - base) for r, (base, block_stride, length)
            in enumerate(zip(regions.bases, regions.strides, regions.lengths, strict=True))
            if block_stride == stride and 0 <= address - base and address - base + page_bytes <= length
        ]  # fmt: skip
        if len(found) != 1:
            raise ValueError(
                f"HiSparse NIXL landing: layer {name} (address {address:#x}, block stride {stride}) "
                f"lies in {len(found)} registered regions, not one"
            )
        region, offset = found[0]
        located.append(LandedLayer(name, group, region, offset, page_bytes))
    return located


def check_remote_layout(local: RegionLayout, remote: RegionLayout) -> None:
    """Refuse a remote whose regions are not laid out as the local ones (landing reads
    a layer's page at the local offset in the remote block)."""
    if (local.strides, local.lengths) != (remote.strides, remote.lengths):
        raise ValueError(
            "HiSparse NIXL landing: the remote instance's KV cache regions (block strides "
            f"{list(remote.strides)[:4]}, lengths {list(remote.lengths)[:4]}) differ from this "
            f"instance's ({list(local.strides)[:4]}, {list(local.lengths)[:4]}); start both "
            "instances with the same model, --kv-cache-dtype and hisparse_config"
        )


def landing_descriptors(
    layers: Sequence[LandedLayer],
    landing: Mapping[int, int],
    remote_blocks: Sequence[Sequence[int]],
    remote: RegionLayout,
    host_pages: Mapping[str, torch.Tensor],
) -> tuple[np.ndarray, np.ndarray]:
    """Local (host pool) and remote (KV cache) Nx3 NIXL descriptors, row for row, that
    read the landed pages: for each layer and each landed page p -> host page h,
    the layer's page of remote block `remote_blocks[group][p]` into its host page h.

    `remote_blocks`: the remote request's block ids per KV cache group, from its
    first page; `host_pages`: each layer's host pool view, [host page, ...].
    """
    positions = np.fromiter(landing.keys(), dtype=np.int64, count=len(landing))
    host = np.fromiter(landing.values(), dtype=np.int64, count=len(landing))
    local_parts, remote_parts = [], []
    for layer in layers:
        group_blocks = remote_blocks[layer.group]
        if positions.size and positions.max() >= len(group_blocks):
            raise ValueError(
                f"HiSparse NIXL landing: page {int(positions.max())} landed, but the remote "
                f"request has {len(group_blocks)} blocks in group {layer.group}"
            )
        blocks = np.asarray(group_blocks, dtype=np.int64)[positions]
        if (blocks == NULL_BLOCK_ID).any():
            raise ValueError(
                f"HiSparse NIXL landing: the remote request has no device block for a landed page "
                f"of group {layer.group}"
            )
        pool = host_pages[layer.name]
        host_stride = pool.stride(0) * pool.element_size()
        if pool[0].numel() * pool.element_size() != layer.page_bytes:
            raise ValueError(
                f"HiSparse NIXL landing: layer {layer.name}'s host page holds "
                f"{pool[0].numel() * pool.element_size()} bytes, its KV cache page {layer.page_bytes}"
            )
        local_parts.append(_descriptors(pool.data_ptr() + host * host_stride, layer.page_bytes, 0))
        remote_addresses = remote.bases[layer.region] + blocks * remote.strides[layer.region] + layer.offset
        remote_parts.append(_descriptors(remote_addresses, layer.page_bytes, remote.device_id))
    if not local_parts:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty
    return np.concatenate(local_parts), np.concatenate(remote_parts)


def _descriptors(addresses: np.ndarray, length: int, device_id: int) -> np.ndarray:
    out = np.empty((addresses.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addresses
    out[:, 1] = length
    out[:, 2] = device_id
    return out


def remote_block_ids_problem(
    block_ids: Any, num_groups: int, num_blocks: int, local_counts: Sequence[int] = ()
) -> str | None:
    """What is wrong with a peer's block ids for one request, or None: they must be one list
    per KV cache group of this instance, each of at most `num_blocks` integers in
    [0, num_blocks), the peer's block count from its handshake, and at least as many as
    this instance reads in that group (`local_counts`; upstream's read asserts it, which
    would stop the engine). Checked before any descriptor is built, so no read reaches
    outside the peer's registered blocks."""
    if not isinstance(block_ids, (list, tuple)) or len(block_ids) != num_groups:
        got = len(block_ids) if isinstance(block_ids, (list, tuple)) else type(block_ids).__name__
        return f"the peer's block ids name {got} KV cache groups, this instance has {num_groups}"
    for group, ids in enumerate(block_ids):
        if not isinstance(ids, (list, tuple)):
            return f"the peer's block ids of group {group} are not a list"
        if len(ids) > num_blocks:
            return f"the peer names {len(ids)} blocks in group {group}; it has {num_blocks}"
        if group < len(local_counts) and len(ids) < local_counts[group]:
            return (
                f"the peer names {len(ids)} blocks in group {group}, fewer than the "
                f"{local_counts[group]} this instance reads"
            )
        for block in ids:
            if type(block) is not int or not 0 <= block < num_blocks:
                return f"the peer names block {block!r} in group {group}, outside its {num_blocks} blocks"
    return None


def lands_imports(vllm_config: Any) -> bool:
    """Whether this instance reads imports (kv_consumer or kv_both), so needs its host pool
    registered with NIXL to land them."""
    transfer = vllm_config.kv_transfer_config
    return transfer is not None and bool(transfer.is_kv_consumer)


def names_null_block(block_ids: Sequence[Sequence[int]], group_ids: Sequence[int]) -> bool:
    """Whether a block list of one of `group_ids` holds the null block (a page not on the device)."""
    return any(NULL_BLOCK_ID in block_ids[g] for g in group_ids if g < len(block_ids))


class HostLandingNixlScheduler(NixlPullConnectorScheduler):
    """Upstream's pull scheduler, plus each read's landed pages in the step's metadata and,
    on a HiSparse producer, no offer of a request with pages off its device."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.host_landing: HostLanding | None = None
        # Landed pages of the requests whose reads the next metadata starts.
        self._landings: dict[str, dict[int, int]] = {}
        hisparse = vllm_config.attention_config.hisparse_config is not None
        self._managed_groups = hisparse_managed_group_ids(kv_cache_config.kv_cache_groups) if hisparse else ()
        self.declined_sends = 0
        # Each peer's request read here, until its parameters would have expired: when; and
        # the same in order of expiry, for pruning.
        self._reads_taken: dict[tuple[Any, Any], float] = {}
        self._reads_expiring: deque[tuple[float, tuple[Any, Any]]] = deque()
        self.repeated_reads_refused = 0

    def on_new_request(self, request: Request) -> None:
        """A peer's request is read once. A second request naming the same remote request
        (replayed parameters, accepted by another API server process, whose record of used
        signatures is its own) computes its prompt here instead: the peer frees those
        blocks, for its other requests, once the first read is done."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            key = (params.get("remote_engine_id"), params.get("remote_request_id"))
            now = time.monotonic()
            taken, expiring = self._reads_taken, self._reads_expiring
            while expiring and expiring[0][0] <= now:
                until, old = expiring.popleft()
                if taken.get(old) == until:
                    del taken[old]
            if taken.get(key, 0.0) > now:
                params["do_remote_prefill"] = False
                self.repeated_reads_refused += 1
                logger.warning(
                    "request %s names remote request %s of %s, already read by this instance: "
                    "it computes its prompt here instead (%d refused so far)",
                    request.request_id, key[1], key[0], self.repeated_reads_refused,
                )  # fmt: skip
            else:
                taken[key] = now + MAX_VALID_S  # the longest a signature lasts
                expiring.append((taken[key], key))
        super().on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        request_id = request.request_id
        if self.host_landing is None or request_id not in self._reqs_need_recv:
            return
        landing = self.host_landing(request_id)
        if landing and num_external_tokens > 0:
            self._landings[request_id] = dict(landing)

    def build_connector_meta(self, scheduler_output: Any) -> NixlConnectorMetadata:
        landings, self._landings = self._landings, {}
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, NixlConnectorMetadata)
        # Read by HostLandingNixlWorker.start_load_kv; absent on upstream's workers.
        meta.host_landing = landings  # type: ignore[attr-defined]
        return meta

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if (
            self._managed_groups
            and (request.kv_transfer_params or {}).get("do_remote_decode")
            and names_null_block(block_ids, self._managed_groups)
        ):
            # Some of its sparse-MLA pages are in this instance's host pool only: a reader
            # would read the null block. The decoder computes the prompt instead.
            self.declined_sends += 1
            logger.warning(
                "Hybrid HiSparse: request %s has sparse-MLA pages in the host pool only; "
                "its KV cache is not offered for remote decode (%d declined so far)",
                request.request_id,
                self.declined_sends,
            )
            self._reqs_not_processed.add(request.request_id)
            return False, None
        return super().request_finished(request, block_ids)


class HostLandingNixlWorker(NixlPullConnectorWorker):
    """Upstream's pull worker, plus the host pool registered with NIXL and one more READ
    per request with landed pages, straight into their host pages."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        if vllm_config.attention_config.hisparse_config is not None and self.use_host_buffer:
            raise ValueError(
                "NixlConnector with kv_buffer_device='cpu' stages the KV cache in host buffers laid "
                "out block for block like the device cache, so Hybrid HiSparse cannot land imports "
                "in its host pool: remove kv_buffer_device from --kv-transfer-config, or remove "
                "hisparse_config"
            )
        groups = kv_cache_config.kv_cache_groups
        self._group_of_landed_layer = {
            name: g for g in hisparse_managed_group_ids(groups) for name in groups[g].layer_names
        } if vllm_config.attention_config.hisparse_config is not None else {}  # fmt: skip
        self._landed_layers: list[LandedLayer] = []
        self._local_regions: RegionLayout | None = None
        self._remote_regions: dict[tuple[str, int], RegionLayout] = {}
        self._host_pages: dict[str, torch.Tensor] = {}
        # Landed pages of requests whose reads have not started (page -> host page).
        self._landings: dict[str, dict[int, int]] = {}
        # Requests one of whose reads failed while another was in flight: reported
        # finished, failed, once none is (`_pop_done_transfers`).
        self._failed_reads: set[str] = set()
        # Requests whose landing read could not start: reported failed, no read of theirs
        # may start after (upstream reads once per remote rank it reads from).
        self._landing_not_started: set[str] = set()
        # Only an instance that reads imports (kv_consumer, kv_both) lands pages in its host
        # pool; a producer never registers the pool, which holds every user's demoted KV.
        self._lands_imports = lands_imports(vllm_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        if not self._group_of_landed_layer:
            return
        self._local_regions = RegionLayout(
            tuple(self.kv_caches_base_addr[self.engine_id][self.tp_rank]),
            tuple(self.block_stride_per_layer),
            tuple(self.block_len_per_layer),
            self.device_id,
        )
        self._landed_layers = locate_layers(kv_caches, self._group_of_landed_layer, self._local_regions)
        if self._lands_imports:
            when_host_pool_registered(self._register_host_pool)

    def _register_host_pool(self, layers: Mapping[str, torch.Tensor]) -> None:
        """The HiSparse worker made its host pool: register it with NIXL as host memory."""
        self._host_pages = {name: layers[name] for name in self._group_of_landed_layer}
        storage = next(iter(self._host_pages.values())).untyped_storage()
        descs = self.nixl_wrapper.get_reg_descs([(storage.data_ptr(), storage.nbytes(), 0, "")], "DRAM")
        self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)
        self._registered_descs.append(descs)  # deregistered with the KV cache at shutdown
        logger.info(
            "Hybrid HiSparse: host pool (%.2f GiB) registered with NIXL; imports of %d sparse-MLA "
            "layers can land there",
            storage.nbytes() / (1 << 30),
            len(self._landed_layers),
        )

    def add_remote_agent(
        self,
        nixl_agent_meta: NixlAgentMetadata,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
    ) -> str:
        name = super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)
        if self._local_regions is not None:
            remote = RegionLayout(
                tuple(nixl_agent_meta.kv_caches_base_addr),
                tuple(nixl_agent_meta.block_strides),
                tuple(nixl_agent_meta.block_lens),
                nixl_agent_meta.device_id,
            )
            check_remote_layout(self._local_regions, remote)
            self._remote_regions[(nixl_agent_meta.engine_id, remote_tp_rank)] = remote
        return name

    def _counts_comparable(self, remote: Any) -> bool:
        """Whether the peer's block lists and this instance's count the same tokens per
        block, as upstream's read assumes where it asserts their lengths."""
        topo = self.transfer_topo
        info = topo.get_engine_info(remote.engine_id) if topo else None
        return (
            not getattr(self, "_has_mamba", False)
            and self.dcp_size == 1
            and getattr(info, "remote_dcp_size", 1) == 1
            and getattr(info, "remote_physical_blocks_per_logical", 1)
            == getattr(self, "_physical_blocks_per_logical_kv_block", 1)
        )

    def start_load_kv(self, metadata: NixlConnectorMetadata):
        self._landings.update(getattr(metadata, "host_landing", {}))
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta: Any):
        """Upstream's reads for one request, once the peer's block ids lie within the blocks
        its handshake announced; otherwise the request's load fails (its blocks are marked
        invalid, as for any failed transfer) and nothing is read."""
        remote = meta.remote
        num_blocks = self.dst_num_blocks.get(remote.engine_id)
        if num_blocks is not None:
            topo = self.transfer_topo  # set with the handshake that recorded num_blocks
            ratio = topo.get_engine_info(remote.engine_id).remote_physical_blocks_per_logical if topo else 1
            problem = remote_block_ids_problem(
                remote.block_ids,
                len(meta.local_block_ids),
                num_blocks // max(int(ratio), 1),
                # Upstream's read asserts the counts only where each side's logical block
                # is one physical block of the same tokens (no DCP, no recurrent groups).
                [len(ids) for ids in meta.local_block_ids] if self._counts_comparable(remote) else (),
            )
            remote_dcp = getattr(topo.get_engine_info(remote.engine_id), "remote_dcp_size", 1) if topo else 1
            if problem is None and req_id in self._landings and max(self.dcp_size, remote_dcp) > 1:
                # Each rank then holds an interleaved slice of the tokens, read one rank at a
                # time; the landed pages are read whole from one rank.
                problem = "pages cannot land in the host pool from a peer with decode context parallelism"
            if problem is not None:
                self._landings.pop(req_id, None)
                self._log_failure(
                    failure_type="remote_block_ids_out_of_range",
                    req_id=req_id,
                    msg=f"Refused to read KV cache from the peer: {problem}",
                    meta=meta,
                )
                self._handle_failed_transfer(req_id, None)
                return
        super()._read_blocks_for_req(req_id, meta)

    def _read_blocks(
        self,
        read_spec: Any,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
        local_xfer_side_handle: int,
        remote_xfer_side_handle: int,
        expected_consumers: int,
    ):
        if request_id in self._landing_not_started:
            return  # reported failed: a read started now would write on after that report
        landing = self._landings.pop(request_id, None)
        if landing:
            # Both reads notify the producer, each counting every read: it frees its
            # blocks once both are done, whichever completes first.
            expected_consumers *= 2
            started = self._read_landed_pages(
                read_spec,
                dst_engine_id,
                request_id,
                f"{remote_request_id}:{expected_consumers}".encode(),
                landing,
            )
            if not started:
                # The request is reported failed with no read of it in flight; a device
                # read started now, or for another remote rank, would write its blocks on
                # after that report.
                self._landing_not_started.add(request_id)
                return
        super()._read_blocks(
            read_spec,
            dst_engine_id,
            request_id,
            remote_request_id,
            local_xfer_side_handle,
            remote_xfer_side_handle,
            expected_consumers,
        )

    def _read_landed_pages(
        self, read_spec: Any, dst_engine_id: str, request_id: str, notif: bytes, landing: dict[int, int]
    ) -> bool:
        """Start the read of the landed pages into their host pages; whether it started (if
        not, the request's load has failed)."""
        remote_rank = read_spec.remote_rank
        handle = None
        try:
            if not self._host_pages:
                raise RuntimeError("no HiSparse host pool is registered on this worker")
            local, remote = landing_descriptors(
                self._landed_layers, landing, read_spec.remote_block_ids,
                self._remote_regions[(dst_engine_id, remote_rank)], self._host_pages,
            )  # fmt: skip
            handle = self.nixl_wrapper.initialize_xfer(
                "READ",
                self.nixl_wrapper.get_xfer_descs(local, "DRAM"),
                self.nixl_wrapper.get_xfer_descs(remote, self.nixl_memory_type),
                self._remote_agents[dst_engine_id][(0, remote_rank)],
                notif_msg=notif,
            )
            self.nixl_wrapper.transfer(handle)
            self._recving_transfers.setdefault(request_id, []).append(handle)
            return True
        except Exception as e:
            self._log_failure(
                failure_type="host_landing_failed",
                req_id=request_id,
                msg="Pages landing in the HiSparse host pool were not read",
                error=e,
                dst_engine_id=dst_engine_id,
                remote_rank=remote_rank,
            )
            self._handle_failed_transfer(request_id, handle)
            return False

    def _handle_failed_transfer(self, req_id: str, handle: int | None):
        """Upstream's, naming the request's blocks in every KV cache group where upstream
        names the first group's only. With HiSparse's groups the first is a sparse-MLA
        group, which lists no page that lands in the host pool (a placeholder there): an
        import whose pages all landed would fail naming nothing, and its request would go
        on reading host pages never filled. The resident group's blocks name every
        imported page; the scheduler takes a page as failed where any group's block of it
        is named (`HiSparseScheduling.blocks_by_page_after_load_failure`)."""
        meta = self._recving_metadata.get(req_id)
        if meta is not None and self._group_of_landed_layer and not self._is_hma_required:
            named = {b for group in meta.local_block_ids for b in group if b != NULL_BLOCK_ID}
            self._invalid_block_ids.put(named)
        if any(h != handle for h in self._recving_transfers.get(req_id, ())):
            # Another read of the request is still in flight: its blocks are named failed
            # now (the scheduler holds a waiting request's blocks until it is reported
            # finished), and it is reported finished, failed, once no read of it writes
            # (`_pop_done_transfers`).
            if meta is not None and not self._group_of_landed_layer and not self._is_hma_required:
                self._invalid_block_ids.put(set(meta.local_block_ids[0]))  # as upstream names them
            self._failed_reads.add(req_id)
            if handle is not None:
                self.nixl_wrapper.release_xfer_handle(handle)
            self.xfer_stats.record_failed_transfer()
            return
        super()._handle_failed_transfer(req_id, handle)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> set[str]:
        """The requests all of whose reads have ended, as upstream's; but a request one of
        whose reads failed is reported finished, failed (through the queue upstream's
        `get_finished` reports failures from), only once none of its reads is in flight.
        Upstream reports it at the first failure: a landing request has two reads (the
        device blocks and the landed host pages), and the scheduler would then free, or
        recompute into, blocks and host pages the other read still writes."""
        done: set[str] = set()
        for req_id, handles in list(transfers.items()):
            in_flight = [handle for handle in handles if self._read_in_flight(req_id, handle)]
            if in_flight:
                transfers[req_id] = in_flight
                continue
            del transfers[req_id]
            if req_id in self._failed_reads:
                self._failed_reads.discard(req_id)
                self._failed_recv_reqs.put(req_id)
            else:
                done.add(req_id)
        return done

    def _read_in_flight(self, req_id: str, handle: int) -> bool:
        """Whether the read is still running; a finished one's handle is released, a failed
        one goes to `_handle_failed_transfer`."""
        try:
            state = self.nixl_wrapper.check_xfer_state(handle)
            if state == "PROC":
                return True
            if state == "DONE":
                self.xfer_stats.record_transfer(self.nixl_wrapper.get_xfer_telemetry(handle))
                self.nixl_wrapper.release_xfer_handle(handle)
                return False
            self._log_failure(
                failure_type="transfer_failed",
                msg="Marking blocks as invalid",
                req_id=req_id,
                xfer_state=state,
            )
        except Exception as e:
            self._log_failure(
                failure_type="transfer_exception", msg="Marking blocks as invalid", req_id=req_id, error=e
            )
        self._handle_failed_transfer(req_id, handle)
        return False

    def get_finished(self) -> tuple[set[str], set[str]]:
        done_sending, done_recving = super().get_finished()
        for request_id in done_recving:
            self._landings.pop(request_id, None)
            self._landing_not_started.discard(request_id)
        return done_sending, done_recving


class HostLandingNixlConnector(NixlPullConnector):
    """NixlConnector (pull mode) whose imports can land in the Hybrid HiSparse host pool."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super(NixlPullConnector, self).__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = HostLandingNixlScheduler(vllm_config, self.engine_id, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = HostLandingNixlWorker(vllm_config, self.engine_id, kv_cache_config)

    @property
    def host_landing(self) -> HostLanding | None:
        """Set by Hybrid HiSparse's scheduler side: where pages of an import land."""
        scheduler = self.connector_scheduler
        return scheduler.host_landing if isinstance(scheduler, HostLandingNixlScheduler) else None

    @host_landing.setter
    def host_landing(self, landing: HostLanding | None) -> None:
        if isinstance(self.connector_scheduler, HostLandingNixlScheduler):
            self.connector_scheduler.host_landing = landing

    def may_land_import(self, request: Request) -> bool:
        """Whether the request's import may land in the host pool: not from a peer with
        decode context parallelism, whose ranks hold interleaved slices of the tokens, read
        rank by rank, while the landed pages are read whole from one rank (the worker
        refuses such a read, `HostLandingNixlWorker._read_blocks_for_req`); such an import
        lands on the device, as upstream's."""
        return int((request.kv_transfer_params or {}).get("dcp_size") or 1) <= 1
