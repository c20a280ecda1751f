# SPDX-License-Identifier: Apache-2.0
"""vLLM's real scheduler with no model behind it: what `EngineCore` builds before its first step.

Owns building a `Scheduler` over a KV cache config the way the engine core does
(`_initialize_kv_caches`, then the scheduler class the config names, with the block
hasher prefix caching uses) and making `Request`s the way `preprocess_add_request`
does. The capacity simulator and the test suite's scheduler harness both drive the
scheduler built here; neither runs a worker, so nothing is allocated on a device
or in a host pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def scheduler_kv_cache_config(vllm_config: VllmConfig, worker_configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The scheduler's KV cache config from the workers', recorded on `cache_config` as the
    engine core records it (blocks, block size, capacity)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, update_kv_cache_capacity

    cache_config = vllm_config.cache_config
    for config in worker_configs:
        config.kv_cache_layout = cache_config.kv_cache_layout
    scheduler_config = generate_scheduler_kv_cache_config(worker_configs)
    cache_config.num_gpu_blocks = scheduler_config.num_blocks
    if scheduler_config.kv_cache_groups:
        cache_config.block_size = min(g.kv_cache_spec.block_size for g in scheduler_config.kv_cache_groups)
        update_kv_cache_capacity(vllm_config, scheduler_config)
    vllm_config.validate_block_size()
    return scheduler_config


def make_block_hasher(
    vllm_config: VllmConfig, hash_block_size: int
) -> Callable[[Request], list[BlockHash]] | None:
    """The request block hasher EngineCore installs (None when prefix caching is off)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not vllm_config.cache_config.enable_prefix_caching and vllm_config.kv_transfer_config is None:
        return None
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)


def build_scheduler(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, workers_execute_plans: bool = True
) -> tuple[Scheduler, Callable[[Request], list[BlockHash]] | None]:
    """The scheduler the config names over `kv_cache_config` (the scheduler's own, from
    `scheduler_kv_cache_config`), and the block hasher for its requests.

    `workers_execute_plans`: build it as for workers that execute HiSparse's residency
    plans (a GPU), whatever machine this runs on.
    """
    from vllm.config import hisparse as hisparse_settings
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    saved = hisparse_settings.workers_execute_plans
    hisparse_settings.workers_execute_plans = workers_execute_plans
    try:
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
        scheduler = scheduler_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            include_finished_set=False,
            log_stats=True,
        )
    finally:
        hisparse_settings.workers_execute_plans = saved
    assert isinstance(scheduler, Scheduler), f"{scheduler_cls.__name__} is not vLLM's Scheduler"
    return scheduler, make_block_hasher(vllm_config, hash_block_size)


def make_request(
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    request_id: str,
    block_hasher: Callable[[Request], list[BlockHash]] | None,
    arrival_time: float | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    **sampling_args: Any,
) -> Request:
    """A Request as EngineCore makes it from an EngineCoreRequest (ignoring EOS, so it
    produces exactly `max_tokens`); `priority` orders it under the priority policy (lower
    first); `cache_salt` keeps its prefix cache apart from other salts'."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling_args)
    core_request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        lora_request=None,
        cache_salt=cache_salt,
        data_parallel_rank=None,
        priority=priority,
    )
    return Request.from_engine_core_request(core_request, block_hasher)
