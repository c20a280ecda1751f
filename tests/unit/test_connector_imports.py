# SPDX-License-Identifier: Apache-2.0
"""Which connector loads a request's hit, and how HiSparse must treat it (`ConnectorImports`).

A MultiConnector lets the first of its connectors with a hit load it, request by
request. Beside a P/D connector, the OffloadingConnector that loads only the indexer's
groups is one of several kinds: HiSparse reads the chosen one's kind for each request,
and refuses a hit whose loader it cannot tell.
"""

from __future__ import annotations

from types import SimpleNamespace

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
