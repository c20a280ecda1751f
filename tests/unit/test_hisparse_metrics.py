# SPDX-License-Identifier: Apache-2.0
"""vllm:hisparse_* Prometheus metrics from the scheduler's cumulative residency counters."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import prometheus_client

from vllm.v1.hisparse.metrics import HiSparseProm

LABELS = ["model_name", "engine"]
HISPARSE_ON = {"host_pool_gib": 1}


def prom(registry, hisparse_config=HISPARSE_ON) -> HiSparseProm:
    config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=hisparse_config))
    return HiSparseProm(
        config,
        LABELS,
        {0: ["m", "0"], 1: ["m", "1"]},
        functools.partial(prometheus_client.Gauge, registry=registry),
        functools.partial(prometheus_client.Counter, registry=registry),
    )


def sample(registry, name, **labels) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", **labels})


def test_counters_advance_by_the_increase_and_gauges_follow_the_state():
    registry = prometheus_client.CollectorRegistry()
    metrics = prom(registry)
    metrics.observe({"pages_demoted": 3, "requests_mixed": 2, "host_pages_total": 60}, engine_idx=0)
    metrics.observe({"pages_demoted": 5, "requests_mixed": 1, "host_pages_total": 60}, engine_idx=0)
    assert sample(registry, "vllm:hisparse_pages_demoted_total", engine="0") == 5
    assert sample(registry, "vllm:hisparse_requests", engine="0", state="mixed") == 1
    assert sample(registry, "vllm:hisparse_requests", engine="0", state="full") == 0
    assert sample(registry, "vllm:hisparse_host_pool_pages", engine="0") == 60
    assert sample(registry, "vllm:hisparse_pages_demoted_total", engine="1") == 0, "engines count apart"


def test_a_restarted_engine_counts_on_from_its_new_values():
    registry = prometheus_client.CollectorRegistry()
    metrics = prom(registry)
    metrics.observe({"rows_loaded": 100}, engine_idx=1)
    metrics.observe({"rows_loaded": 7}, engine_idx=1)  # the engine's counters began again
    assert sample(registry, "vllm:hisparse_rows_loaded_total", engine="1") == 107


def test_nothing_is_registered_without_hisparse():
    registry = prometheus_client.CollectorRegistry()
    metrics = prom(registry, hisparse_config=None)
    metrics.observe({"pages_demoted": 3}, engine_idx=0)
    assert not [m for m in registry.collect() if m.name.startswith("vllm:hisparse")]


def test_the_host_pool_usage_gauge_and_vllm_030s_names_follow_this_builds_figures(monkeypatch):
    monkeypatch.delenv("VLLM_HISPARSE_DEBUG_METRICS", raising=False)
    registry = prometheus_client.CollectorRegistry()
    metrics = prom(registry)
    stats = {"host_pages_used": 15, "host_pages_total": 60, "rows_hit": 40, "rows_loaded": 9,
             "bytes_from_host": 1000, "copies_in_flight": 3}  # fmt: skip
    metrics.observe(stats, engine_idx=0)
    metrics.observe({**stats, "rows_hit": 50, "rows_loaded": 10, "bytes_from_host": 1500}, engine_idx=0)
    assert sample(registry, "vllm:hisparse_host_pool_usage_perc", engine="0") == 0.25
    assert sample(registry, "vllm:hisparse_host_cache_usage_perc", engine="0") == 0.25
    assert sample(registry, "vllm:hisparse_pending_page_transfers", engine="0") == 3
    # Two names read one figure: each counts all of it.
    assert sample(registry, "vllm:hisparse_rows_hit_total", engine="0") == 50
    assert sample(registry, "vllm:hisparse_cache_hits_total", engine="0") == 50
    assert sample(registry, "vllm:hisparse_rows_loaded_total", engine="0") == 10
    assert sample(registry, "vllm:hisparse_cache_misses_total", engine="0") == 10
    assert sample(registry, "vllm:hisparse_host_to_device_bytes_total", engine="0") == 1500
    assert sample(registry, "vllm:hisparse_host_pool_usage_perc", engine="1") == 0, "an empty pool reads 0"


def test_test_only_counters_are_exported_only_behind_the_debug_switch(monkeypatch):
    from vllm.v1.hisparse.metrics import DEBUG_COUNTERS, DEBUG_METRICS_ENV, exported_metrics

    def names(registry):
        return {m.name for m in registry.collect()}

    monkeypatch.delenv(DEBUG_METRICS_ENV, raising=False)
    registry = prometheus_client.CollectorRegistry()
    prom(registry).observe({"device_reads": 4, "worker_steps": 4}, engine_idx=0)
    assert not names(registry) & DEBUG_COUNTERS
    assert sample(registry, "vllm:hisparse_device_reads_total", engine="0") is None
    assert not {f"{n}_total" for n in DEBUG_COUNTERS} & set(exported_metrics())
    monkeypatch.setenv(DEBUG_METRICS_ENV, "1")
    registry = prometheus_client.CollectorRegistry()
    prom(registry).observe({"device_reads": 4, "worker_steps": 4}, engine_idx=0)
    assert DEBUG_COUNTERS <= names(registry)
    assert sample(registry, "vllm:hisparse_device_reads_total", engine="0") == 4
    assert {f"{n}_total" for n in DEBUG_COUNTERS} <= set(exported_metrics())


def test_docs_metrics_md_describes_every_exported_metric_and_no_other():
    import re
    from pathlib import Path

    from vllm.v1.hisparse.metrics import exported_metrics

    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(vllm:hisparse_[a-z_]+)", text))
    exported = set(exported_metrics(debug=True))
    assert exported - documented == set(), "exported but not in docs/metrics.md"
    assert documented - exported == set(), "in docs/metrics.md but not exported"


def test_every_hisparse_query_of_the_dashboard_names_an_exported_metric():
    import json
    import re
    from pathlib import Path

    from vllm.v1.hisparse.metrics import exported_metrics

    dashboard = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "hisparse.json"
    panels = json.loads(dashboard.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", ())]
    assert exprs, "the dashboard has queries"
    names = {n for e in exprs for n in re.findall(r"vllm:hisparse_[a-z_]+", e)}
    assert names and names <= set(exported_metrics(debug=False)), names - set(exported_metrics(debug=False))
