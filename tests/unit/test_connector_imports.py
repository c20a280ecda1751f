# SPDX-License-Identifier: Apache-2.0
"""Which connector loads a request's hit, and how HiSparse must treat it (`ConnectorImports`).

A MultiConnector lets the first of its connectors with a hit load it, request by
request. Beside a P/D connector, the OffloadingConnector that loads only the indexer's
groups is one of several kinds: HiSparse reads the chosen one's kind for each request,
and refuses a hit whose loader it cannot tell.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.v1.hisparse.kv_import import ConnectorImports, ImportKind, loading_connectors


def offloading() -> SimpleNamespace:
    return SimpleNamespace(hisparse_group_ids=(6,))


def landing() -> SimpleNamespace:
    return SimpleNamespace(host_landing=None, may_land_import=lambda request: False)


def multi(*connectors: object, chosen: dict[str, int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(_connectors=list(connectors), _requests_to_connector=chosen or {})


def test_a_single_connector_is_the_loader_of_every_request():
    imports = ConnectorImports(offloading())
    assert imports.kinds == {ImportKind.HOST_POOL_GROUPS}
    found = imports.of("any")
    assert found is not None and found.kind is ImportKind.HOST_POOL_GROUPS
    assert found.may_land(None)


def test_a_multiconnectors_hit_takes_the_kind_of_the_connector_it_chose():
    device, lands, narrowed = SimpleNamespace(), landing(), offloading()
    connector = multi(multi(device, lands), narrowed, chosen={"p": 0, "o": 1})
    connector._connectors[0]._requests_to_connector.update({"p": 1, "d": 0})
    connector._requests_to_connector["d"] = 0
    imports = ConnectorImports(connector)
    assert loading_connectors(connector) == [device, lands, narrowed]
    assert imports.kinds == {ImportKind.DEVICE, ImportKind.LANDS_ON_HOST, ImportKind.HOST_POOL_GROUPS}
    assert imports.of("o").kind is ImportKind.HOST_POOL_GROUPS
    assert imports.of("d").kind is ImportKind.DEVICE
    landed = imports.of("p")
    assert landed.kind is ImportKind.LANDS_ON_HOST and not landed.may_land(None), "the lander's own rule"


def test_a_hit_whose_loader_cannot_be_read_is_refused():
    imports = ConnectorImports(multi(SimpleNamespace(), offloading(), chosen={"bad": 5}))
    assert imports.of("unknown") is None
    assert imports.of("bad") is None
    no_record = SimpleNamespace(_connectors=[offloading()])
    assert ConnectorImports(no_record).of("any") is None


def test_the_registry_of_the_host_pool_lets_a_shut_down_engines_pool_and_connectors_go():
    """Engines started one after another in one process (an RL loop, tests): the module's
    registry kept the first engine's pool mapped until the next one registered, so the
    next engine's RAM check counted it as used, and kept calling the first engine's
    connectors with every later pool."""
    import gc
    import weakref

    import torch

    from vllm.v1.hisparse import kv_import
    from vllm.v1.hisparse.worker import HiSparseWorker

    class Connector:
        def __init__(self) -> None:
            self.seen: list[list[str]] = []

        def register(self, layers) -> None:
            self.seen.append(sorted(layers))

    def worker(layer: str) -> HiSparseWorker:
        runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], req_id_to_index={}), requests={})
        cache = torch.zeros(4, 64, 8)
        return HiSparseWorker(
            runner, {layer: cache}, group_of_layer={layer: 0}, hot_rows=64, num_host_pages=2
        )

    connector = Connector()
    kv_import.when_host_pool_registered(connector.register)
    first = worker("model.layers.0.self_attn.attn")
    assert connector.seen[-1] == ["model.layers.0.self_attn.attn"]
    assert (
        kv_import.host_pool_layer("model.layers.0.self_attn.attn").data_ptr() == first.host_pool[0].data_ptr()
    )
    listener = weakref.ref(connector)
    del first, connector
    gc.collect()
    with pytest.raises(KeyError, match="is gone"):
        kv_import.host_pool_layer("model.layers.0.self_attn.attn")  # a view held the pool's memory
    assert listener() is None, "the registry held a connector of an engine that is gone"
    second = worker("model.layers.1.self_attn.attn")
    assert (
        kv_import.host_pool_layer("model.layers.1.self_attn.attn").data_ptr()
        == second.host_pool[0].data_ptr()
    )
