# SPDX-License-Identifier: Apache-2.0
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


@contextmanager
def prefill_chunks(record: dict | None = None, replay: dict | None = None) -> Iterator[None]:
    """Record the prefill chunks in-process engines schedule, or cap theirs to recorded ones.

    Keys are (prompt token ids, tokens computed before the chunk); values are the
    chunk's size. Replaying a run's chunks in a run whose token budget is at least as
    large makes the second compute every prompt in the same pieces. That matters to
    an oracle: the indexer scores queries against fp8 keys, and a chunk of another
    length changes the shapes of its matmuls, which alone (even in fp32) can move a
    score across a near-tie and swap a token in the top-K.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    cap, schedule = Scheduler._reserve_prefill_lookahead, Scheduler.schedule

    def capped(self, request, num_computed_tokens, num_new_tokens):
        num_new_tokens = cap(self, request, num_computed_tokens, num_new_tokens)
        key = (tuple(request.prompt_token_ids), num_computed_tokens)
        if replay is not None and key in replay and num_computed_tokens < request.num_prompt_tokens:
            num_new_tokens = min(num_new_tokens, replay[key])
        return num_new_tokens

    def recorded(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        for request_id, n in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens - n
            if start < request.num_prompt_tokens:
                record[(tuple(request.prompt_token_ids), start)] = n
        return output

    Scheduler._reserve_prefill_lookahead = capped
    if record is not None:
        Scheduler.schedule = recorded
    try:
        yield
    finally:
        Scheduler._reserve_prefill_lookahead, Scheduler.schedule = cap, schedule


@contextmanager
def scheduled_steps(record: list | None = None, replay: list | None = None) -> Iterator[None]:
    """Record which requests (by prompt) each schedule() call served, or serve only those.

    Replayed, a step's other requests are out of the scheduler's sight for that call
    (running ones keep their blocks) and come back in their places after it. With the
    prefill chunks replayed too, the second run's forwards hold the same requests with
    the same tokens as the first's: the CPU's matmuls may round a row differently in a
    batch of another size, which, like a chunk of another length, can swap an fp8
    near-tie in the indexer's top-K.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = Scheduler.schedule
    steps = iter(replay if replay is not None else ())

    def key(request) -> tuple[int, ...]:
        return tuple(request.prompt_token_ids)

    def gated(self, *args, **kwargs):
        allowed = next(steps, None) if replay is not None else None
        if allowed is None:
            output = schedule(self, *args, **kwargs)
        else:
            running, waiting = list(self.running), list(self.waiting)
            hidden = {id(r) for r in running + waiting if key(r) not in allowed}
            self.running = [r for r in running if id(r) not in hidden]
            self.waiting.remove_requests([r for r in waiting if id(r) in hidden])
            try:
                output = schedule(self, *args, **kwargs)
            finally:
                now_running, now_waiting = {id(r) for r in self.running}, {id(r) for r in self.waiting}
                self.running = [r for r in running if id(r) in hidden or id(r) in now_running] + [
                    r for r in self.running if all(r is not q for q in running)
                ]
                back = [r for r in waiting if id(r) in hidden or id(r) in now_waiting]
                back += [r for r in self.waiting if all(r is not q for q in waiting)]
                self.waiting.clear()
                self.waiting.extend(back)
        if record is not None:
            record.append(frozenset(key(self.requests[rid]) for rid in output.num_scheduled_tokens))
        return output

    Scheduler.schedule = gated
    try:
        yield
    finally:
        Scheduler.schedule = schedule


def scheduled_chunks(record: dict) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's chunk sizes, in order, from a `prefill_chunks` record."""
    by_prompt: dict[tuple[int, ...], dict[int, int]] = {}
    for (prompt, start), size in record.items():
        by_prompt.setdefault(prompt, {})[start] = size
    chunks = {}
    for prompt, sizes in by_prompt.items():
        start, out = min(sizes), []
        while start in sizes:
            out.append(sizes[start])
            start += sizes[start]
        chunks[prompt] = out
    return chunks
