"""Helpers for tests through the real engine on CPU: tiny DSA checkpoints, LLM lifecycle, metrics."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import tiny_models

REPO = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO / ".cache" / "tiny-models"

# Sharp weights (init_std=0.2) give peaked next-token distributions, so a wrong
# attention row changes greedy tokens and logprobs visibly; index_topk=32 makes
# every prompt longer than 32 tokens exercise sparse selection.
SPARSE_GLM5 = tiny_models.TinyModelSpec(arch="glm5", init_std=0.2, index_topk=32)
# Engine settings that fit the 2-core, 24 GiB test machines.
ENGINE_DEFAULTS = dict(
    max_model_len=1024,
    enforce_eager=True,
    seed=0,
    kv_cache_memory_bytes=256 << 20,
    gpu_memory_utilization=0.3,
    disable_log_stats=False,
)


def model_dir(spec: tiny_models.TinyModelSpec) -> Path:
    return tiny_models.tiny_model_dir(spec, MODEL_CACHE)


@contextmanager
def running_llm(model: Path, **overrides) -> Iterator:
    """An LLM on CPU that is shut down (and its memory returned) on exit."""
    from vllm import LLM

    llm = LLM(model=str(model), **{**ENGINE_DEFAULTS, **overrides})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@contextmanager
def offloading_connector(spec_name: str, cpu_bytes: int = 64 << 20, label: str = "test") -> Iterator[dict]:
    """The OffloadingConnector's --kv-transfer-config with an engine id of its own.

    The id names the tiering spec's shared region (/dev/shm/vllm_offload_<engine id>*),
    which is removed on exit, so runs never see each other's stores.
    """
    engine_id = f"{label}-{uuid.uuid4().hex}"
    try:
        yield {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_connector_extra_config": {"spec_name": spec_name, "cpu_bytes_to_use": cpu_bytes},
        }
    finally:
        for leftover in Path("/dev/shm").glob(f"vllm_offload_{engine_id}*"):
            leftover.unlink(missing_ok=True)


def metric_total(llm, name: str) -> float:
    """Sum of a counter (all label sets) as the engine's Prometheus registry reports it."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)
