# SPDX-License-Identifier: Apache-2.0
"""vLLM's real Scheduler and KVCacheManager for a tiny GLM-5 model, with no model behind them.

This module owns the test harness for scheduler-level integration tests (HiSparse
residency among them): it builds what ``EngineCore`` builds before its first step
and drives the scheduler step by step the way ``EngineCore.step`` does.

- ``make_vllm_config``: a real ``VllmConfig`` for the tiny GLM-5 (``glm_moe_dsa``)
  checkpoint from ``scripts/tiny_models.py``, through ``EngineArgs.create_engine_config``.
- ``model_kv_cache_specs``: the per-layer KV cache specs the model's layers would report
  to the engine (one sparse-MLA latent cache and one indexer K cache per decoder layer),
  computed from the config without instantiating the model.
- ``build_kv_cache_config``: the scheduler's ``KVCacheConfig`` for a number of blocks (or
  bytes), following ``EngineCore._initialize_kv_caches`` (layout resolution, grouping,
  HiSparse's group split when ``hisparse_config`` is set, capacity bookkeeping).
- ``SchedulerHarness``: a real ``vllm.v1.core.sched.scheduler.Scheduler`` plus the block
  hasher ``EngineCore`` uses for prefix caching; ``add_request`` makes real ``Request``
  objects the way ``EngineCore.preprocess_add_request`` does; ``step`` runs
  ``schedule()``, fabricates the ``ModelRunnerOutput`` a worker would return (a fixed
  token for every request whose prefill is complete, nothing for a partial prefill
  chunk) and hands it to ``update_from_output``; ``run_until_done`` repeats that and
  returns one ``StepObservation`` per step.
- With ``hisparse_config`` set, the harness plays the worker's part of the residency
  protocol: it reports every copy in the step's ``hisparse_plan`` as done, by copy id,
  ``report_delay`` steps later (0: in the same step's output; a CUDA worker reports once
  the copy's event has passed, a step or more later), or nothing, with
  ``runs_hisparse_plans=False``, as a worker without HiSparse does. After every step it
  runs HiSparse's ownership check (``check_ownership``), and checks each step's plan as
  it leaves the scheduler (``check_plan``: a restore writes only into its own request's
  page). No bytes move: the tests built on it check plans and bookkeeping, not KV
  contents.
- With the OffloadingConnector, the harness plays its workers too: every load and store
  job a step's connector metadata carries completes ``report_delay`` steps later
  (``OffloadingWorkerMetadata.completed_jobs``), and a request whose loads all completed
  is reported in ``finished_recving``, so asynchronous loads hold their requests waiting
  for a while, as on a GPU. No bytes move.
- With the NixlConnector and ``nixl_read_fails`` (a function drawing whether a read
  fails), the harness plays its workers as well: a read a request waits for finishes
  ``report_delay`` steps later in ``finished_recving``, a failed one naming the
  request's blocks of every group in ``invalid_block_ids``; a finished request whose
  blocks are held for a remote reader is reported in ``finished_sending`` ``report_delay``
  steps after the step that offers it. Without it a test reports reads and sends itself.
- ``async_scheduling=True`` steps the way ``EngineCore.step_with_batch_queue`` does with
  two batches in flight: the next step is scheduled before the previous step's output is
  processed (the scheduler is then vLLM's ``AsyncScheduler``).
- With a ``speculative_config`` (an MTP drafter: pass the drafter's layers in ``specs``,
  e.g. the planner's ``layer_kv_cache_specs``), a request that decodes with ``k`` draft
  tokens samples ``1 + accepted_drafts(k)`` tokens. Synchronously the harness proposes
  ``num_speculative_tokens`` drafts for every request of a processed step, as
  ``EngineCore.step`` does with the drafter's ids; asynchronously the scheduler's own
  placeholders stand for them, as on a GPU.

It runs no model: the worker and executor are absent, so nothing is computed and no KV
cache memory is allocated; only scheduling and block accounting are real. It never
modifies vLLM: it only calls the installed vLLM's own functions and classes, and its
fidelity to a real engine is pinned by ``tests/integration/test_scheduler_harness.py``.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tiny_models

from vllm.v1.hisparse.ownership import check_plan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

REPO = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO / ".cache" / "tiny-models"
# index_topk=32: any prompt over 32 tokens is a sparse-attention prompt.
TINY_GLM5 = tiny_models.TinyModelSpec(arch="glm5", index_topk=32)
# attention_config that turns on Hybrid HiSparse's KV cache grouping.
HISPARSE = {"hisparse_config": {"host_pool_gib": 1}}
# The indexer's K cache stores 128-wide fp8 blocks, each followed by one fp32 scale
# (DeepSeek-V3.2 / GLM-5 indexer: quant_block_size = 128).
INDEXER_QUANT_BLOCK = 128
# The synthetic "sampled" token: a plain vocabulary id, not bos/eos/pad (ids 0-2).
DEFAULT_SAMPLED_TOKEN = 100


def seed_range(text: str) -> range:
    """Stress seeds from an environment value: "N" is seeds 0 to N-1, "A:B" seeds A to B-1
    (a long run continued where another stopped)."""
    start, _, stop = text.rpartition(":")
    try:
        return range(int(start or 0), int(stop))
    except ValueError:
        raise ValueError(f"a seed count N or a range A:B, not {text!r}") from None


def tiny_glm5_dir(spec: tiny_models.TinyModelSpec = TINY_GLM5) -> Path:
    """The cached tiny GLM-5 checkpoint (built on first use, about a second)."""
    return tiny_models.tiny_model_dir(spec, MODEL_CACHE)


def make_vllm_config(
    model: str | Path | None = None,
    *,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    attention_config: dict[str, Any] | None = None,
    async_scheduling: bool = False,
    **engine_args: Any,
) -> VllmConfig:
    """A real VllmConfig, as ``EngineArgs.create_engine_config`` makes it for an engine.

    ``model`` defaults to the tiny GLM-5 checkpoint; ``attention_config=HISPARSE`` turns
    on HiSparse's KV cache grouping. ``async_scheduling``: schedule a step ahead, as on
    CUDA (the CPU platform turns it off; it is turned back on after the platform's
    checks). Extra keyword arguments go to ``EngineArgs``.
    """
    from vllm.engine.arg_utils import EngineArgs

    args: dict[str, Any] = dict(
        model=str(model if model is not None else tiny_glm5_dir()),
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        **engine_args,
    )
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    if attention_config is not None:
        args["attention_config"] = attention_config
    vllm_config = EngineArgs(**args).create_engine_config()
    if async_scheduling:
        vllm_config.scheduler_config.async_scheduling = True
    return vllm_config


def model_kv_cache_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The KV cache specs the DSA model's layers report, in the order the worker reports them.

    Mirrors ``DeepseekV32IndexerCache.get_kv_cache_spec`` and
    ``MLAAttention.get_kv_cache_spec`` for each decoder layer: the layers register in
    construction order, the indexer (inside the attention module) before the attention
    layer, so each layer contributes ``...indexer.k_cache`` then ``...attn``.
    """
    import torch

    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    if getattr(hf, "index_topk", None) is None:
        raise ValueError(f"{model_config.model} is not a DSA (sparse-MLA) model: no index_topk")
    block_size = vllm_config.cache_config.block_size
    cache_dtype = vllm_config.cache_config.cache_dtype
    index_head_dim = hf.index_head_dim
    indexer_spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=index_head_dim + index_head_dim // INDEXER_QUANT_BLOCK * 4,
        dtype=torch.uint8,
    )
    mla_spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model_config),
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=656 if cache_dtype == "fp8_ds_mla" else None,
    )
    specs: dict[str, KVCacheSpec] = {}
    for i in range(hf.num_hidden_layers):
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer_spec
        specs[f"model.layers.{i}.self_attn.attn"] = mla_spec
    return specs


def _model_attention_backends(vllm_config: VllmConfig) -> list[type]:
    """The attention backend classes the model's two kinds of layers would select."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.selector import get_attn_backend

    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    with set_current_vllm_config(vllm_config):
        mla_backend = get_attn_backend(
            hf.kv_lora_rank + hf.qk_rope_head_dim,
            kv_cache_dtype_str_to_dtype(cache_dtype, model_config),
            cache_dtype,
            use_mla=True,
            use_sparse=True,
            num_heads=hf.num_attention_heads // vllm_config.parallel_config.tensor_parallel_size,
        )
    # As DeepseekV32IndexerCache.get_attn_backend chooses.
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.mla.cpu_dsa import CPUDSAIndexerBackend as indexer_backend
    else:
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend as indexer_backend
    return [indexer_backend, mla_backend]


def resolve_layout(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec]) -> str:
    """Resolve (and record on cache_config) the KV cache layout, as the engine core does.

    A layout already recorded wins (``hisparse_config`` records BLHNC at config time).
    """
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    backends = _model_attention_backends(vllm_config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(vllm_config, [supported], list(specs.values())).name


def build_kv_cache_config(
    vllm_config: VllmConfig,
    specs: dict[str, KVCacheSpec],
    *,
    num_blocks: int | None = None,
    memory_bytes: int | None = None,
) -> KVCacheConfig:
    """The scheduler's KVCacheConfig, following ``EngineCore._initialize_kv_caches``.

    Give exactly one of ``num_blocks`` (the block pool size, null block included; set
    through ``cache_config.num_gpu_blocks_override``, as ``--num-gpu-blocks-override``
    does) or ``memory_bytes`` (what a worker would report as available for KV cache).
    Like the engine core it updates ``vllm_config.cache_config`` (layout, num_gpu_blocks,
    block_size, capacity), so use one config per scheduler.
    """
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.hisparse.capacity.engine import scheduler_kv_cache_config

    if (num_blocks is None) == (memory_bytes is None):
        raise ValueError("give exactly one of num_blocks and memory_bytes")
    cache_config = vllm_config.cache_config
    if num_blocks is not None:
        cache_config.num_gpu_blocks_override = num_blocks
        memory_bytes = 0  # replaced by num_blocks x bytes per block
    register_all_kvcache_specs(vllm_config)
    worker_specs = [dict(specs)]  # one worker; get_kv_cache_configs may rewrite specs in place
    resolve_layout(vllm_config, worker_specs[0])
    kv_cache_configs = get_kv_cache_configs(vllm_config, worker_specs, [memory_bytes])
    return scheduler_kv_cache_config(vllm_config, kv_cache_configs)


@dataclass
class StepObservation:
    """What one harness step did and left behind.

    ``block_table_lengths`` and ``num_computed_tokens`` are taken right after
    ``schedule()`` (the tables a worker would receive; computed tokens already include
    the step's scheduled tokens, as the scheduler counts them) for the requests the
    scheduler holds; the queue sizes, free blocks, ``num_output_tokens`` (every request
    added so far) and ``finished`` are taken after ``update_from_output``.
    """

    step: int
    num_scheduled_tokens: dict[str, int]
    # req_id -> cached tokens of a request admitted (new, not resumed) in this step.
    new_request_cached_tokens: dict[str, int]
    num_preempted: int
    total_preemptions: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_computed_tokens: dict[str, int]
    block_table_lengths: dict[str, tuple[int, ...]]
    num_output_tokens: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    # With hisparse_config: the step's plan, and after update_from_output each
    # registered request's residency state ("full" / "mixed" / "none") and the counters.
    hisparse_plan: Any = None
    hisparse_states: dict[str, str] = field(default_factory=dict)
    hisparse_stats: dict[str, int] = field(default_factory=dict)


class SchedulerHarness:
    """A real Scheduler over a real KVCacheConfig, stepped with synthetic model output."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        specs: dict[str, KVCacheSpec] | None = None,
        sampled_token: int = DEFAULT_SAMPLED_TOKEN,
        runs_hisparse_plans: bool = True,
        report_delay: int | Callable[[], int] = 0,
        check_ownership: bool = True,
        accepted_drafts: Callable[[int], int] = lambda num_drafts: 0,
        nixl_read_fails: Callable[[], bool] | None = None,
    ) -> None:
        from vllm.config import hisparse as hisparse_config
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.hisparse.capacity.engine import build_scheduler

        self.vllm_config = vllm_config
        self.specs = specs if specs is not None else model_kv_cache_specs(vllm_config)
        # The harness plays the worker side of a build whose workers execute residency
        # plans (start-up sizing and admission follow); without runs_hisparse_plans it
        # is a worker that should run them but reports nothing.
        hisparse_config.workers_execute_plans = True
        self.kv_cache_config = build_kv_cache_config(
            vllm_config, self.specs, num_blocks=num_blocks, memory_bytes=memory_bytes
        )
        self.block_size, self.hash_block_size = resolve_kv_cache_block_sizes(
            self.kv_cache_config, vllm_config
        )
        self.scheduler: Scheduler
        self.scheduler, self.block_hasher = build_scheduler(vllm_config, self.kv_cache_config)
        hisparse_config.workers_execute_plans = None
        self.sampled_token = sampled_token
        self.runs_hisparse_plans = runs_hisparse_plans
        # Steps until a planned copy is reported: a number, or a function drawing one.
        self.report_delay = report_delay if callable(report_delay) else (lambda: report_delay)
        self.check_ownership = check_ownership
        self.accepted_drafts = accepted_drafts
        # With a function drawing whether a read fails, the harness plays the NIXL workers
        # (without one, a test reports their reads and sends itself).
        self.nixl_read_fails = nixl_read_fails
        # Draft tokens scheduled for verification, and those the fake sampler accepted.
        self.drafts_scheduled = 0
        self.drafts_accepted = 0
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        # Copy reports not yet delivered: (the step that delivers them, copy ids).
        self._reports: list[tuple[int, list[int]]] = []
        self._report_steps: list[tuple[int, int]] = []  # (due step, plan step) not yet reported
        # OffloadingConnector jobs not yet completed: (the step that completes them, job
        # id, the request of a load job or None for a store).
        self._jobs: list[tuple[int, int, str | None]] = []
        # NIXL reads not yet finished: (the step that finishes them, request, the blocks a
        # failed read names, the host pages it lands in); NIXL sends not yet finished: (the step, request).
        self._reads: list[tuple[int, str, set[int], list[int]]] = []
        self._sends: list[tuple[int, str]] = []
        # NIXL reads started, those that failed, and sends offered.
        self.nixl_counts: Counter[str] = Counter()
        # Failed reads (request, blocks named, host pages landed in), by the output reporting
        # them: checked once it is processed.
        self._failed_reads: dict[int, list[tuple[str, set[int], list[int]]]] = {}
        # Scheduled steps whose output is not processed yet, newest first, with that output.
        self._batches: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.batch_queue_size = vllm_config.max_concurrent_batches
        self.requests: dict[str, Request] = {}
        self.observations: list[StepObservation] = []
        self.total_preemptions = 0
        self._ids = itertools.count()

    @classmethod
    def create(
        cls,
        *,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        sampled_token: int = DEFAULT_SAMPLED_TOKEN,
        runs_hisparse_plans: bool = True,
        report_delay: int | Callable[[], int] = 0,
        check_ownership: bool = True,
        accepted_drafts: Callable[[int], int] = lambda num_drafts: 0,
        nixl_read_fails: Callable[[], bool] | None = None,
        drafter_layers: bool = False,
        **config_args: Any,
    ) -> SchedulerHarness:
        """A harness over a fresh ``make_vllm_config(**config_args)``; ``drafter_layers``
        takes the layer specs from the planner, which adds an MTP drafter's layers (and
        leaves out the indexer caches of layers that share another layer's)."""
        vllm_config = make_vllm_config(**config_args)
        specs = None
        if drafter_layers:
            from vllm.v1.hisparse.capacity.planner import layer_kv_cache_specs

            specs = layer_kv_cache_specs(vllm_config)
        return cls(
            vllm_config,
            num_blocks=num_blocks,
            memory_bytes=memory_bytes,
            specs=specs,
            sampled_token=sampled_token,
            runs_hisparse_plans=runs_hisparse_plans,
            report_delay=report_delay,
            check_ownership=check_ownership,
            accepted_drafts=accepted_drafts,
            nixl_read_fails=nixl_read_fails,
        )

    # ------------------------------------------------------------------ state

    @property
    def kv_cache_manager(self):
        return self.scheduler.kv_cache_manager

    @property
    def block_pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)

    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table, one list per KV cache group."""
        return self.kv_cache_manager.get_block_ids(request_id)

    @property
    def hisparse(self):
        """The scheduler's HiSparse state (None without hisparse_config)."""
        return self.scheduler.hisparse

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.skipped_waiting)

    def unfinished(self) -> list[str]:
        return [rid for rid, req in self.requests.items() if not req.is_finished()]

    # --------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        request_id: str | None = None,
        **sampling_args: Any,
    ) -> Request:
        """Add a request the way EngineCore does (EngineCoreRequest -> Request + block hasher)."""
        from vllm.v1.hisparse.capacity.engine import make_request

        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request = make_request(prompt_token_ids, max_tokens, request_id, self.block_hasher, **sampling_args)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    # ------------------------------------------------------------------ steps

    def schedule(self) -> SchedulerOutput:
        """The scheduler's step; its plan checked as it leaves the scheduler (a restore
        writes only into its own request's page) when ownership is checked."""
        stores = self._offloading_stores() if self.check_ownership else None
        free_before = (
            {b.block_id for b in self.block_pool.free_block_queue.get_all_free_blocks()} if stores else set()
        )
        output = self.scheduler.schedule()
        if self.hisparse is not None and self.check_ownership and output.hisparse_plan is not None:
            check_plan(self.hisparse.blocks, output.hisparse_plan)
        if stores:
            self._check_store_fence(stores, free_before, output)
        takes = getattr(self.scheduler.connector, "hisparse_block_takes", None)
        if self.check_ownership and takes is not None:
            # Nothing is taken after the connector's step is built: its fence saw every take.
            assert not takes._ids, f"blocks taken after the fence was built: {takes._ids}"
        return output

    def _offloading_stores(self) -> dict[int, set[int]] | None:
        """The OffloadingConnector's pending jobs by block (None without one)."""
        scheduler = getattr(self.scheduler.connector, "connector_scheduler", None)
        pending = getattr(scheduler, "_block_id_to_pending_jobs", None)
        return None if pending is None else {b: set(jobs) for b, jobs in pending.items()}

    def _check_store_fence(self, stores: dict[int, set[int]], free_before: set[int], output) -> None:
        """A block the step took from the free queue (for any group, a hot lease, staging)
        is written in its forward: a store job still reading it must be flushed first."""
        free_after = {b.block_id for b in self.block_pool.free_block_queue.get_all_free_blocks()}
        jobs = self.scheduler.connector.connector_scheduler._jobs
        flushed = set(output.kv_connector_metadata.jobs_to_flush)
        unfenced = {
            b: sorted(j for j in stores[b] if j in jobs and j not in flushed)
            for b in (free_before - free_after) & stores.keys()
        }
        unfenced = {b: j for b, j in unfenced.items() if j}
        assert not unfenced, f"blocks taken while stores read them, unflushed (block: jobs): {unfenced}"

    def model_runner_output(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """What the worker would return: ``sampled_token`` for every scheduled request whose
        prefill is complete after this step, nothing for a partial prefill chunk (the V1
        model runner's ``discard_request_mask``: computed tokens < tokens); and the copy
        reports due at this step. Made when the step is scheduled, as the worker runs it."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        spec = scheduler_output.scheduled_spec_decode_tokens
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is None:  # aborted after schedule(): the scheduler drops its output
                sampled.append([])
                continue
            done_prefill = request.num_computed_tokens >= request.num_tokens
            drafts = len(spec.get(req_id, ()))
            accepted = min(drafts, self.accepted_drafts(drafts)) if drafts else 0
            if done_prefill:
                self.drafts_scheduled += drafts
                self.drafts_accepted += accepted
            sampled.append([self.sampled_token] * (1 + accepted) if done_prefill else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self._connector_output(scheduler_output),
            hisparse_copied=self._copy_reports(scheduler_output),
            hisparse_reported_step=self._reported_step(scheduler_output),
        )

    def _connector_output(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        """The KV connector workers' report, for the connectors whose workers the harness plays."""
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorMetadata,
            MultiKVConnectorWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = scheduler_output.kv_connector_metadata
        if isinstance(meta, MultiKVConnectorMetadata):
            # A MultiConnector's workers: each connector's report, merged as upstream's
            # aggregation of its workers' reports is (its metadata, one per connector).
            outputs = [self._connector_output_of(sub) for sub in meta.metadata]
            if all(out is None for out in outputs):
                return None
            merged = KVConnectorOutput(
                finished_sending=set(),
                finished_recving=set(),
                kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(
                    tuple(out.kv_connector_worker_meta if out is not None else None for out in outputs)
                ),
            )
            failed_reads = []
            for out in outputs:
                if out is not None:
                    merged.finished_sending |= out.finished_sending or set()
                    merged.finished_recving |= out.finished_recving or set()
                    merged.invalid_block_ids |= out.invalid_block_ids
                    failed_reads += self._failed_reads.pop(id(out), [])
            # The failed reads are checked with the report the scheduler processes.
            self._failed_reads[id(merged)] = failed_reads
            return merged
        return self._connector_output_of(meta)

    def _connector_output_of(self, meta: Any) -> KVConnectorOutput | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

        if isinstance(meta, OffloadingConnectorMetadata):
            return self._offloading_output(meta)
        if isinstance(meta, NixlConnectorMetadata) and self.nixl_read_fails is not None:
            return self._nixl_output(meta, self.nixl_read_fails)
        return None

    def _nixl_output(self, meta: Any, read_fails: Callable[[], bool]) -> KVConnectorOutput:
        """The NIXL workers' report: reads and sends finished by now. A read the request
        waits for (``WAITING_FOR_REMOTE_KVS``) finishes ``report_delay`` steps after the
        step that starts it, failed where ``read_fails()`` says so, naming the request's
        blocks of every KV cache group as ``HostLandingNixlWorker`` does; a finished
        request's blocks held for a reader are let go ``report_delay`` steps after the
        step that offers them (the reader done, or its lease expired)."""
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.request import RequestStatus

        step = len(self.observations)
        for req_id, req_meta in meta.reqs_to_recv.items():
            request = self.scheduler.requests.get(req_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue  # no read the request waits for (a remote free only)
            failed = {b for group in req_meta.local_block_ids for b in group} if read_fails() else set()
            landed = list(getattr(meta, "host_landing", {}).get(req_id, {}).values())
            self._reads.append((step + self.report_delay(), req_id, failed, landed))
            self.nixl_counts["reads"] += 1
            self.nixl_counts["reads_failed"] += bool(failed)
            self.nixl_counts["reads_landing_on_host"] += bool(landed)
        self._sends += [(step + self.report_delay(), req_id) for req_id in meta.reqs_to_send]
        self.nixl_counts["sends"] += len(meta.reqs_to_send)
        reads = [read for read in self._reads if read[0] <= step]
        self._reads = [read for read in self._reads if read[0] > step]
        sends = {req_id for at, req_id in self._sends if at <= step}
        self._sends = [send for send in self._sends if send[0] > step]
        output = KVConnectorOutput(
            finished_recving={req_id for _, req_id, _, _ in reads},
            finished_sending=sends,
            invalid_block_ids={b for _, _, failed, _ in reads for b in failed},
        )
        # The failed reads, checked once their failure is processed (`step`): the requests
        # and blocks they name, and the host pages they were landing in.
        self._failed_reads[id(output)] = [
            (req_id, failed, landed) for _, req_id, failed, landed in reads if failed
        ]
        return output

    def _offloading_output(self, meta: Any) -> KVConnectorOutput:
        """The OffloadingConnector workers' report: jobs done by now, loads finished."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        step = len(self.observations)
        for jobs, is_load in ((meta.load_jobs, True), (meta.store_jobs, False)):
            for job_id, job in jobs.items():
                self._jobs.append((step + self.report_delay(), job_id, job.req_id if is_load else None))
        done = [job for job in self._jobs if job[0] <= step]
        self._jobs = [job for job in self._jobs if job[0] > step]
        loading = {req_id for _, _, req_id in self._jobs if req_id is not None}
        finished = {req_id for _, _, req_id in done if req_id is not None} - loading
        worker_meta = OffloadingWorkerMetadata(completed_jobs={job_id: 1 for _, job_id, _ in done})
        return KVConnectorOutput(finished_recving=finished, kv_connector_worker_meta=worker_meta)

    def _propose_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """The drafter's proposals for the step's requests (the scheduler drops those of
        a request still prefilling)."""
        from vllm.v1.outputs import DraftTokenIds

        req_ids = [r for r in scheduler_output.num_scheduled_tokens if r in self.scheduler.requests]
        if req_ids:
            drafts = [[self.sampled_token] * self.num_speculative_tokens for _ in req_ids]
            self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _copy_reports(self, scheduler_output: SchedulerOutput) -> list[int] | None:
        """The copy ids this step's worker reports: its own copies after their delay, and
        earlier steps' whose delay is over."""
        plan = scheduler_output.hisparse_plan
        if plan is None or not self.runs_hisparse_plans:
            return None
        step = len(self.observations)
        delay = self.report_delay()
        if plan.copies:
            self._reports.append((step + delay, [c.copy_id for c in plan.copies]))
        self._report_steps.append((step + delay, plan.step))
        due = [ids for at, ids in self._reports if at <= step]
        self._reports = [(at, ids) for at, ids in self._reports if at > step]
        self._report_steps = [(at, s) for at, s in self._report_steps if at > step]
        return [copy_id for ids in due for copy_id in ids]

    def _reported_step(self, scheduler_output: SchedulerOutput) -> int | None:
        """The latest plan step every step up to which is reported (a worker collects its
        reports in order): the one before the oldest still pending."""
        plan = scheduler_output.hisparse_plan
        if plan is None or not self.runs_hisparse_plans:
            return None
        return min((s for _, s in self._report_steps), default=plan.step + 1) - 1

    def step(self) -> StepObservation:
        """One EngineCore step: schedule, synthetic forward, update_from_output. With
        ``async_scheduling``, a step whose batch queue has room only schedules, and the
        oldest batch's output is processed once the queue is full or nothing more can be
        scheduled (``EngineCore.step_with_batch_queue``)."""
        scheduler_output = None
        num_preempted = 0
        cached: dict[str, int] = {}
        if self.scheduler.has_requests() or not self._batches:
            scheduler_output = self.schedule()
            self._batches.appendleft((scheduler_output, self.model_runner_output(scheduler_output)))
            num_preempted = len(scheduler_output.preempted_req_ids or ())
            self.total_preemptions += num_preempted
            cached = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        live = [rid for rid in self.scheduler.requests if rid in self.requests]
        num_computed = {rid: self.requests[rid].num_computed_tokens for rid in live}
        table_lengths = {rid: tuple(len(ids) for ids in self.block_ids(rid)) for rid in live}
        was_unfinished = set(self.unfinished())

        executed = scheduler_output is not None and scheduler_output.total_num_scheduled_tokens > 0
        queue_has_room = len(self._batches) < self.batch_queue_size
        if not (queue_has_room and (executed or self.scheduler.has_requests())):
            done, output = self._batches.pop()
            self.scheduler.update_from_output(done, output)
            self._check_failed_reads(output)
            if self.num_speculative_tokens and self.batch_queue_size == 1:
                self._propose_drafts(done)

        observation = StepObservation(
            step=len(self.observations),
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens) if scheduler_output else {},
            new_request_cached_tokens=cached,
            num_preempted=num_preempted,
            total_preemptions=self.total_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=self.num_waiting(),
            num_free_blocks=self.num_free_blocks(),
            num_computed_tokens=num_computed,
            block_table_lengths=table_lengths,
            num_output_tokens={rid: req.num_output_tokens for rid, req in self.requests.items()},
            finished=sorted(was_unfinished - set(self.unfinished())),
        )
        if self.hisparse is not None:
            observation.hisparse_plan = scheduler_output.hisparse_plan if scheduler_output else None
            observation.hisparse_states = {
                rid: req.state.value for rid, req in self.hisparse.residency.requests.items()
            }
            observation.hisparse_stats = self.hisparse.stats()
            if self.check_ownership:
                self.hisparse.check_ownership()
        self.observations.append(observation)
        return observation

    def _check_failed_reads(self, output: ModelRunnerOutput) -> None:
        """Once a failed read is processed, its request counts as computed nothing its
        failed blocks hold (it recomputes from the first, in every group's block size), and
        none of the host pages it was landing in (never filled) is published in the host
        pool, where a later hit would read it."""
        groups = self.kv_cache_config.kv_cache_groups
        for req_id, failed, landed in self._failed_reads.pop(id(output.kv_connector_output), []):
            request = self.scheduler.requests.get(req_id)
            if request is not None and not request.is_finished():
                for g, ids in enumerate(self.block_ids(req_id)):
                    first = next((i for i, b in enumerate(ids) if b in failed), None)
                    bound = None if first is None else first * groups[g].kv_cache_spec.block_size
                    assert bound is None or request.num_computed_tokens <= bound, (
                        f"{req_id} counts {request.num_computed_tokens} tokens computed; its read failed "
                        f"from token {bound} (group {g})"
                    )
            if self.hisparse is not None:
                pool = self.hisparse.residency.host_pool
                published = [page for page in landed if pool.is_indexed(page)]
                assert not published, f"host pages of failed reads published: {published}"

    def busy(self) -> bool:
        """Whether the engine would step again: requests, pending work, batches in flight, or
        NIXL reads and sends not yet reported."""
        return self.scheduler.has_requests() or bool(self._batches or self._reads or self._sends)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests the way the engine does for a client that went away."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def run_until_done(self, max_steps: int = 1000, *, strict: bool = True) -> list[StepObservation]:
        """Step until the scheduler has no requests left; return this call's observations.

        With ``strict`` (default), not finishing within ``max_steps`` raises RuntimeError.
        """
        observations: list[StepObservation] = []
        for _ in range(max_steps):
            if not self.busy():
                return observations
            observations.append(self.step())
        if strict and self.busy():
            raise RuntimeError(
                f"requests {self.unfinished()} unfinished after {max_steps} steps; "
                f"last step: {observations[-1] if observations else None}"
            )
        return observations


def kv_cache_config_summary(config: KVCacheConfig) -> list[tuple[list[str], type, int, int]]:
    """(layer names, spec class, page size in bytes, block size) per KV cache group."""
    summary = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        summary.append((list(group.layer_names), type(spec), spec.page_size_bytes, spec.block_size))
    return summary


def record_lease_attempts(monkeypatch, admissions) -> list[str]:
    """From now on, each hot-lease attempt of `admissions`, in order: "walk" for the walk's
    room check at a hit's first host page, "lease" for taking a lease."""
    attempts: list[str] = []
    room, take = admissions._room_for_lease, admissions._take_lease

    def counted_room(request):
        attempts.append("walk")
        return room(request)

    def counted_take(request):
        attempts.append("lease")
        return take(request)

    monkeypatch.setattr(admissions, "_room_for_lease", counted_room)
    monkeypatch.setattr(admissions, "_take_lease", counted_take)
    return attempts


def record_host_lookups(monkeypatch, pool) -> Counter:
    """From now on, how often the host pool `pool` looks each block hash up (one by one, and
    in the batches of `lookup_all`)."""
    looked_up: Counter = Counter()
    lookup, lookup_all = pool.lookup, pool.lookup_all

    def counted_lookup(block_hash):
        looked_up[block_hash] += 1
        return lookup(block_hash)

    def counted_lookup_all(block_hashes):
        looked_up.update(block_hashes)
        return lookup_all(block_hashes)

    monkeypatch.setattr(pool, "lookup", counted_lookup)
    monkeypatch.setattr(pool, "lookup_all", counted_lookup_all)
    return looked_up
