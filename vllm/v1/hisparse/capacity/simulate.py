# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm.v1.hisparse.capacity simulate`: the real scheduler at production scale.

Owns running vLLM's `Scheduler` and KV cache manager, at the block counts the
planner computes for the node, on the announcement's agentic workload, in four
configurations with the same host memory:

- `preemption`: neither flag; under pressure vLLM preempts and recomputes;
- `offload`: the OffloadingConnector with all the host memory (512 GiB);
- `hybrid`: Hybrid HiSparse's pool (384 GiB) and the connector (128 GiB);
- `always`: the same with HiSparse's mode "always": offloading from the start.

What is real: the scheduler, its KV cache manager and prefix cache, HiSparse's
scheduling (residency, hot leases, relief, staging, host pool accounting) and the
OffloadingConnector's scheduler side. What is modelled: the worker. Each step's
duration comes from `step_model.StepModel` (documented constants, overridable from
JSON); the worker's reports (sampled tokens, MTP acceptance, copies landed, transfer
jobs done) are made up from that model's clock. Nothing allocates device or host
pool memory, and no model runs.

Sessions are closed-loop: a session's next turn arrives when its previous turn
ends, and resends the conversation so far (previous prompt, the answer, a new tool
result), so the history is a prefix the server may still hold.
"""

from __future__ import annotations

import argparse
import array
import copy
import dataclasses
import gc
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.hisparse.capacity import planner
from vllm.v1.hisparse.capacity.engine import build_scheduler, make_request, scheduler_kv_cache_config
from vllm.v1.hisparse.capacity.step_model import (
    CONSTANTS,
    ModelShape,
    ScheduledWork,
    StepModel,
    load_constants,
)
from vllm.v1.hisparse.kv_grouping import KV_LAYOUTS, kv_layout, page_layout_block_bytes
from vllm.v1.hisparse.ownership import OwnershipError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

GiB = 1 << 30
CONFIGS = ("preemption", "offload", "hybrid", "always")
# The planner's configuration each one runs (always: the hybrid one, mode "always").
PLANNED_AS: dict[str, planner.Configuration] = {
    "preemption": "none",
    "offload": "offload",
    "hybrid": "hybrid",
    "always": "hybrid",
}
# The announcement's two flags (its vllm serve line) and benchmark settings.
ANNOUNCEMENT_ATTENTION_CONFIG = '{"hisparse_config":{"host_pool_gib":384}}'
ANNOUNCEMENT_KV_TRANSFER_CONFIG = (
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
    '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":137438953472}}'
)
ANNOUNCEMENT_SPECULATIVE_CONFIG = '{"method":"mtp","num_speculative_tokens":3}'
H200_GIB = 141
# OffloadingConnector specs whose scheduler side allocates host memory, simulated with the
# CPU spec's manager (the same block count and eviction policy, bookkeeping only).
MAPPED_SPECS = ("TieringOffloadingSpec",)
DEFAULT_CONCURRENCY = (8, 16, 32, 64)
QUICK_TURNS = 3
# The mix (OpenHands sessions and a 1M-token one) runs at the announcement's concurrency.
DEFAULT_MIX_CONCURRENCY = 32
# The synthetic sampled token: a plain vocabulary id (not bos/eos/pad).
SAMPLED_TOKEN = 100
# Figures from real code (the scheduler, HiSparse, the connector, wall clocks here)
# and from the step model.
MEASURED = (
    "mean_running_per_step",
    "max_running",
    "preemptions",
    "recomputed_prompt_tokens",
    "new_prompt_tokens",
    "pages_demoted",
    "host_pages_used_max",
    "blocks_copied_on_device",
    "steps",
    "scheduler_ms_per_step",
    "scheduler_ms_p99",
    "scheduler_s_total",
    "scheduler_us_per_scheduled_request",
    "scheduler_ms_turn_steps",
    "scheduler_ms_other_steps",
    "requests_failed",
    "requests",
    "output_tokens",
    "ownership_checks",
)
SIMULATED = (
    "mean_running",
    "mean_running_all",
    "steady_state_s",
    "output_tokens_per_s",
    "per_user_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "later_turn_ttft_p50_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "simulated_s",
    "scheduler_share_of_step",
    "steps_scheduler_over_step",
    "bytes_to_host",
    "bytes_from_host",
)


@dataclass(frozen=True)
class Workload:
    """Closed-loop sessions: `turns` turns each, and `long_sessions` of them one turn of
    `long_session_tokens` instead."""

    name: str
    turns: int = 13
    first_turn_tokens: int = 74_160
    turn_tokens: int = 753
    output_tokens: int = 220
    long_sessions: int = 0
    long_session_tokens: int = 1_000_000

    def session_tokens(self) -> int:
        return self.first_turn_tokens + (self.turns - 1) * self.turn_tokens + self.turns * self.output_tokens

    def max_model_len(self, admission: int) -> int:
        if self.long_sessions:
            return max(admission, self.long_session_tokens + self.output_tokens)
        return admission


# The announcement's OpenHands sessions.
OPENHANDS = Workload("openhands")


class SimulationError(RuntimeError):
    pass


@dataclass
class Record:
    """One configuration at one concurrency on one workload."""

    config: str
    concurrency: int
    workload: str
    started: bool = True
    refusal: str | None = None
    stalled: str | None = None
    requests: int = 0
    sessions_completed: int = 0
    long_sessions_completed: int = 0
    # Time-weighted on the simulated clock: in the steady state (every session past its
    # first token, none finished; the whole run where that is empty), and over the run.
    mean_running: float = 0.0
    mean_running_all: float = 0.0
    steady_state_s: float = 0.0
    mean_running_per_step: float = 0.0
    max_running: int = 0
    preemptions: int = 0
    new_prompt_tokens: int = 0
    recomputed_prompt_tokens: int = 0
    pages_demoted: int = 0
    host_pages_used_max: int = 0
    # Blocks the scheduler asked the workers to copy on the device: the page layout's
    # resident blocks that prefix hits end inside (vLLM's copy-on-write).
    blocks_copied_on_device: int = 0
    requests_failed: int = 0
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    per_user_tokens_per_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    later_turn_ttft_p50_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p99_s: float = 0.0
    simulated_s: float = 0.0
    steps: int = 0
    scheduler_ms_per_step: float = 0.0
    scheduler_ms_p99: float = 0.0
    # The same time over the whole run, and per request scheduled in a step: a policy that
    # runs more requests at once schedules more of them per step, and takes fewer steps.
    scheduler_s_total: float = 0.0
    scheduler_us_per_scheduled_request: float = 0.0
    # Its mean over the steps that scheduled a new request (a turn's admission, which looks
    # up and registers its whole history), and over the other steps.
    scheduler_ms_turn_steps: float = 0.0
    scheduler_ms_other_steps: float = 0.0
    # The scheduler's measured CPU time against the simulated steps it scheduled: its sum
    # over theirs, and the share of steps it outlasted. With async scheduling (vLLM's
    # default) the next step is scheduled while the GPU runs this one, so only a
    # scheduler step longer than the GPU's delays it.
    scheduler_share_of_step: float = 0.0
    steps_scheduler_over_step: float = 0.0
    # HiSparse's ownership checks run (`--check-ownership`: after every schedule and output).
    ownership_checks: int = 0
    wall_s: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)


def _time_mean(timeline: Sequence[tuple[float, float, int]], start: float, end: float) -> float:
    """Mean of the running count over [start, end] of the simulated clock."""
    total = 0.0
    for at, seconds, running in timeline:
        overlap = min(at + seconds, end) - max(at, start)
        if overlap > 0:
            total += running * overlap
    return total / (end - start) if end > start else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class _Turn:
    session: int
    turn: int
    request_id: str
    arrival: float
    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    last_turn: int
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class _Session:
    index: int
    rng: random.Random
    turns: int
    first_tokens: int
    # The client's copy of the conversation: an array, which the garbage collector does not
    # walk, because in a deployment it lives in the client, not in the engine's process.
    prompt: array.array[int] = field(default_factory=lambda: array.array("i"))
    history: int = 0  # tokens the previous turn computed (prompt and answer)
    turn: int = 0
    long: bool = False


class _Link:
    """One direction of a GPU's PCIe link: transfers queue on it in order."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0

    def send(self, now: float, nbytes: float) -> float:
        """Queue a transfer; when it has crossed."""
        start = max(now, self.free_at)
        self.free_at = start + (nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)
        return self.free_at


class StepAccounting:
    """The scheduler-side figures of a run, taken from each step's `SchedulerOutput` right
    after `schedule()`: the same for the simulator and for a real engine (whose scheduler
    is wrapped to call `observe`), so the two can be compared."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.running: list[int] = []  # requests running, per step that computed tokens
        self.preemptions = 0
        self.prompt_tokens_computed = 0  # tokens of steps that were not a request's decode

    def is_decode(self, request: Request, num_tokens: int) -> bool:
        start = request.num_computed_tokens - num_tokens
        return request.num_output_tokens > 0 and start >= request.num_tokens - 1

    def observe(self, output: SchedulerOutput) -> None:
        self.preemptions += len(getattr(output, "preempted_req_ids", None) or ())
        if output.total_num_scheduled_tokens <= 0:
            return
        self.running.append(len(self.scheduler.running))
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None and not self.is_decode(request, n):
                self.prompt_tokens_computed += n

    def mean_running(self) -> float:
        return statistics.fmean(self.running) if self.running else 0.0

    def recomputed(self, new_prompt_tokens: int) -> int:
        """Prompt tokens computed beyond each turn's new ones: history and preempted work again."""
        return max(0, self.prompt_tokens_computed - new_prompt_tokens)


class Simulation:
    """One configuration, one concurrency: the real scheduler stepped on a simulated clock."""

    def __init__(
        self,
        config: str,
        configuration: planner.ConfigurationPlan,
        workload: Workload,
        concurrency: int,
        constants: dict[str, float],
        weight_bytes: int | None,
        seed: int = 0,
        check_ownership: bool = False,
    ) -> None:
        from vllm.v1.hisparse.capacity.planner import (
            _quiet_vllm,
            _where_hisparse_runs,
            kv_cache_configs_or_refusal,
        )

        self.config = config
        self.workload = workload
        self.concurrency = concurrency
        self.seed = seed
        self.record = Record(config=config, concurrency=concurrency, workload=workload.name)
        vllm_config: VllmConfig = copy.deepcopy(configuration.vllm_config)
        self.vllm_config = vllm_config
        transfer = vllm_config.kv_transfer_config
        if transfer is not None and transfer.kv_connector_extra_config.get("spec_name") in MAPPED_SPECS:
            # The tiering spec's scheduler side maps the whole host region at start-up; the
            # CPU spec keeps the same blocks with the same policy in plain bookkeeping.
            transfer.kv_connector_extra_config = {
                **transfer.kv_connector_extra_config,
                "spec_name": "CPUOffloadingSpec",
            }
        max_model_len = vllm_config.model_config.max_model_len
        with _where_hisparse_runs(), _quiet_vllm():
            worker_config = kv_cache_configs_or_refusal(
                vllm_config, configuration.specs, configuration.kv_cache_bytes, max_model_len
            )
            if isinstance(worker_config, str):
                self.record.started = False
                self.record.refusal = planner.first_sentence(worker_config)
                self.scheduler = None
                return
            kv_cache_config = scheduler_kv_cache_config(vllm_config, [worker_config])
            self.scheduler, self.block_hasher = build_scheduler(vllm_config, kv_cache_config)
        self.kv_cache_config = kv_cache_config
        self.model = StepModel(ModelShape.from_config(vllm_config, weight_bytes), constants)
        self.h2d = _Link(constants["h2d_bytes_per_s"])
        self.d2h = _Link(constants["d2h_bytes_per_s"])
        self.world_size = vllm_config.parallel_config.world_size
        self.vocab = vllm_config.model_config.get_vocab_size()
        self.hisparse = getattr(self.scheduler, "hisparse", None)
        if check_ownership and self.hisparse is not None:
            # After every schedule() and every output, as VLLM_HISPARSE_CHECK_OWNERSHIP=1 does.
            self.hisparse.check_each_step = True
        self.page_bytes = 0
        if self.hisparse is not None:
            from vllm.config.hisparse import sparse_mla_page_bytes

            self.page_bytes = sparse_mla_page_bytes(vllm_config)
        self.connector_block_bytes = self._connector_block_bytes()
        # One block of the page layout's pool on a GPU (the only layout whose hits copy blocks).
        self.block_bytes = page_layout_block_bytes(kv_cache_config.kv_cache_groups) or 0
        self.rng = random.Random(seed)

    # ----------------------------------------------------------------- set-up

    def _connector_block_bytes(self) -> list[int]:
        """Bytes one block of each of the connector's KV cache groups holds on a GPU."""
        if self.vllm_config.kv_transfer_config is None:
            return []
        from vllm.v1.hisparse.offloading import hisparse_connector_view

        _, view = hisparse_connector_view(self.vllm_config, self.kv_cache_config)
        return [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in view.kv_cache_groups]

    def _tokens(self, rng: random.Random, n: int) -> array.array[int]:
        return array.array("i", [rng.randrange(3, self.vocab) for _ in range(n)])

    # ------------------------------------------------------------------ run

    def run(self, max_steps: int = 2_000_000) -> Record:
        """Step the scheduler until every session's last turn ends (or `max_steps`). A
        violation of HiSparse's ownership invariant, when checked, stops the run naming
        the run and the step."""
        try:
            return self._run(max_steps)
        finally:
            gc.unfreeze()
            hisparse = getattr(self, "hisparse", None)  # none where the configuration is refused
            if hisparse is not None:
                self.record.ownership_checks = hisparse.ownership_checks

    def _run(self, max_steps: int) -> Record:
        record = self.record
        if self.scheduler is None:
            return record
        # As EngineCore does once its scheduler is built: the start-up heap (the block pool's
        # blocks among it) is frozen, so the collector's full passes during the run skip it;
        # `run` unfreezes it when the run ends.
        freeze_gc_heap()
        started = time.perf_counter()
        w = self.workload
        sessions = [
            _Session(
                index=i,
                rng=random.Random(self.seed * 100_003 + i),
                turns=1 if i < w.long_sessions else w.turns,
                first_tokens=w.long_session_tokens if i < w.long_sessions else w.first_turn_tokens,
                long=i < w.long_sessions,
            )
            for i in range(self.concurrency)
        ]
        arrivals: list[tuple[float, _Session]] = [(0.0, s) for s in sessions]
        turns: dict[str, _Turn] = {}
        finished_turns: list[_Turn] = []
        copies_due: list[tuple[float, int]] = []  # (lands at, copy id)
        jobs_due: list[tuple[float, int, str | None]] = []  # (done at, job id, request of a load)
        clock = 0.0
        timeline: list[tuple[float, float, int]] = []  # busy steps: (start, seconds, running)
        accounting = StepAccounting(self.scheduler)
        sched_ms: list[float] = []
        step_ms: list[float] = []  # the simulated time of each step sched_ms measured
        scheduled: list[int] = []  # the requests each of those steps scheduled
        turn_steps: list[bool] = []  # whether it scheduled a new request
        spec_tokens = self.model.shape.num_speculative_tokens
        scheduler = self.scheduler
        ids = 0

        def arrive(session: _Session, at: float) -> str:
            nonlocal ids
            if session.turn == 0:
                session.prompt = self._tokens(session.rng, session.first_tokens)
            request_id = f"s{session.index}-t{session.turn}-{ids}"
            ids += 1
            output = w.output_tokens
            request = make_request(session.prompt, output, request_id, self.block_hasher, arrival_time=at)
            scheduler.add_request(request)
            turns[request_id] = _Turn(
                session.index,
                session.turn,
                request_id,
                at,
                len(session.prompt),
                len(session.prompt) - session.history,
                output,
                session.turns - 1,
            )
            record.new_prompt_tokens += len(session.prompt) - session.history
            return request_id

        requests_of: dict[str, _Session] = {}
        for step in range(max_steps):
            while arrivals and arrivals[0][0] <= clock:
                at, session = arrivals.pop(0)
                requests_of[arrive(session, at)] = session
            if not scheduler.has_requests() and not arrivals:
                break
            released = scheduler.num_holders_released
            t0 = time.perf_counter()
            try:
                output = scheduler.schedule()
            except OwnershipError as error:
                raise self._violation(step, "schedule", error) from None
            t_schedule = time.perf_counter() - t0
            accounting.observe(output)
            work, rows, restores, resolves = self._work(output)
            busy = output.total_num_scheduled_tokens > 0
            seconds = 0.0
            if busy:
                seconds = self.model.compute_seconds(work)
                seconds += self.model.host_rows_seconds(rows)
                if resolves:
                    seconds += self.model.resolver_seconds()
                if output.kv_cache_block_copies:
                    record.blocks_copied_on_device += len(output.kv_cache_block_copies)
                    seconds += self.model.device_copy_seconds(
                        len(output.kv_cache_block_copies) * self.block_bytes
                    )
                restore_bytes = restores * self.page_bytes
                if restore_bytes:
                    seconds += restore_bytes / self.h2d.bytes_per_s
                record.bytes_from_host += self.model.host_rows_bytes(rows) + restore_bytes
                # The link carries the step's critical loads too.
                self.h2d.send(clock, self.model.host_rows_bytes(rows) + restore_bytes)
            # The connector's loads start with the step; its stores and HiSparse's copies
            # follow the forward. All of them queue on the links.
            jobs_due.extend(self._connector_jobs(output, clock, clock + seconds, record))
            plan = getattr(output, "hisparse_plan", None)
            if plan is not None and plan.copies:
                nbytes = self.page_bytes * len(plan.copies)
                done = self.d2h.send(clock + seconds, nbytes)
                record.bytes_to_host += nbytes
                copies_due.extend((done, c.copy_id) for c in plan.copies)
            if not busy:
                # Nothing to compute: the engine idles until a transfer lands or a turn arrives.
                pending = [at for at, _ in copies_due] + [at for at, _, _ in jobs_due]
                pending += [at for at, _ in arrivals]
                if not pending and not scheduler.has_requests():
                    break
                if pending:
                    seconds = max(0.0, min(pending) - clock)
                elif not output.preempted_req_ids and released == scheduler.num_holders_released:
                    record.stalled = (
                        f"step {step}: {len(scheduler.running)} running and "
                        f"{len(scheduler.waiting) + len(getattr(scheduler, 'skipped_waiting', ()))} waiting "
                        "requests, nothing schedulable and nothing in flight"
                    )
                    break
                # Else the step preempted and scheduled nothing (upstream skips the waiting
                # queues in a step that preempts), or released a waiting request's blocks
                # (patch 0007): the next step may schedule, at once.
            step_end = clock + seconds
            running = len(scheduler.running)
            if busy:
                timeline.append((clock, seconds, running))
                record.max_running = max(record.max_running, running)
            clock = step_end
            model_output = self._model_output(output, copies_due, jobs_due, clock)
            copies_due = [(at, c) for at, c in copies_due if at > clock]
            jobs_due = [job for job in jobs_due if job[0] > clock]
            t0 = time.perf_counter()
            try:
                engine_outputs = scheduler.update_from_output(output, model_output)
            except OwnershipError as error:
                raise self._violation(step, "its output", error) from None
            t_update = time.perf_counter() - t0
            if busy:
                sched_ms.append((t_schedule + t_update) * 1e3)
                scheduled.append(len(output.num_scheduled_tokens))
                turn_steps.append(bool(output.scheduled_new_reqs))
                step_ms.append(seconds * 1e3)
                record.steps += 1
            # Tokens produced this step, and the turns that ended.
            for outputs in engine_outputs.values():
                for out in outputs.outputs:
                    turn = turns.get(out.request_id)
                    if turn is None:
                        continue
                    if out.new_token_ids:
                        if turn.first_token is None:
                            turn.first_token = clock
                        turn.last_token = clock
                    if out.finish_reason is not None:
                        self._end_turn(
                            out.request_id, turn, requests_of, arrivals, finished_turns, clock, record
                        )
            if spec_tokens:
                self._propose_drafts(output, spec_tokens)
            if self.hisparse is not None:
                used = self.hisparse.residency.host_pool.num_referenced
                record.host_pages_used_max = max(record.host_pages_used_max, used)
        else:
            record.stalled = f"not finished after {max_steps} steps"
        if self.hisparse is not None:
            stats = self.hisparse.stats()
            record.pages_demoted = stats["pages_demoted"]
            record.requests_failed = stats["requests_failed"]
        record.preemptions = accounting.preemptions
        record.recomputed_prompt_tokens = accounting.recomputed(record.new_prompt_tokens)
        record.simulated_s = clock
        record.requests = len(finished_turns)
        record.output_tokens = sum(t.output_tokens for t in finished_turns)
        record.output_tokens_per_s = record.output_tokens / clock if clock > 0 else 0.0
        record.mean_running_all = _time_mean(timeline, 0.0, clock)
        # Steady state: from the last session's first token to the first session's end.
        firsts = [t.first_token for t in finished_turns if t.turn == 0 and t.first_token is not None]
        lasts = [t.last_token for t in finished_turns if t.turn == t.last_turn and t.last_token is not None]
        start, end = max(firsts, default=0.0), min(lasts, default=clock)
        record.steady_state_s = max(0.0, end - start)
        record.mean_running = _time_mean(timeline, start, end) if end > start else record.mean_running_all
        record.mean_running_per_step = accounting.mean_running()
        tpots = [
            (t.last_token - t.first_token) / (t.output_tokens - 1)
            for t in finished_turns
            if t.output_tokens > 1
            and t.first_token is not None
            and t.last_token is not None
            and t.last_token > t.first_token
        ]
        record.per_user_tokens_per_s = statistics.fmean(1 / x for x in tpots) if tpots else 0.0
        record.tpot_p50_s, record.tpot_p99_s = percentile(tpots, 0.5), percentile(tpots, 0.99)
        ttfts = [t.first_token - t.arrival for t in finished_turns if t.first_token is not None]
        record.ttft_p50_s, record.ttft_p99_s = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
        later = [
            t.first_token - t.arrival for t in finished_turns if t.turn > 0 and t.first_token is not None
        ]
        record.later_turn_ttft_p50_s = percentile(later, 0.5)
        record.scheduler_ms_per_step = statistics.fmean(sched_ms) if sched_ms else 0.0
        record.scheduler_ms_p99 = percentile(sched_ms, 0.99)
        record.scheduler_s_total = sum(sched_ms) / 1e3
        if sum(scheduled):
            record.scheduler_us_per_scheduled_request = sum(sched_ms) * 1e3 / sum(scheduled)
        turn_ms = list(itertools.compress(sched_ms, turn_steps))
        other_ms = [ms for ms, turn in zip(sched_ms, turn_steps, strict=True) if not turn]
        record.scheduler_ms_turn_steps = statistics.fmean(turn_ms) if turn_ms else 0.0
        record.scheduler_ms_other_steps = statistics.fmean(other_ms) if other_ms else 0.0
        if sched_ms and sum(step_ms) > 0:
            record.scheduler_share_of_step = sum(sched_ms) / sum(step_ms)
            record.steps_scheduler_over_step = sum(
                a > b for a, b in zip(sched_ms, step_ms, strict=True)
            ) / len(sched_ms)
        record.wall_s = time.perf_counter() - started
        record.labels = {name: "measured" for name in MEASURED} | {name: "simulated" for name in SIMULATED}
        return record

    def _violation(self, step: int, after: str, error: OwnershipError) -> OwnershipError:
        return OwnershipError(
            f"{self.workload.name} {self.config} x{self.concurrency}, step {step}, after {after}: {error}"
        )

    def _end_turn(self, request_id, turn, requests_of, arrivals, finished_turns, clock, record) -> None:
        finished_turns.append(turn)
        session = requests_of.pop(request_id)
        session.turn += 1
        if session.turn >= session.turns:
            record.sessions_completed += 1
            record.long_sessions_completed += session.long
            return
        answer = array.array("i", [SAMPLED_TOKEN]) * turn.output_tokens
        session.history = len(session.prompt) + len(answer)
        session.prompt = session.prompt + answer + self._tokens(session.rng, self.workload.turn_tokens)
        arrivals.append((clock, session))
        arrivals.sort(key=lambda item: item[0])

    def _work(self, output: SchedulerOutput) -> tuple[list[ScheduledWork], int, int, bool]:
        """Each scheduled request's tokens; the host rows the step loads; pages restored;
        whether any scheduled request has HOST pages (the resolver runs)."""
        scheduler = self.scheduler
        assert scheduler is not None
        residency = self.hisparse.residency.requests if self.hisparse is not None else {}
        topk = self.model.shape.index_topk
        work: list[ScheduledWork] = []
        rows = 0
        resolves = False
        for req_id, n in output.num_scheduled_tokens.items():
            request: Request | None = scheduler.requests.get(req_id)
            if request is None:
                continue
            end = request.num_computed_tokens
            start = end - n
            decode = request.num_output_tokens > 0 and start >= request.num_tokens - 1
            item = ScheduledWork(start, end, decode)
            resident = residency.get(req_id)
            resolves = resolves or (resident is not None and resident.num_host_pages > 0)
            if resident is not None and resident.num_host_pages and end > topk:
                pages = max(len(resident.pages), 1)
                item.host_rows_loaded = self.model.miss_rows(
                    topk, resident.num_host_pages / pages, n, decode, resident.num_host_pages * 64
                )
                rows += item.host_rows_loaded
            work.append(item)
        plan = getattr(output, "hisparse_plan", None)
        restores = len(plan.restores) if plan is not None else 0
        return work, rows, restores, resolves

    def _connector_jobs(
        self, output: SchedulerOutput, start: float, end: float, record: Record
    ) -> list[tuple[float, int, str | None]]:
        """The step's transfer jobs on the links: (when each has crossed, job id, the
        request of a load)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

        meta = output.kv_connector_metadata
        if not isinstance(meta, OffloadingConnectorMetadata):
            return []
        due: list[tuple[float, int, str | None]] = []
        for jobs, is_load in ((meta.load_jobs, True), (meta.store_jobs, False)):
            for job_id, job in jobs.items():
                gpu = job.dst_spec if is_load else job.src_spec
                nbytes = self._job_bytes(gpu)
                if is_load:
                    record.bytes_from_host += nbytes
                    due.append((self.h2d.send(start, nbytes), job_id, job.req_id))
                else:
                    record.bytes_to_host += nbytes
                    due.append((self.d2h.send(end, nbytes), job_id, None))
        return due

    def _job_bytes(self, spec: Any) -> int:
        sizes = getattr(spec, "group_sizes", None) or [len(spec.block_ids)]
        per_block = self.connector_block_bytes or [0]
        return sum(n * per_block[min(g, len(per_block) - 1)] for g, n in enumerate(sizes))

    def _model_output(self, output: SchedulerOutput, copies_due, jobs_due, clock: float):
        """What the workers return for the step: sampled tokens (1 + accepted drafts for a
        request that decodes), the copies landed by now, the transfer jobs done."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        scheduler = self.scheduler
        assert scheduler is not None
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        spec = output.scheduled_spec_decode_tokens
        for req_id in req_ids:
            request = scheduler.requests.get(req_id)
            if request is None or request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            drafts = len(spec.get(req_id, ()))
            accepted = self.model.accepted_tokens(drafts, self.rng.random())
            sampled.append([SAMPLED_TOKEN] * (1 + accepted))
        connector_output = None
        if self.vllm_config.kv_transfer_config is not None:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
                OffloadingWorkerMetadata,
            )

            done = [job for job in jobs_due if job[0] <= clock]
            loading = {req for at, _, req in jobs_due if at > clock and req is not None}
            finished = {req for _, _, req in done if req is not None} - loading
            connector_output = KVConnectorOutput(
                finished_recving=finished,
                kv_connector_worker_meta=OffloadingWorkerMetadata(
                    completed_jobs={job_id: self.world_size for _, job_id, _ in done}
                ),
            )
        copied = [c for at, c in copies_due if at <= clock] if self.hisparse is not None else None
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
            hisparse_copied=copied,
        )

    def _propose_drafts(self, output: SchedulerOutput, spec_tokens: int) -> None:
        """The drafter's proposals for every request that just decoded or finished its prefill."""
        from vllm.v1.outputs import DraftTokenIds

        scheduler = self.scheduler
        assert scheduler is not None
        req_ids = [r for r in output.num_scheduled_tokens if r in scheduler.requests]
        if req_ids:
            drafts = [[SAMPLED_TOKEN] * spec_tokens for _ in req_ids]
            scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))


# ----------------------------------------------------------------------------- planning


def plan_configurations(
    request: planner.PlanRequest,
) -> tuple[dict[str, planner.ConfigurationPlan], planner.Plan]:
    """The planner's configuration for each of CONFIGS (always: hybrid planned in mode "always")."""
    base = planner.plan(request)
    always_request = dataclasses.replace(
        request, hisparse_config={**request.hisparse_config, "mode": "always"}
    )
    always = planner.plan(always_request)
    configurations = {
        name: (always if name == "always" else base).configuration(PLANNED_AS[name]) for name in CONFIGS
    }
    return configurations, base


# The configurations each worker process simulates, inherited from the parent (fork).
_PLANNED: dict[int, tuple[dict[str, planner.ConfigurationPlan], planner.Plan]] = {}


def _simulate_one(
    max_model_len: int,
    workload: Workload,
    config: str,
    concurrency: int,
    constants: dict[str, float],
    seed: int,
    check_ownership: bool = False,
) -> Record:
    configurations, plan = _PLANNED[max_model_len]
    weight_bytes = plan.weights.bytes_per_gpu if plan.weights is not None else None
    sim = Simulation(
        config, configurations[config], workload, concurrency, constants, weight_bytes, seed, check_ownership
    )
    return sim.run()


def simulate(
    request: planner.PlanRequest,
    runs: Sequence[tuple[Workload, Sequence[int]]],
    configs: Sequence[str] = CONFIGS,
    constants: dict[str, float] | None = None,
    seed: int = 0,
    progress: Any = None,
    jobs: int = 1,
    check_ownership: bool = False,
    layout: str | None = None,
) -> dict[str, Any]:
    """Every (workload, configuration, concurrency) record, and what they were run on: each
    workload at its own concurrencies. `jobs` > 1 runs simulations side by side in that
    many processes (each a scheduler of its own; the records are the same).
    `check_ownership`: check HiSparse's ownership invariant after every schedule() and
    every output; a violation raises `OwnershipError`. `layout`: HiSparse's KV cache
    layout (`hisparse_config.kv_layout`: `groups` or `page`), in place of the request's."""
    layout = layout or request.hisparse_config.get("kv_layout", "groups")
    with kv_layout(layout):  # refuses an unknown layout, naming the choices
        request = dataclasses.replace(
            request, hisparse_config={**request.hisparse_config, "kv_layout": layout}
        )
        result = _simulate(request, runs, configs, constants, seed, progress, jobs, check_ownership)
    return {**result, "kv_layout": layout}


def _simulate(
    request: planner.PlanRequest,
    runs: Sequence[tuple[Workload, Sequence[int]]],
    configs: Sequence[str],
    constants: dict[str, float] | None,
    seed: int,
    progress: Any,
    jobs: int,
    check_ownership: bool,
) -> dict[str, Any]:
    constants = constants or load_constants(None)
    plans = _PLANNED
    plans.clear()
    tasks = []
    for workload, concurrencies in runs:
        max_model_len = workload.max_model_len(request.max_model_len or request.session_tokens)
        if workload.session_tokens() > max_model_len:
            raise planner.PlannerError(
                f"a session of the {workload.name} workload reaches {workload.session_tokens():,} tokens "
                f"by the end of its last turn ({workload.turns} turns), more than max_model_len "
                f"{max_model_len:,}: vLLM would cut its last turns short. Give fewer --turns, or a "
                "larger --max-model-len (or --session-tokens)"
            )
        if max_model_len not in plans:
            plans[max_model_len] = plan_configurations(
                dataclasses.replace(request, max_model_len=max_model_len)
            )
        tasks += [
            (max_model_len, workload, config, c, constants, seed, check_ownership)
            for c in concurrencies
            for config in configs
        ]
    done: dict[int, Record] = {}
    if jobs <= 1 or len(tasks) == 1:
        for i, task in enumerate(tasks):
            done[i] = _simulate_one(*task)
            if progress is not None:
                progress(done[i])
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # The longest runs first (the most sessions, HiSparse's), so the workers finish together.
        order = sorted(
            range(len(tasks)), key=lambda i: (-tasks[i][3], tasks[i][2] in ("preemption", "offload"))
        )
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_simulate_one, *tasks[i]): i for i in order}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
                if progress is not None:
                    progress(done[futures[future]])
    records = [done[i] for i in range(len(tasks))]
    any_plan = next(iter(plans.values()))[1]
    return {
        "model": any_plan.model,
        "tensor_parallel_size": any_plan.tensor_parallel_size,
        "kv_cache_bytes_per_gpu": any_plan.kv_cache_bytes_per_gpu,
        "workloads": [dataclasses.asdict(w) | {"concurrency": list(c)} for w, c in runs],
        "constants": {
            name: {"value": constants[name], "unit": c.unit, "source": c.source}
            for name, c in CONSTANTS.items()
        },
        "labels": {
            "measured": "from the real scheduler, HiSparse and the connector, or this machine's clock",
            "simulated": "from the step-time model's clock",
        },
        "records": [dataclasses.asdict(r) for r in records],
    }


# ----------------------------------------------------------------------------- output

TABLE_FIELDS = (
    ("config", "config", "{}"),
    ("concurrency", "sessions", "{}"),
    ("mean_running", "mean running (sim)", "{:.1f}"),
    ("max_running", "max running", "{}"),
    ("preemptions", "preemptions", "{}"),
    ("recomputed_prompt_tokens", "recomputed tokens", "{:,}"),
    ("output_tokens_per_s", "output tok/s (sim)", "{:,.0f}"),
    ("per_user_tokens_per_s", "per-user tok/s (sim)", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50 s (sim)", "{:.2f}"),
    ("tpot_p50_s", "TPOT p50 ms (sim)", "{:.1f}"),
    ("bytes_to_host", "GB to host (sim)", "{:.1f}"),
    ("bytes_from_host", "GB from host (sim)", "{:.1f}"),
    ("scheduler_ms_per_step", "scheduler ms/step", "{:.2f}"),
    ("scheduler_us_per_scheduled_request", "scheduler µs/scheduled request", "{:.0f}"),
    ("steps_scheduler_over_step", "steps scheduler > GPU (sim)", "{:.1%}"),
)


def _cell(record: dict[str, Any], name: str, fmt: str) -> str:
    if not record["started"] and name not in ("config", "concurrency"):
        return "does not start" if name == "mean_running" else "-"
    value = record[name]
    if name == "tpot_p50_s":
        value *= 1e3
    if name.startswith("bytes_"):
        value /= 1e9
    return fmt.format(value)


def render_markdown(result: dict[str, Any]) -> str:
    lines: list[str] = []
    if result.get("kv_layout") == "page":
        lines += [
            'KV cache layout: page (one block per page: docs/architecture.md, "The page layout")',
            "",
        ]
    for workload in result["workloads"]:
        records = [r for r in result["records"] if r["workload"] == workload["name"]]
        lines.append(f"{workload['name']}:")
        lines.append("")
        lines.append("| " + " | ".join(title for _, title, _ in TABLE_FIELDS) + " |")
        lines.append("|" + " --- |" * len(TABLE_FIELDS))
        for record in records:
            lines.append("| " + " | ".join(_cell(record, n, f) for n, _, f in TABLE_FIELDS) + " |")
        lines.append("")
        for record in records:
            if record["refusal"]:
                lines.append(f"- {record['config']} does not start: {record['refusal']}")
            if record["stalled"]:
                lines.append(f"- {record['config']} x{record['concurrency']} stalled: {record['stalled']}")
    return "\n".join(lines) + "\n"


def render_text(result: dict[str, Any]) -> str:
    head = (
        f"model {result['model']}, TP={result['tensor_parallel_size']}, KV cache "
        f"{result['kv_cache_bytes_per_gpu'] / GiB:.1f} GiB per GPU; (sim): the step-time model's clock, "
        "the rest measured from the real scheduler\n\n"
    )
    return head + render_markdown(result)


def plot(result: dict[str, Any], path: Path) -> None:
    """Per-user tokens/s against output tokens/s, one curve per configuration and workload."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6.4, 4.8))
    for workload in result["workloads"]:
        for config in CONFIGS:
            points = sorted(
                (r["concurrency"], r["per_user_tokens_per_s"], r["output_tokens_per_s"])
                for r in result["records"]
                if r["workload"] == workload["name"] and r["config"] == config and r["started"]
            )
            if not points:
                continue
            label = config if len(result["workloads"]) == 1 else f"{config} ({workload['name']})"
            axes.plot([p[1] for p in points], [p[2] for p in points], marker="o", label=label)
            for concurrency, x, y in points:
                axes.annotate(str(concurrency), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xlabel("per-user tokens/s (simulated)")
    axes.set_ylabel("output tokens/s (simulated)")
    model = str(result["model"]).split(" ")[0]
    axes.set_title(f"{model}: interactivity vs throughput, simulated (labels: sessions)", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


# ----------------------------------------------------------------------------- CLI


def argument_parser() -> argparse.ArgumentParser:
    parser = planner.argument_parser()
    parser.prog = "python -m vllm.v1.hisparse.capacity simulate"
    parser.description = (
        "vLLM's real scheduler at the planned block counts on the announcement's agentic workload "
        "(13-turn OpenHands sessions, MTP3, FP8 KV, 142K admission), in four configurations with the "
        "same host memory, with a step-time model of the GPUs in place of the workers. Takes vllm "
        "serve's flags, as `plan` does."
    )
    parser.epilog = (
        "Example: --model glm-5.3 -tp 8 --concurrency 32 --quick --format json (the announcement's two "
        "flags, MTP3, FP8 KV and 141 GiB GPUs are the defaults)"
    )
    parser.set_defaults(
        gpu_memory_gib=H200_GIB,
        kv_cache_dtype="fp8",
        attention_config=ANNOUNCEMENT_ATTENTION_CONFIG,
        kv_transfer_config=ANNOUNCEMENT_KV_TRANSFER_CONFIG,
        speculative_config=ANNOUNCEMENT_SPECULATIVE_CONFIG,
    )
    group = parser.add_argument_group("simulation")
    group.add_argument(
        "--concurrency",
        default=",".join(map(str, DEFAULT_CONCURRENCY)),
        help="comma-separated concurrent sessions (default 8,16,32,64)",
    )
    group.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    group.add_argument(
        "--workload",
        choices=("openhands", "mix", "both"),
        default="both",
        help="openhands: the announcement's sessions; mix: the same with --long-sessions "
        "sessions of --long-session-tokens (max_model_len 1M); both (default)",
    )
    group.add_argument(
        "--mix-concurrency",
        default=None,
        help="comma-separated concurrent sessions of the mix (default: 32, or --concurrency's "
        "values with --workload mix)",
    )
    group.add_argument(
        "--turns",
        type=planner._bounded(int, 0),
        default=None,
        help="turns per session (default 13; --quick 3)",
    )
    group.add_argument(
        "--long-sessions",
        type=planner._bounded(int, 0, low_open=False),
        default=1,
        help="1M-token sessions in the mix (default 1)",
    )
    group.add_argument(
        "--long-session-tokens",
        type=planner._POSITIVE_INT,
        default=1_000_000,
        help="prompt tokens of a long session (default 1,000,000)",
    )
    group.add_argument(
        "--quick", action="store_true", help=f"{QUICK_TURNS}-turn sessions, the openhands workload only"
    )
    group.add_argument(
        "--constants",
        type=Path,
        help="JSON {name: value} overriding the step model's constants (e.g. measured "
        "bandwidths); `--list-constants` prints them",
    )
    group.add_argument("--list-constants", action="store_true", help="print the step model's constants")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--jobs",
        type=planner._bounded(int, 0),
        default=min(2, os.cpu_count() or 1),
        help="simulations run side by side, one process each (default: 2, or 1 on one core); "
        "1 gives the scheduler's CPU time without a neighbour",
    )
    group.add_argument("--png", type=Path, help="write the interactivity-throughput Pareto plot here")
    group.add_argument(
        "--kv-layout",
        choices=KV_LAYOUTS,
        help="HiSparse's KV cache layout, in place of the serve flags' hisparse_config.kv_layout "
        "(default: theirs, or groups): its sparse-MLA groups (groups), or the page layout (page: "
        'one block per page; docs/architecture.md, "The page layout")',
    )
    group.add_argument(
        "--check-ownership",
        action="store_true",
        help="check HiSparse's ownership invariant (every device block, host page and copy has "
        "exactly its owners) after every schedule and every output, at the simulated scale; a "
        "violation stops with exit status 1 and names the run and the step. Slow: the "
        "scheduler's time per step then includes the checks",
    )
    return parser


def _concurrencies(flag: str, text: str) -> list[int]:
    try:
        values = sorted({int(c) for c in text.split(",") if c.strip()})
    except ValueError:
        raise planner.PlannerError(f"{flag} {text!r}: give integers, e.g. 8,16,32,64") from None
    if not values or values[0] < 1:
        raise planner.PlannerError(f"{flag} {text!r}: give positive integers, e.g. 8,16,32,64")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if args.list_constants:
        for name, c in CONSTANTS.items():
            print(f"{name:<22} {c.value:<12g} {c.unit:<12} {c.source}")
        return 0
    try:
        if args.session_tokens == planner.DEFAULT_SESSION_TOKENS and args.max_model_len is None:
            args.max_model_len = planner.DEFAULT_SESSION_TOKENS
        request = planner.request_from_args(args, parser.parse_args([]))
        concurrencies = _concurrencies("--concurrency", args.concurrency)
        if args.mix_concurrency is not None:
            mix_concurrencies = _concurrencies("--mix-concurrency", args.mix_concurrency)
        else:
            mix_concurrencies = concurrencies if args.workload == "mix" else [DEFAULT_MIX_CONCURRENCY]
        configs = [c for c in args.configs.split(",") if c]
        unknown = [c for c in configs if c not in CONFIGS]
        if unknown or not configs:
            raise planner.PlannerError(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
        turns = args.turns or (QUICK_TURNS if args.quick else OPENHANDS.turns)
        if turns < 1 or args.long_sessions < 0 or args.jobs < 1:
            raise planner.PlannerError("--turns and --jobs must be >= 1 and --long-sessions >= 0")
        openhands = dataclasses.replace(OPENHANDS, turns=turns)
        mix = dataclasses.replace(
            openhands,
            name="mix",
            long_sessions=args.long_sessions,
            long_session_tokens=args.long_session_tokens,
        )
        runs = {
            "openhands": [(openhands, concurrencies)],
            "mix": [(mix, mix_concurrencies)],
            "both": [(openhands, concurrencies), (mix, mix_concurrencies)],
        }["openhands" if args.quick else args.workload]
        constants = load_constants(args.constants)
    except (ValueError, planner.PlannerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    def progress(record: Record) -> None:
        state = (
            "does not start"
            if not record.started
            else (
                f"running {record.mean_running:.1f}, {record.output_tokens_per_s:,.0f} tok/s, "
                f"{record.scheduler_ms_per_step:.2f} ms/step, {record.wall_s:.0f} s"
            )
        )
        print(
            f"  {record.workload} {record.config} x{record.concurrency}: {state}", file=sys.stderr, flush=True
        )

    try:
        result = simulate(
            request,
            runs,
            configs,
            constants,
            args.seed,
            progress,
            args.jobs,
            args.check_ownership,
            args.kv_layout,
        )
    except planner.PlannerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OwnershipError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    render = {
        "text": render_text,
        "markdown": render_markdown,
        "json": lambda r: json.dumps(r, indent=2) + "\n",
    }
    text = render[args.format](result)
    if args.output is not None:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    if args.png is not None:
        plot(result, args.png)
    stalled = [r for r in result["records"] if r["stalled"]]
    for r in stalled:
        print(
            f"error: {r['config']} x{r['concurrency']} ({r['workload']}) stalled: {r['stalled']}",
            file=sys.stderr,
        )
    return 1 if stalled else 0


if __name__ == "__main__":
    sys.exit(main())
