# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse's Prometheus metrics.

Owns the `vllm:hisparse_*` metrics the Prometheus stat logger exports from the
scheduler's residency counters (`HiSparseScheduling.stats()`, carried in
`SchedulerStats.hisparse_stats`): gauges for the current state (requests and
pages per residency state, host pool use) and counters for what happened
(pages copied, demoted, restored and reused, rows loaded, bytes moved between
host and device, preemptions avoided). The scheduler's counters are
cumulative; counters here advance by their increase since the last record.

Counters that only tests and benchmarks read (`DEBUG_COUNTERS`) are exported
only with VLLM_HISPARSE_DEBUG_METRICS=1. vLLM 0.30's names for the same figures
(`vllm:hisparse_cache_hits`, ...) are exported beside this build's. Every
metric is described for operators in docs/metrics.md.

It never reads scheduler state itself; it only translates one stats dict.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.config.hisparse import hisparse_active

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Gauge name -> (documentation, the stats keys by label value of `state`, or one key).
_GAUGES: dict[str, tuple[str, dict[str, str] | str]] = {
    "vllm:hisparse_requests": (
        "Running requests by HiSparse residency state (full: all pages on the device; "
        "mixed: some in the host pool; none: no resident page outside the tail).",
        {"full": "requests_full", "mixed": "requests_mixed", "none": "requests_none"},
    ),
    "vllm:hisparse_pages": (
        "Sparse-MLA pages of running requests by residency (device only, device and host, host only).",
        {"device": "pages_device", "both": "pages_both", "host": "pages_host"},
    ),
    "vllm:hisparse_host_pool_used_pages": ("Host pool pages referenced by requests.", "host_pages_used"),
    "vllm:hisparse_host_pool_pages": ("Host pool capacity in pages.", "host_pages_total"),
    "vllm:hisparse_hot_lease_blocks": (
        "Device blocks (all sparse-MLA groups) held as running requests' hot buffers.",
        "hot_lease_blocks",
    ),
    "vllm:hisparse_history_blocks": (
        "Device blocks of finished sessions' indexer (and MTP) pages held under pressure for "
        "their next turn, whose sparse-MLA pages the host pool holds.",
        "history_blocks_held",
    ),
    "vllm:hisparse_max_resolver_calls_per_layer_step": (
        "The most resolver calls one sparse-MLA layer made in one step so far (1: step-granular).",
        "max_resolver_calls_per_layer_step",
    ),
    "vllm:hisparse_max_plan_bytes": (
        "The most bytes one step's resolution plans held at once so far (bounded by "
        "docs/architecture.md's plan memory formula).",
        "max_plan_bytes",
    ),
    "vllm:hisparse_host_pools": (
        "Host pools the engine's ranks write: one per node, shared by its tensor-parallel ranks.",
        "max_host_pools",
    ),
}


def _host_pool_usage(stats: dict[str, Any]) -> float:
    total = stats.get("host_pages_total", 0)
    return stats.get("host_pages_used", 0) / total if total else 0.0


# Gauge name -> (documentation, its value from the stats).
_DERIVED_GAUGES: dict[str, tuple[str, Callable[[dict[str, Any]], float]]] = {
    "vllm:hisparse_host_pool_usage_perc": (
        "Fraction of the host pool's pages referenced by requests (1 = full), as vLLM's *_usage_perc gauges.",
        _host_pool_usage,
    ),
    # vLLM 0.30's names for the same figures.
    "vllm:hisparse_host_cache_usage_perc": (
        "vLLM 0.30's name for vllm:hisparse_host_pool_usage_perc.",
        _host_pool_usage,
    ),
    "vllm:hisparse_pending_page_transfers": (
        "Page copies device -> host planned and not yet reported durable (vLLM 0.30's name).",
        lambda stats: stats.get("copies_in_flight", 0),
    ),
}

# Counters only tests and benchmarks read: exported with DEBUG_METRICS_ENV=1.
DEBUG_METRICS_ENV = "VLLM_HISPARSE_DEBUG_METRICS"
DEBUG_COUNTERS = frozenset(
    {
        "vllm:hisparse_attention_calls",
        "vllm:hisparse_worker_steps",
        "vllm:hisparse_forward_steps",
        "vllm:hisparse_device_reads",
    }
)

# Counter name -> (documentation, cumulative stats key).
_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:hisparse_pages_copied_to_host": ("Pages copied device -> host.", "pages_copied_to_host"),
    "vllm:hisparse_pages_demoted": ("Pages freed from the device (kept in the host pool).", "pages_demoted"),
    "vllm:hisparse_pages_restored": (
        "Pages of KV connector hits restored host -> device.",
        "pages_restored",
    ),
    "vllm:hisparse_copies_avoided": (
        "Proactive page copies not made because the host pool already held the page's content.",
        "copies_avoided",
    ),
    "vllm:hisparse_history_blocks_released": (
        "Held history blocks given back because demotion could not free the blocks a step needed.",
        "history_blocks_released",
    ),
    "vllm:hisparse_blocks_evicted_first": (
        "Released host-backed sparse-MLA blocks put first in the device's eviction order under pressure.",
        "blocks_evicted_first",
    ),
    "vllm:hisparse_resident_blocks_copied": (
        "Resident blocks (the page layout's m-page indexer and drafter blocks) copied on the device "
        "for prefix hits that end inside one.",
        "resident_blocks_copied",
    ),
    "vllm:hisparse_connector_hits_cut": (
        "KV connector hits cut short where the host pool's pages of them ended (the rest is recomputed).",
        "connector_hits_cut",
    ),
    "vllm:hisparse_connector_hits_refused": (
        "KV connector hits not taken, or cut short, because which of a MultiConnector's connectors "
        "loads them could not be read, or a request that failed on the workers stored their keys "
        "(the rest is recomputed); once per request, however many steps it tries.",
        "connector_hits_refused",
    ),
    "vllm:hisparse_host_hits_without_lease": (
        "Admission tries whose host pages (a host prefix hit or a KV connector's hit) found no room "
        "for a hot lease: the request waits for room or recomputes the prefix; once per step it tries.",
        "host_hits_without_lease",
    ),
    "vllm:hisparse_lease_waits": (
        "Steps a waiting request whose host pages found no room for a hot lease waited for room "
        "instead of recomputing them (the lease would at least halve its prefill).",
        "lease_waits",
    ),
    "vllm:hisparse_host_prefix_pages_reused": (
        "Prefix pages a request took from the host pool instead of recomputing them.",
        "host_prefix_pages_reused",
    ),
    "vllm:hisparse_requests_started_none": (
        "Requests whose prefix came from the host pool (a host prefix hit or an import): they started NONE.",
        "requests_started_none",
    ),
    "vllm:hisparse_pages_imported_to_host": (
        "Pages of a KV connector's import (P/D, shared storage) written straight into the host pool.",
        "pages_imported_to_host",
    ),
    "vllm:hisparse_rows_loaded": (
        "Rows the resolver loaded host -> device into hot buffers (per sparse-MLA layer).",
        "rows_loaded",
    ),
    "vllm:hisparse_rows_hit": (
        "Selected rows of host pages the resolver found in a hot buffer (per sparse-MLA layer).",
        "rows_hit",
    ),
    "vllm:hisparse_rows_staged": (
        "Rows loaded into one step's staging rows beyond a hot buffer (per sparse-MLA layer).",
        "rows_staged",
    ),
    "vllm:hisparse_resolution_plans": (
        "Resolution plans made: one per top-K selection (shared by the layers that reuse it) per step.",
        "resolution_plans",
    ),
    "vllm:hisparse_resolver_calls": (
        "Resolver calls: one per resolved sparse-MLA layer per step.",
        "resolver_calls",
    ),
    "vllm:hisparse_extra_attention_passes": (
        "Attention passes beyond a layer's first in a step: a prefill chunk that selected more "
        "host rows than its hot buffer and staging hold attends in passes.",
        "extra_attention_passes",
    ),
    "vllm:hisparse_partitioned_plans": (
        "Resolution plans split into passes by reading run boundaries back from the device: "
        "a chunk that may select more host rows than its hot buffer and staging hold.",
        "partitioned_plans",
    ),
    "vllm:hisparse_narrow_copy_launches": (
        "Row and page copy launches that copied byte by byte because a row, page, stride or "
        "address was not 16-byte aligned (CUDA; the engine log warns once).",
        "narrow_copy_launches",
    ),
    "vllm:hisparse_attention_calls": (
        "Attention kernel calls of HiSparse-managed layers (one per layer per step).",
        "attention_calls",
    ),
    "vllm:hisparse_worker_steps": (
        "Steps the HiSparse worker executed, with or without a forward.",
        "worker_steps",
    ),
    "vllm:hisparse_forward_steps": ("Steps whose forward ran the HiSparse-managed layers.", "forward_steps"),
    "vllm:hisparse_resolving_steps": ("Steps whose batch had a request with host pages.", "resolving_steps"),
    "vllm:hisparse_device_reads": (
        "Reads of device-produced values by the worker (once per step, after the step's work).",
        "device_reads",
    ),
    "vllm:hisparse_staging_rows_leased": (
        "Rows per sparse-MLA layer leased for one step to stage selections beyond hot buffers.",
        "staging_rows_leased",
    ),
    "vllm:hisparse_staging_rows_short": (
        "Rows of a chunk's staging budget the pool could not spare; the chunk kept its length "
        "and attended in more passes.",
        "staging_rows_short",
    ),
    "vllm:hisparse_prefill_restores": (
        "Prefill chunks that restored their request's host-only pages to the device instead "
        "of staging the rows they select (the pool had the blocks free).",
        "prefill_restores",
    ),
    "vllm:hisparse_pages_restored_for_prefill": (
        "Host-only pages restored to the device for a prefill chunk.",
        "pages_restored_for_prefill",
    ),
    "vllm:hisparse_hot_leases": ("Hot buffers leased to requests.", "hot_leases"),
    "vllm:hisparse_preemptions_avoided": (
        "Allocations that demotion served instead of a preemption.",
        "preemptions_avoided",
    ),
    "vllm:hisparse_victims_skipped": (
        "Demotions refused because they could not free more blocks than the victim's hot lease.",
        "victims_skipped",
    ),
    "vllm:hisparse_preemption_deferrals_exhausted": (
        "Preemptions allowed after the most consecutive steps a preemption may wait for relief.",
        "deferrals_exhausted",
    ),
    "vllm:hisparse_requests_failed": (
        "Requests ended with an error because HiSparse could not serve them (the engine went on).",
        "requests_failed",
    ),
    "vllm:hisparse_pages_withdrawn": (
        "Pages a request failed on the workers had written (or a request that took them had), "
        "taken out of the prefix cache and the host pool.",
        "pages_withdrawn",
    ),
    "vllm:hisparse_bytes_to_host": (
        "Bytes copied device -> host: each page once into each node's host pool.",
        "bytes_to_host",
    ),
    "vllm:hisparse_bytes_from_host": (
        "Bytes copied host -> device (restores and resolver row loads), all workers.",
        "bytes_from_host",
    ),
    # vLLM 0.30's names for the same figures.
    "vllm:hisparse_cache_hits": ("vLLM 0.30's name for vllm:hisparse_rows_hit.", "rows_hit"),
    "vllm:hisparse_cache_misses": ("vLLM 0.30's name for vllm:hisparse_rows_loaded.", "rows_loaded"),
    "vllm:hisparse_host_to_device_bytes": (
        "vLLM 0.30's name for vllm:hisparse_bytes_from_host.",
        "bytes_from_host",
    ),
}


def debug_metrics_enabled() -> bool:
    return os.environ.get(DEBUG_METRICS_ENV, "") not in ("", "0")


def exported_metrics(debug: bool | None = None) -> dict[str, tuple[str, str]]:
    """Every `vllm:hisparse_*` metric the server exports: name as scraped (counters end in
    `_total`) -> (kind, documentation)."""
    debug = debug_metrics_enabled() if debug is None else debug
    out = {name: ("gauge", doc) for name, (doc, _) in _GAUGES.items()}
    out.update({name: ("gauge", doc) for name, (doc, _) in _DERIVED_GAUGES.items()})
    out.update(
        {f"{name}_total": ("counter", doc) for name, (doc, _) in _COUNTERS.items()
         if debug or name not in DEBUG_COUNTERS}
    )  # fmt: skip
    return out


class HiSparseProm:
    """The `vllm:hisparse_*` metrics of one Prometheus stat logger (all engines)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        gauge_cls: type,
        counter_cls: type,
    ) -> None:
        self.enabled = hisparse_active(vllm_config)
        self._gauges: dict[str, dict[int, Any]] = {}
        self._labelled: dict[str, dict[str, dict[int, Any]]] = {}
        self._counters: dict[str, dict[int, Any]] = {}
        self._derived: dict[str, dict[int, Any]] = {}
        self._last: dict[tuple[int, str], int] = {}
        if not self.enabled:
            return
        debug = debug_metrics_enabled()
        for name, (doc, keys) in _GAUGES.items():
            if isinstance(keys, dict):
                gauge = gauge_cls(name=name, documentation=doc, labelnames=[*labelnames, "state"])
                self._labelled[name] = {
                    state: {e: gauge.labels(*values, state) for e, values in per_engine_labelvalues.items()}
                    for state in keys
                }
            else:
                gauge = gauge_cls(name=name, documentation=doc, labelnames=labelnames)
                self._gauges[name] = {e: gauge.labels(*v) for e, v in per_engine_labelvalues.items()}
        for name, (doc, _) in _DERIVED_GAUGES.items():
            gauge = gauge_cls(name=name, documentation=doc, labelnames=labelnames)
            self._derived[name] = {e: gauge.labels(*v) for e, v in per_engine_labelvalues.items()}
        for name, (doc, _) in _COUNTERS.items():
            if name in DEBUG_COUNTERS and not debug:
                continue
            counter = counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[name] = {e: counter.labels(*v) for e, v in per_engine_labelvalues.items()}

    def observe(self, stats: dict[str, int], engine_idx: int) -> None:
        if not self.enabled:
            return
        for name, (_, keys) in _GAUGES.items():
            if isinstance(keys, dict):
                for state, key in keys.items():
                    self._labelled[name][state][engine_idx].set(stats.get(key, 0))
            else:
                self._gauges[name][engine_idx].set(stats.get(keys, 0))
        for name, (_, value_of) in _DERIVED_GAUGES.items():
            self._derived[name][engine_idx].set(value_of(stats))
        for name, counters in self._counters.items():
            value = stats.get(_COUNTERS[name][1], 0)
            # Per metric, not per stats key: two names (this build's and 0.30's) may read one key.
            last = self._last.get((engine_idx, name), 0)
            # A restarted engine starts its counters from zero again.
            increase = value - last if value >= last else value
            if increase:
                counters[engine_idx].inc(increase)
            self._last[(engine_idx, name)] = value
