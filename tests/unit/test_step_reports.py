"""The worker's step reports: copies and counters come back once the step's work is done."""

from __future__ import annotations

import torch

from vllm.v1.hisparse.plan import DEVICE_COUNTERS, HOST_COUNTERS
from vllm.v1.hisparse.worker import StepReports, _StepReport


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
    copies, counters, error = reports.collect()
    assert copies == [10] and counters["rows_loaded"] == 7 and counters["device_reads"] == 1
    assert error == 0
    assert reports.collect()[0] == [], "reported once"


def test_a_step_still_running_on_the_device_holds_back_its_report_and_the_later_ones():
    reports = StepReports(torch.device("cpu"))
    first, second = FakeEvent(), FakeEvent()
    reports._pending.extend([report([10], 3, 1, first), report([11], 4, 1, second)])
    second.done = True
    copies, counters, _ = reports.collect()
    assert copies == [] and counters["device_reads"] == 0, "step 1 is not done, so neither is reported"
    first.done = True
    copies, counters, _ = reports.collect()
    assert copies == [10, 11]
    assert counters["rows_loaded"] == 7, "counts add up over the steps collected"
    assert counters["max_resolver_calls_per_layer_step"] == 1, "maxima stay maxima"
    assert counters["device_reads"] == 2
