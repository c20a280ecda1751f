# SPDX-License-Identifier: Apache-2.0
"""Run by a CUDA-torch interpreter (the CUDA build environment): load an extracted
`vllm/_hisparse_C.abi3.so` through `vllm.v1.hisparse.ops` and report, as JSON on
stdout, what a GPU-less machine can check: the ops and their schemas, the errors
for CPU tensors and for bad shapes, and `torch.library.opcheck` on meta tensors.

Usage: python extension_probe.py <folder holding vllm/> (no vLLM needed)
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")


def main(root: str) -> dict:
    sys.path.insert(0, root)
    import torch

    from vllm.v1.hisparse import ops

    report: dict = {"problem": ops.extension_problem(), "torch_cuda": torch.version.cuda}
    if report["problem"] is not None:
        return report
    namespace = torch.ops._hisparse_C
    report["schemas"] = {op: str(getattr(namespace, op).default._schema) for op in ops.OPS}
    report["narrow_copy_launches"] = ops.narrow_copy_launches()

    def error_of(call) -> str | None:
        try:
            call()
        except Exception as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return None

    def rows_args(device: str, host_width: int = 656, block_rows: int = 16):
        long = dict(dtype=torch.int64, device=device)
        return (
            torch.zeros(64, 656, dtype=torch.uint8, device=device),
            torch.zeros(8, **long),
            torch.zeros(32, host_width, dtype=torch.uint8, device=device),
            torch.zeros(8, **long),
            torch.zeros(8, dtype=torch.bool, device=device),
            torch.zeros((), **long),
            32,
            block_rows,
        )

    def apply_args(device: str, load_entries: int = 12):
        long = dict(dtype=torch.int64, device=device)
        tokens, topk = 3, 4
        return (
            torch.zeros(tokens, topk, dtype=torch.int32, device=device),
            torch.zeros(tokens, topk, dtype=torch.bool, device=device),
            torch.zeros(tokens, topk, **long),
            torch.zeros(tokens, topk, **long),
            torch.zeros(2, 8, **long),
            torch.zeros(64, 656, dtype=torch.uint8, device=device),
            torch.zeros(2, 8, **long),
            torch.zeros(32, 656, dtype=torch.uint8, device=device),
            torch.zeros(load_entries, dtype=torch.bool, device=device),
            torch.zeros(load_entries, **long),
            torch.zeros(load_entries, **long),
            torch.zeros(load_entries, **long),
            torch.zeros((), **long),
            64,
            64,
        )

    def pages_args(device: str, block_columns: int = 3):
        long = dict(dtype=torch.int64, device=device)
        caches = [torch.zeros(10, 64, 656, dtype=torch.uint8, device=device) for _ in range(3)]
        return (
            caches,
            torch.zeros(3, 5, 64, 656, dtype=torch.uint8, device=device),
            torch.zeros(2, block_columns, **long),
            torch.zeros(2, **long),
            True,
            torch.zeros((), **long),
        )

    def plan_args(device: str, max_entries: int = 16, topk: int = 4):
        long = dict(dtype=torch.int64, device=device)
        tokens, requests, hot = 3, 2, 8
        return (
            torch.zeros(tokens, topk, dtype=torch.int32, device=device),
            torch.zeros(tokens, **long),
            torch.zeros(5, 6, **long),
            torch.zeros(requests, **long),
            torch.zeros(requests, **long),
            torch.zeros(requests, hot, **long),
            torch.zeros(requests, hot, **long),
            64,
            7,
            max_entries,
            8,
            torch.zeros(2, tokens * topk, dtype=torch.bool, device=device),
            torch.zeros(5 * tokens * topk + 4, **long),
        )

    report["cpu_errors"] = {
        "apply_resolution": error_of(lambda: namespace.apply_resolution(*apply_args("cpu"))),
        "copy_host_rows": error_of(lambda: namespace.copy_host_rows(*rows_args("cpu"))),
        "copy_pages": error_of(lambda: namespace.copy_pages(*pages_args("cpu"))),
        "plan_resolution": error_of(lambda: namespace.plan_resolution(*plan_args("cpu"))),
    }
    report["meta_shape_errors"] = {
        "apply_resolution": error_of(
            lambda: namespace.apply_resolution(*apply_args("meta", load_entries=10))
        ),
        "copy_host_rows": error_of(lambda: namespace.copy_host_rows(*rows_args("meta", host_width=600))),
        "copy_host_rows_block_rows": error_of(
            lambda: namespace.copy_host_rows(*rows_args("meta", block_rows=33))
        ),
        "copy_pages": error_of(lambda: namespace.copy_pages(*pages_args("meta", block_columns=2))),
        "plan_resolution": error_of(lambda: namespace.plan_resolution(*plan_args("meta", max_entries=12))),
        "plan_resolution_topk_0": error_of(lambda: namespace.plan_resolution(*plan_args("meta", topk=0))),
    }
    # gpu_check maps the production host pool on machines without vLLM.
    from vllm.v1.hisparse.host_memory import HostPoolMemory

    pool = HostPoolMemory((1, 2, 64, 16), torch.uint8, register=False)
    report["host_pool_without_vllm"] = list(pool.tensor.shape)
    report["opcheck"] = {
        "apply_resolution": torch.library.opcheck(namespace.apply_resolution.default, apply_args("meta")),
        "copy_host_rows": torch.library.opcheck(namespace.copy_host_rows.default, rows_args("meta")),
        "copy_pages": torch.library.opcheck(namespace.copy_pages.default, pages_args("meta")),
        "plan_resolution": torch.library.opcheck(namespace.plan_resolution.default, plan_args("meta")),
    }
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
