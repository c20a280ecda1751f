# SPDX-License-Identifier: Apache-2.0
"""The fused resolution plan's algorithm (csrc/hisparse_plan.h), built for the host with
the C++ compiler and called through ctypes: the same phases the CUDA kernel runs, one
after another, so the CPU tests hold them to the torch reference on every run."""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import torch

from vllm.v1.hisparse.resolver import HotState, ResolutionPlan, fused_plan_buffers, fused_plan_shape

REPO = Path(__file__).resolve().parents[2]
POINTERS_IN = (
    "positions",
    "token_requests",
    "host_page_table",
    "table_rows",
    "hot_positions",
    "hot_stamps",
    "staging_slots",
)
SIZES = (
    "num_tokens",
    "topk",
    "num_requests",
    "hot_rows",
    "table_height",
    "num_pages",
    "block_size",
    "step",
    "max_entries",
    "hot_pad",
)
POINTERS_OUT = (
    "on_host",
    "entry_request",
    "entry_slot",
    "load",
    "load_request",
    "load_slot",
    "load_host_row",
    "counts",
    "error",
    "request_error",
)


class PlanArgs(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_void_p) for name in POINTERS_IN]
        + [(name, ctypes.c_int64) for name in SIZES]
        + [(name, ctypes.c_void_p) for name in POINTERS_OUT]
    )


@functools.cache
def library(build_dir: Path) -> ctypes.CDLL:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("a C++ compiler is needed to build the fused plan for the host")
    out = build_dir / "plan_host.so"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            f"-I{REPO / 'csrc'}",
            str(REPO / "tests" / "support" / "plan_host.cpp"),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.hisparse_plan_args_size.restype = ctypes.c_int64
    assert lib.hisparse_plan_args_size() == ctypes.sizeof(PlanArgs), "PlanArgs layouts differ"
    lib.hisparse_plan_host.argtypes = [ctypes.POINTER(PlanArgs)]
    return lib


def fused_plan_on_host(
    build_dir: Path,
    positions: torch.Tensor,
    token_requests: torch.Tensor,
    host_page_table: torch.Tensor,
    block_size: int,
    hot: HotState,
    staging_slots: torch.Tensor,
    step: int,
    table_rows: torch.Tensor,
) -> ResolutionPlan:
    """What the fused kernel plans for these CPU tensors; updates `hot` like plan_resolution."""
    lib = library(build_dir)
    num_tokens, topk = positions.shape
    valid = token_requests[(token_requests >= 0) & (token_requests < hot.positions.shape[0])]
    most = int(torch.bincount(valid).max()) if valid.numel() else 1
    shape = fused_plan_shape(most, topk, hot.positions.shape[1])
    assert shape is not None, "the case does not fit the fused plan"
    plan, inputs, (flags, ints) = fused_plan_buffers(
        positions, token_requests, host_page_table, table_rows, staging_slots
    )
    positions32, requests64, table, rows64, staging64 = inputs
    entries = num_tokens * topk
    keep = [*inputs, hot.positions, hot.stamps, flags, ints]  # alive through the call
    args = PlanArgs(
        positions32.data_ptr(),
        requests64.data_ptr(),
        table.data_ptr(),
        rows64.data_ptr(),
        hot.positions.data_ptr(),
        hot.stamps.data_ptr(),
        staging64.data_ptr(),
        num_tokens,
        topk,
        hot.positions.shape[0],
        hot.positions.shape[1],
        table.shape[0],
        table.shape[1],
        block_size,
        step,
        shape[0],
        shape[1],
        flags[0].data_ptr(),
        ints.data_ptr(),
        ints.data_ptr() + 8 * entries,
        flags[1].data_ptr(),
        ints.data_ptr() + 16 * entries,
        ints.data_ptr() + 24 * entries,
        ints.data_ptr() + 32 * entries,
        ints.data_ptr() + 40 * entries,
        ints.data_ptr() + 8 * (5 * entries + 3),
        ints.data_ptr() + 8 * (5 * entries + 4),
    )
    lib.hisparse_plan_host(ctypes.byref(args))
    del keep
    return plan
