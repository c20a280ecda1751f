# SPDX-License-Identifier: Apache-2.0
"""Where a KV connector's import of a remote prefix lands with Hybrid HiSparse on.

A KV connector that loads a prefix computed elsewhere (a P/D prefill instance,
shared storage) is one of three kinds to HiSparse (`import_kind`):
- it loads only the groups HiSparse leaves to it (the OffloadingConnector,
  narrowed by offloading.py): the sparse-MLA pages of its hit come from the host
  pool, as today;
- it lands imports on the host: it loads every group, and writes the sparse-MLA
  pages of the pages HiSparse lands in the host pool there instead of into
  device blocks (it has a `host_landing` attribute, which HiSparse's scheduler
  side sets to its `HostLanding`);
- any other connector loads every group into device blocks, as upstream.

Owns the two halves of that contract that cross the connector's boundary:
- scheduler side: `HostLanding`, for a request with an import this step, the
  host page each landed page takes (page index -> host page);
- worker side: the host pool's per-layer views, registered by the HiSparse
  worker, that a landing connector's worker writes landed rows into
  (`host_pool_layer`), or is handed once the pool exists
  (`when_host_pool_registered`, for a connector made before the pool that
  registers it with a transfer engine). Every tensor-parallel rank writes its
  own import, also where the node's ranks share one pool: the rows are
  identical, and each rank then reads only after its own write.

It never decides where a page lands and never copies.
"""

from __future__ import annotations

import enum
import inspect
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

# (request id) -> {page index: host page} of the pages of its import this step
# lands in the host pool; empty when nothing of it lands there.
HostLanding = Callable[[str], Mapping[int, int]]


class ImportKind(enum.Enum):
    HOST_POOL_GROUPS = "loads the groups HiSparse does not manage"
    LANDS_ON_HOST = "loads every group, sparse-MLA pages where HiSparse lands them"
    DEVICE = "loads every group into device blocks"


def import_kind(connector: Any) -> ImportKind:
    """How `connector` (None: no connector; not a MultiConnector, see `ConnectorImports`)
    loads a hit, as HiSparse must treat it."""
    if getattr(connector, "hisparse_group_ids", None) is not None:
        return ImportKind.HOST_POOL_GROUPS
    if hasattr(connector, "host_landing"):
        return ImportKind.LANDS_ON_HOST
    return ImportKind.DEVICE


def loading_connectors(connector: Any) -> list[Any]:
    """The connectors that may load a hit: `connector`, or a MultiConnector's, flattened."""
    if connector is None:
        return []
    subs = getattr(connector, "_connectors", None)
    if subs is None:
        return [connector]
    return [leaf for sub in subs for leaf in loading_connectors(sub)]


class ConnectorImport(NamedTuple):
    """How the connector that loads one request's hit loads it."""

    kind: ImportKind
    # A hit may be cut at multiples of this many tokens (None: all or nothing).
    chunk_tokens: int | None
    # Whether a landing connector can land this request's import in the host pool.
    may_land: Callable[[Any], bool]


class ConnectorImports:
    """Which connector loads a request's hit, and how.

    A MultiConnector asks its connectors in order and lets the first with a hit load it
    (upstream's `_requests_to_connector`), so with one whose connectors differ in kind (the
    OffloadingConnector beside a P/D connector) the kind is the chosen one's, request by
    request. Where the choice cannot be read, the hit is refused (`of` returns None):
    taking a hit that loads only some groups as one that loads them all would read
    blocks nothing wrote."""

    def __init__(self, connector: Any) -> None:
        self._connector = connector
        self.leaves = loading_connectors(connector)
        self._imports = {id(leaf): self._import_of(leaf) for leaf in self.leaves}
        self.kinds = {self._imports[id(leaf)].kind for leaf in self.leaves}
        self._single = self._imports[id(connector)] if self.leaves == [connector] else None

    @staticmethod
    def _import_of(leaf: Any) -> ConnectorImport:
        may_land = getattr(leaf, "may_land_import", None)
        return ConnectorImport(
            import_kind(leaf),
            hit_chunk_tokens(leaf),
            may_land if may_land is not None else lambda request: True,
        )

    def of(self, request_id: str) -> ConnectorImport | None:
        """How the connector that loads `request_id`'s hit loads it; None where unknown."""
        if self._single is not None:
            return self._single
        connector = self._connector
        while getattr(connector, "_connectors", None) is not None:
            chosen = getattr(connector, "_requests_to_connector", {}).get(request_id)
            if not isinstance(chosen, int) or not 0 <= chosen < len(connector._connectors):
                return None
            connector = connector._connectors[chosen]
        return self._imports.get(id(connector))


def reads_block_id_snapshot(connector: Any) -> bool:
    """Whether `connector` reads the scheduler's per-step block-id snapshot
    (`SchedulerOutput.kv_connector_block_state.block_ids`). vLLM 0.29's OffloadingConnector
    reads only that state's boundary-state handoffs; any other connector, a subclass
    included, is assumed to read it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    return type(connector) is not OffloadingConnector


def hit_chunk_tokens(connector: Any) -> int | None:
    """Tokens per chunk of an OffloadingConnector's hits, where such a hit may be cut short
    at any chunk boundary; None where it may not (another connector, or one whose hits
    can end in a partial chunk, which it then loads exactly)."""
    config = getattr(getattr(connector, "connector_scheduler", None), "config", None)
    groups = getattr(config, "kv_group_configs", None)
    if not groups or getattr(config, "supports_partial_tail", True):
        return None
    return math.lcm(*(int(group.tokens_per_chunk) for group in groups))


# The worker's host pool, held weakly (the worker owns it: an engine shut down in this
# process leaves its pool to be freed), and each sparse-MLA layer's index in it.
_host_pool: weakref.ref[torch.Tensor] | None = None
_host_pool_index: dict[str, int] = {}
# Connectors waiting for the pool, held weakly where they are bound methods (a connector
# gone with its engine is not called with the next engine's pool).
_host_pool_listeners: list[Callable[[], Callable[[Mapping[str, torch.Tensor]], None] | None]] = []


def register_host_pool_layers(pool: torch.Tensor, layer_names: Sequence[str]) -> None:
    """The worker's host pool, [layer, host page, 64 rows, width], of these sparse-MLA layers."""
    global _host_pool
    _host_pool = weakref.ref(pool)
    _host_pool_index.clear()
    _host_pool_index.update((name, i) for i, name in enumerate(layer_names))
    layers = _host_pool_layers()
    for ref in list(_host_pool_listeners):
        listener = ref()
        if listener is None:
            _host_pool_listeners.remove(ref)
        else:
            listener(layers)


def _host_pool_layers() -> dict[str, torch.Tensor]:
    """Each layer's [host page, 64 rows, width] view of the registered pool (none once its
    worker is gone)."""
    pool = _host_pool() if _host_pool is not None else None
    if pool is None:
        return {}
    return {name: pool[i] for name, i in _host_pool_index.items()}


def when_host_pool_registered(listener: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
    """Call `listener` with the host pool's per-layer views once the worker registers them
    (at once if it already has)."""

    def kept() -> Callable[[Mapping[str, torch.Tensor]], None]:
        return listener

    _host_pool_listeners.append(weakref.WeakMethod(listener) if inspect.ismethod(listener) else kept)
    layers = _host_pool_layers()
    if layers:
        listener(layers)


def host_pool_layer(layer_name: str) -> torch.Tensor:
    """Layer `layer_name`'s view of the host pool, for rows of a page landed there."""
    pool = _host_pool() if _host_pool is not None else None
    index = _host_pool_index.get(layer_name)
    if pool is None or index is None:
        raise KeyError(
            f"Hybrid HiSparse: an import landed a page of layer {layer_name} in the host pool, but "
            f"this worker's pool holds layers {sorted(_host_pool_index)[:4]}"
            f"{'' if pool is not None else ' (and is gone)'}...: the scheduler and the worker "
            "disagree on the sparse-MLA layers"
        )
    return pool[index]
