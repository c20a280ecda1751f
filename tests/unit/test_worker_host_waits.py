# SPDX-License-Identifier: Apache-2.0
"""The worker glue does not make the host wait for the device between a step's start and
its forward: its per-step transfers are non-blocking copies from host buffers (pinned on
CUDA), and it reads no device value.

The device is the seam: torch's meta device stands in for it. A meta tensor holds no
values, so reading one raises, and a dispatch recorder sees every operation the glue runs
on it and flags what would make a CUDA host wait: a read of a device value (a scalar, or
an operation whose output size depends on device values), a host-to-device copy that is
not non-blocking, and a device-to-host copy. It runs what every step runs before its
layers attend: a plan's deltas (HOST pages, a page resident again, hot leases, staging),
the step's start, and the step state every layer reads (its requests, the planned tokens'
ranges, each token's request, the hot and staging rows). Values created straight on the
device (`torch.tensor(..., device=...)`, a blocking copy on CUDA) do not pass through
dispatch, so a source check refuses them in the glue's modules.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vllm.v1.hisparse.plan import NOT_ON_HOST, HostPageRun, HotLeaseUpdate, StepStaging
from vllm.v1.hisparse.resolution import HiSparseResolution

DEVICE = torch.device("meta")
BLOCK = 64
HOT_ROWS = 128
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
GLUE = ("resolution.py", "worker.py", "page_copy.py", "sparse_mla.py")
# Operations whose output size depends on their input's values: the host reads them.
VALUE_SIZED = {
    "_local_scalar_dense",
    "nonzero",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
}


class HostWaits(TorchDispatchMode):
    """Records each operation that would make a CUDA host wait for the stand-in device."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if name in VALUE_SIZED and "meta" in devices:
            self.waits.append(f"{name} reads a device value")
        elif name == "copy_" and args[0].device.type != args[1].device.type:
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if args[0].device.type == "cpu":
                self.waits.append("copy_ device -> host")
            elif blocking:
                self.waits.append("copy_ host -> device, blocking")
        elif name == "_to_copy" and kwargs.get("device") is not None:
            source, target = args[0].device.type, torch.device(kwargs["device"]).type
            if source == "meta" and target == "cpu":
                self.waits.append("_to_copy device -> host")
            elif source == "cpu" and target == "meta" and not kwargs.get("non_blocking", False):
                self.waits.append("_to_copy host -> device, blocking")
        return func(*args, **kwargs)


def _step_on_the_stand_in() -> list[str]:
    order = ["decode-0", "long", "decode-1", "resident"]
    batch = SimpleNamespace(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)})
    runner = SimpleNamespace(input_batch=batch)
    host_pool = torch.zeros(len(LAYERS), 16, BLOCK, 8)
    resolution = HiSparseResolution(
        runner,
        dict.fromkeys(LAYERS, 0),
        {name: 0 for name in LAYERS},
        BLOCK,
        HOT_ROWS,
        host_pool,
        DEVICE,
        max_pages=32,
    )
    scheduled = {"decode-0": 1, "long": 300, "decode-1": 1, "resident": 5}
    with HostWaits() as recorder:
        resolution.update(
            [
                HostPageRun("long", 0, (3, 4)),
                HostPageRun("decode-0", 0, (5,)),
                HostPageRun("decode-1", 0, (6,)),
                HostPageRun("long", 1, (NOT_ON_HOST,)),
            ],
            [
                HotLeaseUpdate(rid, ((2 * i + 1, 2 * i + 2),))
                for i, rid in enumerate(("long", "decode-0", "decode-1"))
            ],
            [StepStaging("long", 2 * BLOCK, ((20, 21),))],
        )
        resolution.start_step(scheduled)
        assert resolution.resolves(LAYERS[0])
        step = resolution._step()
        tokens = step.planned_tokens(sum(scheduled.values()))
        assert tokens is not None and tokens[0].shape == (302,), "the planned tokens' ranges, from the host"
        counts = torch.tensor([scheduled[r] for r in order])
        batch_rows = torch.repeat_interleave(torch.arange(len(order)), counts)
        step.token_requests(batch_rows.to(DEVICE, non_blocking=True))
        slot_rows = step.slot_rows(0, BLOCK, resolution._lease_blocks[0], BLOCK, HOT_ROWS)
        assert slot_rows.shape == (3, HOT_ROWS + 2 * BLOCK)
        resolution.end_step()
        resolution.forget("decode-1")
    return recorder.waits


def test_a_steps_deltas_and_step_state_reach_the_device_without_a_host_wait():
    assert _step_on_the_stand_in() == []


def test_the_recorder_sees_the_waits_it_exists_to_catch():
    # The same recorder, on the operations the glue must not run.
    from vllm.v1.hisparse.resolution import host_to_device

    values = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with HostWaits() as recorder:
        values[0] = torch.tensor(3)  # a blocking copy from pageable host memory
        torch.tensor([1, 2]).to(DEVICE)
        host_to_device([1, 2], DEVICE)  # the glue's way: not recorded
    assert recorder.waits == ["copy_ host -> device, blocking", "_to_copy host -> device, blocking"]
    for read in (lambda: int(values.sum()), lambda: torch.nonzero(values)):
        with HostWaits() as recorder:
            try:
                read()
            except (RuntimeError, NotImplementedError):
                pass  # the meta device has no value to give
        assert recorder.waits and recorder.waits[0].endswith("reads a device value")


def test_the_glue_creates_no_tensor_straight_on_the_device():
    # torch.tensor(values, device=...) copies from pageable memory and waits on CUDA;
    # the dispatch recorder cannot see it, so the source is checked.
    root = Path(__file__).resolve().parents[2] / "vllm" / "v1" / "hisparse"
    found = []
    for name in GLUE:
        for number, line in enumerate((root / name).read_text().splitlines(), start=1):
            if re.search(r"torch\.(tensor|as_tensor)\([^#]*device=", line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert found == []


def test_the_gpu_checks_worker_step_runs_here_and_reads_the_true_rows():
    # scripts/gpu_check.py runs this step on CUDA under the sync debug mode and compares it
    # with this CPU run; here it runs whole, and every host entry reads its true row.
    import kernel_checks as kc

    step = kc.worker_step("cpu")
    host = kc.on_the_host(step)
    assert host["error"] == 0 and host["host_counts"]["partitioned_plans"] == 0
    assert host["host_counts"]["resolver_calls"] == len(kc.WORKER_LAYERS)
    assert kc.host_entries_read_true_rows(step)
    # The post-forward copies landed: host pages 6 and 7 hold blocks 1 and 3 of each layer.
    for layer, cache in enumerate(step["caches"]):
        blocks = cache.view(-1, kc.BLOCK, cache.shape[-1])
        assert torch.equal(host["copied"][layer], blocks[[1, 3]]) and blocks[[1, 3]].any()
    # A wrong row is seen: corrupt the row a HOST entry of the chunk's first token reads.
    k = next(k for k, p in enumerate(step["positions"][1].tolist()) if p < 4 * kc.BLOCK)
    step["caches"][1][step["resolved"][1][1, k]] += 1
    assert not kc.host_entries_read_true_rows(step)
