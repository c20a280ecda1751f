# SPDX-License-Identifier: Apache-2.0
"""The worker's step reports: copies and counters come back once the step's work is done."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vllm.v1.hisparse.plan import DEVICE_COUNTERS, HOST_COUNTERS
from vllm.v1.hisparse.resolution import StepRequestErrors
from vllm.v1.hisparse.resolver import (
    ERROR_NOT_IN_HOST_POOL,
    ERROR_REQUEST_OUT_OF_BOUNDS,
    ERROR_STAGING_OVERFLOW,
    ResolverError,
)
from vllm.v1.hisparse.worker import StepReports, _StepReport, failed_requests


class FakeEvent:
    """A CUDA event's `query()`: whether the work recorded before it has finished."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def report(copies, rows_loaded, max_calls, event=None) -> _StepReport:
    device = torch.zeros(len(DEVICE_COUNTERS) + 1, dtype=torch.int64)
    device[DEVICE_COUNTERS.index("rows_loaded")] = rows_loaded
    host = dict.fromkeys(HOST_COUNTERS, 0)
    host["max_resolver_calls_per_layer_step"] = max_calls
    return _StepReport(copies, device, host, event)


def test_on_cpu_a_step_reports_its_copies_and_counters_at_once():
    reports = StepReports(torch.device("cpu"))
    counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64)
    counts[0] = 7
    reports.submit([10], counts, torch.zeros((), dtype=torch.int64), dict.fromkeys(HOST_COUNTERS, 0))
    copies, counters, error, failed = reports.collect()
    assert copies == [10] and counters["rows_loaded"] == 7 and counters["device_reads"] == 1
    assert error == 0 and failed == {}
    assert reports.collect()[0] == [], "reported once"


def test_the_reports_say_up_to_which_scheduler_step_everything_is_reported():
    """A failure can be reported steps late; the scheduler keeps what ended requests wrote
    until every step they ran in is reported."""
    reports = StepReports(torch.device("cpu"), min_age=1)
    counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64)
    hosts = dict.fromkeys(HOST_COUNTERS, 0)
    reports.submit([], counts, torch.zeros((), dtype=torch.int64), hosts, step=1, plan_step=7)
    reports.collect(1)
    assert reports.reported_plan_step is None, "not reported yet"
    reports.submit([], counts, torch.zeros((), dtype=torch.int64), hosts, step=2, plan_step=8)
    reports.collect(2)
    assert reports.reported_plan_step == 7


def test_a_requests_own_error_bits_come_back_by_request_over_the_steps_collected():
    reports = StepReports(torch.device("cpu"))
    counts = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64)
    hosts = dict.fromkeys(HOST_COUNTERS, 0)
    step_error = torch.tensor(ERROR_STAGING_OVERFLOW | ERROR_NOT_IN_HOST_POOL)
    words = torch.tensor([0, ERROR_STAGING_OVERFLOW, 0])
    reports.submit([], counts, step_error, hosts, StepRequestErrors(["a", "b", "c"], words))
    words = torch.tensor([ERROR_NOT_IN_HOST_POOL, ERROR_NOT_IN_HOST_POOL])
    reports.submit([], counts, step_error, hosts, StepRequestErrors(["c", "b"], words))
    _, _, error, failed = reports.collect()
    assert error == ERROR_STAGING_OVERFLOW | ERROR_NOT_IN_HOST_POOL
    assert failed == {"b": ERROR_STAGING_OVERFLOW | ERROR_NOT_IN_HOST_POOL, "c": ERROR_NOT_IN_HOST_POOL}


def test_a_step_still_running_on_the_device_holds_back_its_report_and_the_later_ones():
    reports = StepReports(torch.device("cpu"))
    first, second = FakeEvent(), FakeEvent()
    reports._pending.extend([report([10], 3, 1, first), report([11], 4, 1, second)])
    second.done = True
    copies, counters, _, _ = reports.collect()
    assert copies == [] and counters["device_reads"] == 0, "step 1 is not done, so neither is reported"
    first.done = True
    copies, counters, _, _ = reports.collect()
    assert copies == [10, 11]
    assert counters["rows_loaded"] == 7, "counts add up over the steps collected"
    assert counters["max_resolver_calls_per_layer_step"] == 1, "maxima stay maxima"
    assert counters["device_reads"] == 2


def test_a_bit_a_request_raised_fails_it_and_a_bit_nobody_claims_stops_the_engine():
    assert failed_requests(0, {}) is None
    reasons = failed_requests(ERROR_STAGING_OVERFLOW, {"b": ERROR_STAGING_OVERFLOW})
    assert list(reasons) == ["b"] and "hot buffer and staging" in reasons["b"]
    with pytest.raises(ResolverError, match="request row is outside the step's hot state"):
        failed_requests(ERROR_STAGING_OVERFLOW | ERROR_REQUEST_OUT_OF_BOUNDS, {"b": ERROR_STAGING_OVERFLOW})
    with pytest.raises(ResolverError, match="more distinct host rows"):
        failed_requests(ERROR_STAGING_OVERFLOW, {})


def test_a_step_without_a_plan_still_collects_the_reports_that_are_done():
    # A report still running on the device when its step ended comes back with the next
    # step's output, whether or not that step carries a plan.
    from types import SimpleNamespace

    from vllm.v1.hisparse.worker import HiSparseWorker

    layer = "model.layers.0.self_attn.attn"
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], req_id_to_index={}), requests={})
    worker = HiSparseWorker(
        runner, {layer: torch.zeros(4, 64, 8)}, group_of_layer={layer: 0}, hot_rows=64, num_host_pages=2
    )
    event = FakeEvent()
    worker.reports._pending.append(report([41, 42], rows_loaded=5, max_calls=1, event=event))
    step = SimpleNamespace(
        hisparse_plan=None, finished_req_ids=set(), preempted_req_ids=None, num_scheduled_tokens={}
    )
    worker.begin_step(step)
    held = worker.finish_step(SimpleNamespace())
    assert held.hisparse_copied == [], "still running: nothing reported yet"
    event.done = True
    worker.begin_step(step)
    out = worker.finish_step(SimpleNamespace())
    assert out.hisparse_copied == [41, 42] and out.hisparse_counters["rows_loaded"] == 5
    worker.begin_step(step)
    assert not hasattr(worker.finish_step(SimpleNamespace()), "hisparse_copied"), "nothing left to say"


class RecordingStream:
    def __init__(self, log: list[tuple], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: RecordingStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait for", self.name, event))


class RecordingCuda:
    """A stand-in for torch.cuda's streams and events (the real ones need a GPU) that
    records, in order, what the worker asks of them."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = RecordingStream(self.log, "compute")
        self.events: list[FakeEvent] = []

    def Stream(self, device=None) -> RecordingStream:
        return RecordingStream(self.log, "copy")

    def current_stream(self, device=None) -> RecordingStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: RecordingStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def Event(self) -> FakeEvent:
        event = FakeEvent()
        event.record = lambda stream: self.log.append(("record", stream.name))
        self.events.append(event)
        return event


def step_runner(worker):
    """A function that runs one worker step whose plan makes `copies` (no request scheduled)."""
    from types import SimpleNamespace

    step = SimpleNamespace(
        hisparse_plan=None, finished_req_ids=set(), preempted_req_ids=None, num_scheduled_tokens={}
    )

    def run_step(copies):
        worker.begin_step(step)
        worker._plan = SimpleNamespace(copies=copies, mla_group_ids=(0,), step=0)
        return worker.finish_step(SimpleNamespace())

    return run_step


def test_on_cuda_page_copies_run_on_the_copy_stream_after_the_forward_and_report_after_its_event():
    """The writing rank's post-forward copies go to a side stream that first waits for the
    compute stream (the forward wrote the pages), and are reported durable only once the
    event recorded after them on that stream has passed; their own error word comes back
    with them."""
    from types import SimpleNamespace

    from vllm.v1.hisparse.page_copy import ERROR_PAGE_OUT_OF_BOUNDS, PageCopyStream
    from vllm.v1.hisparse.plan import PageCopy
    from vllm.v1.hisparse.worker import HiSparseWorker

    layer = "model.layers.0.self_attn.attn"
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], req_id_to_index={}), requests={})
    cache = torch.arange(4 * 64 * 8, dtype=torch.float32).reshape(4, 64, 8)
    worker = HiSparseWorker(runner, {layer: cache}, group_of_layer={layer: 0}, hot_rows=64, num_host_pages=2)
    cuda = RecordingCuda()
    worker.copy_stream = PageCopyStream(torch.device("cpu"), cuda=cuda)
    launched = worker._copy_pages

    def copy_pages(plan, pages, to_host, error):
        cuda.log.append(("copy", cuda.current.name, to_host, error is worker.resolution.error))
        launched(plan, pages, to_host, error)

    worker._copy_pages = copy_pages
    run_step = step_runner(worker)

    out = run_step([PageCopy(7, "r", 0, (2,), 1)])
    assert cuda.log == [("wait", "copy", "compute"), ("copy", "copy", True, False), ("record", "copy")]
    assert torch.equal(worker.host_pool[0, 1], cache[2]), "the copy ran (in place here)"
    assert out.hisparse_copied == [], "its event has not passed: not durable yet"
    out = run_step([])
    assert out.hisparse_copied == [] and len(cuda.log) == 3, "a step without copies launches nothing"
    cuda.events[0].done = True
    out = run_step([])
    assert out.hisparse_copied == [7] and out.hisparse_failed is None
    # An out-of-bounds page raises its bit in the copies' own word, which stops the engine
    # once their event has passed.
    run_step([PageCopy(8, "r", 1, (3,), 0)])
    worker.reports._pending[-1].copies_out.error[0] = ERROR_PAGE_OUT_OF_BOUNDS
    cuda.events[-1].done = True
    with pytest.raises(ResolverError, match="page copy"):
        run_step([])


def writer_of_several_pools(num_pools: int):
    """A writing rank's worker over one 4-block layer, with `num_pools` host pools in its
    group, its copy stream on recording stand-in streams: (worker, the stand-in, the cache)."""
    from types import SimpleNamespace

    from vllm.v1.hisparse.host_memory import PoolShare
    from vllm.v1.hisparse.page_copy import PageCopyStream
    from vllm.v1.hisparse.pool_placement import PoolPlacement
    from vllm.v1.hisparse.worker import HiSparseWorker

    layer = "model.layers.0.self_attn.attn"
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=[], req_id_to_index={}), requests={})
    cache = torch.arange(4 * 64 * 8, dtype=torch.float32).reshape(4, 64, 8)
    placement = PoolPlacement(PoolShare.alone(), writer=True, num_pools=num_pools, node_ranks=(0,))
    worker = HiSparseWorker(
        runner, {layer: cache}, group_of_layer={layer: 0}, hot_rows=64, num_host_pages=2, placement=placement
    )
    cuda = RecordingCuda()
    worker.copy_stream = PageCopyStream(torch.device("cpu"), cuda=cuda)
    return worker, cuda, cache


@pytest.mark.parametrize("num_pools", [1, 2])
def test_with_a_pool_on_each_of_several_nodes_a_copy_is_fenced_before_the_scheduler_hears_of_it(num_pools):
    """With several nodes, each node's writer copies every page into its own pool, and the
    scheduler hears only of the output rank's copy: another node's copy, on its writer's
    copy stream, could still read the page's blocks when they were freed and written for
    their next owner, and still write its host page when its node's ranks read it. Its
    report now waits two steps, and the writer's step two after the copy waits for it on
    the compute stream (the scheduler uses the page from the step after that). With one
    pool nothing waits: the report comes once the copy's event has passed."""

    from vllm.v1.hisparse.plan import PageCopy

    worker, cuda, _ = writer_of_several_pools(num_pools)
    run_step = step_runner(worker)

    out = run_step([PageCopy(7, "r", 0, (2,), 1)])
    (event,) = cuda.events
    event.done = True  # the output rank's own copy is done at once
    fences = [entry for entry in cuda.log if entry[0] == "wait for"]
    assert out.hisparse_copied == [] and not fences
    out = run_step([])
    assert out.hisparse_copied == ([7] if num_pools == 1 else [])
    assert not [e for e in cuda.log if e[0] == "wait for"], "the next forward runs beside the copy"
    out = run_step([])
    fences = [entry for entry in cuda.log if entry[0] == "wait for"]
    if num_pools == 1:
        assert not fences and out.hisparse_copied == []
    else:
        assert fences == [("wait for", "compute", event)], "the step after next waits for the copy"
        assert cuda.log.index(fences[0]) > cuda.log.index(("record", "copy"))
        assert out.hisparse_copied == [7], "reported two steps after its launch"


@pytest.mark.parametrize("num_pools", [1, 2])
def test_with_a_pool_on_each_of_several_nodes_restores_wait_for_every_rank_past_the_fence(num_pools):
    """A node's other ranks learn that its writer's copy is done only through a collective
    the writer runs after waiting for it. An idle engine's steps have no forward and no
    collective, and a step's restores run before its forward: a page copied in step n and
    restored in step n + 3 after two steps without tokens was read by the other ranks with
    nothing between them and the writer's copy. A step with restores now meets every rank
    in a collective of its own, after the fence. With one pool there is nothing to wait
    for."""
    from types import SimpleNamespace

    from vllm.v1.hisparse.plan import HISPARSE_PLAN_VERSION, HiSparseStepPlan, PageCopy, PageRestore

    worker, cuda, cache = writer_of_several_pools(num_pools)
    worker.node_barrier = lambda: cuda.log.append(("barrier",))
    launched = worker._copy_pages

    def copy_pages(plan, pages, to_host, error):
        cuda.log.append(("copy", cuda.current.name, to_host))
        launched(plan, pages, to_host, error)

    worker._copy_pages = copy_pages
    run_step = step_runner(worker)
    run_step([PageCopy(7, "r", 0, (2,), 1)])
    cuda.events[0].done = True
    run_step([])
    run_step([])
    restore = PageRestore("s", 0, (3,), 1)
    plan = HiSparseStepPlan(HISPARSE_PLAN_VERSION, 3, (0,), (), (), (restore,), (), (), ())
    step = SimpleNamespace(hisparse_plan=plan, finished_req_ids=set(), preempted_req_ids=None)
    worker.begin_step(SimpleNamespace(**vars(step), num_scheduled_tokens={}))
    assert torch.equal(cache[3], cache[2]), "the restore ran"
    restored = cuda.log.index(("copy", "compute", False))
    if num_pools == 1:
        assert ("barrier",) not in cuda.log
    else:
        fenced = cuda.log.index(("wait for", "compute", cuda.events[0]))
        assert fenced < cuda.log.index(("barrier",)) < restored
