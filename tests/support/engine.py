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
def scheduled_steps(
    record: list | None = None, replay: list | None = None, loads: set | None = None
) -> Iterator[None]:
    """Record which requests (by prompt) each schedule() call served, or serve only those.

    Replayed, a step's other requests are out of the scheduler's sight for that call
    (running ones keep their blocks, waiting ones their places, in either waiting queue)
    and come back in their places after it. With the prefill chunks replayed too, the
    second run's forwards hold the same requests with the same tokens as the first's: the
    CPU's matmuls may round a row differently in a batch of another size, which, like a
    chunk of another length, can swap a near-tie in the indexer's top-K.

    A KV connector's loads finish after a number of steps that neither run controls, so
    with `loads` a replay waits for them instead of letting them move requests between
    forwards. Recording, `loads` collects the requests whose connector load the first run
    started. Replaying, a step whose requests include one of those not yet looked up
    first shows the scheduler only such requests (their lookups start the loads, and
    nothing is computed); while a step's request still waits for its load, the scheduler
    sees no request at all. Neither call uses up the step. A request that the replay
    looks up and that does not wait for a load is computed alone, which the comparison
    of the forwards then shows.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    remote_kvs = RequestStatus.WAITING_FOR_REMOTE_KVS
    schedule = Scheduler.schedule
    steps = list(replay) if replay is not None else []
    position = 0
    looked_up: set[str] = set()

    def key(request) -> tuple[int, ...]:
        return tuple(request.prompt_token_ids)

    def loading(self, request) -> bool:
        return request.status == remote_kvs and request.request_id not in self.finished_recving_kv_req_ids

    def visible_for(self, allowed) -> tuple[set[int], bool]:
        """The requests the scheduler may see this call, and whether it uses up the step."""
        queued = list(self.waiting) + list(self.skipped_waiting)
        mine = [r for r in queued if key(r) in allowed]
        if loads is not None:
            fresh = [
                r
                for r in mine
                if key(r) in loads and r.request_id not in looked_up and r.status == RequestStatus.WAITING
            ]
            if fresh:
                looked_up.update(r.request_id for r in fresh)
                return {id(r) for r in fresh}, False
        if any(loading(self, r) for r in mine):
            return set(), False
        return {id(r) for r in list(self.running) + queued if key(r) in allowed}, True

    def restore(before: list, now: list, hidden: set[int]) -> list:
        """`before` in its order, less what left while visible, then what joined."""
        kept = {id(r) for r in now}
        return [r for r in before if id(r) in hidden or id(r) in kept] + [
            r for r in now if all(r is not q for q in before)
        ]

    def gated(self, *args, **kwargs):
        nonlocal position
        if replay is None or position >= len(steps):
            output = schedule(self, *args, **kwargs)
        else:
            visible, uses_step = visible_for(self, steps[position])
            running, waiting, skipped = list(self.running), list(self.waiting), list(self.skipped_waiting)
            hidden = {id(r) for r in running + waiting + skipped if id(r) not in visible}
            self.running = [r for r in running if id(r) not in hidden]
            self.waiting.remove_requests([r for r in waiting if id(r) in hidden])
            self.skipped_waiting.remove_requests([r for r in skipped if id(r) in hidden])
            try:
                output = schedule(self, *args, **kwargs)
            finally:
                self.running = restore(running, list(self.running), hidden)
                for queue, before in ((self.waiting, waiting), (self.skipped_waiting, skipped)):
                    back = restore(before, list(queue), hidden)
                    queue.clear()
                    queue.extend(back)
            position += uses_step
        if record is not None:
            record.append(frozenset(key(self.requests[rid]) for rid in output.num_scheduled_tokens))
        if loads is not None and replay is None:
            loads.update(key(r) for r in self.skipped_waiting if r.status == remote_kvs)
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
