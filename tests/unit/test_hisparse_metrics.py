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
