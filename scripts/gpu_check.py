# SPDX-License-Identifier: Apache-2.0
"""Every GPU check of the HiSparse kernels, in one command, on a bare GPU machine.

Usage: python3 scripts/gpu_check.py [--out docs/gpu-check.md] [--quick] [--sanitize]

Needs torch with CUDA and nvcc (no vLLM, no network). It:
1. builds csrc/ as the CUDA wheel does (setup.py, sm_90a and sm_100a) and loads it
   (`--build-only` stops there, and needs no GPU);
2. runs tests/kernels (pytest, when installed) at production shapes, and with
   `--sanitize` again under compute-sanitizer's memcheck and racecheck (when the toolkit
   has it), each in a process that loads the library built in step 1;
3. runs the shared production-shape checks itself (tests/support/kernel_checks.py),
   so the verdicts are there without pytest too: resolution of 128 decode requests
   (fp8_ds_mla and bf16 rows; 0%, 10% and 50% misses), an 8K-token prefill chunk,
   page copies of an 8K-token chunk both ways, out-of-bounds flags, and one whole step
   of the worker's resolution glue and its post-forward page copies on the copy stream
   under `torch.cuda.set_sync_debug_mode("error")`
   (any host wait fails it), compared with the same step on the CPU;
4. measures, with CUDA events: resolver time per step and per layer at batch 64 with
   0%, 10% and 50% misses, the host->device GB/s of the miss path and of page copies,
   and one batched post-forward copy against one launch per layer;
5. writes the figures and verdicts to --out ($OUT/kernels.md when OUT names a folder,
   else docs/gpu-check.md) and to stdout, and the measured bandwidths beside the report
   as `simulator-constants.json` for the capacity simulator.

Exit status: 0 when every check is bit-exact (and pytest passed), 1 otherwise, 2 when
this machine has no CUDA device or cannot build the extension.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "scripts")]

LAYERS = 61  # DeepSeek-V3.2's sparse-MLA layers: one post-forward copy covers them all
# compute-sanitizer's tools `--sanitize` runs tests/kernels under, and the variable naming
# the library those runs load (tests/support/kernel_build.py reads it).
SANITIZER_TOOLS = ("memcheck", "racecheck")
EXTENSION_LIBRARY_ENV = "HISPARSE_EXTENSION_LIBRARY"


def build_extension() -> tuple[float, Path]:
    """Build csrc/ as the CUDA wheel does (setup.py: sm_90a and sm_100a, the toolkit found
    by cuda_build.find_cuda_home) with this interpreter's torch, and load it; seconds
    taken, and the library."""
    import tempfile

    import torch
    from cuda_build import compile_extension

    from vllm.v1.hisparse.ops import OPS, ops_registered

    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-build-"))
    library = compile_extension(sys.executable, work / "lib", work / "temp")
    torch.ops.load_library(str(library))
    if not ops_registered():
        raise RuntimeError(f"the built library does not register torch.ops._hisparse_C.{{{', '.join(OPS)}}}")
    check_messages_format()
    return time.perf_counter() - began, library


def check_messages_format() -> None:
    """The loaded library formats numbers into its messages. A library carrying a private,
    uninitialised copy of the C++ runtime cannot: there a message comes out cut short, or
    the process crashes (as a warning's did on a GPU machine). Runs on meta tensors, so it
    needs no GPU."""
    import torch

    def meta(*shape, dtype=torch.long):
        return torch.empty(*shape, dtype=dtype, device="meta")

    try:
        torch.ops._hisparse_C.copy_host_rows(
            meta(4, dtype=torch.uint8),  # not rows [rows, width]: refused, naming its sizes
            meta(2),
            meta(4, 16, dtype=torch.uint8),
            meta(2),
            meta(2, dtype=torch.bool),
            meta(1),
            1,
            1,
        )
    except RuntimeError as e:
        if "got [4]" in str(e):
            return
        raise RuntimeError(
            f"the built library cannot format its own messages ({str(e).splitlines()[0]!r}): its C++ "
            "runtime is not the one torch uses"
        ) from None
    raise RuntimeError("the built library accepted a 1-D kv_rows: its checks are not the ones in csrc/")


# test_production_shapes.py calls the same checks `verdicts` runs and tabulates below.
PYTEST_ARGS = (
    "-q",
    "-p",
    "no:cacheprovider",
    "--rootdir",
    str(REPO),
    str(REPO / "tests" / "kernels"),
    f"--ignore={REPO / 'tests' / 'kernels' / 'test_production_shapes.py'}",
)


def pytest_command() -> list[str] | None:
    """tests/kernels in a child process: a crash there (a signal) fails the run instead of
    ending this one before its report. With pytest-xdist, across 4 workers, each crash
    failing one test and the rest still running. None without pytest."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return None
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []
    return [sys.executable, "-X", "faulthandler", "-m", "pytest", *workers, "-rf", *PYTEST_ARGS]


def run_pytest(library: Path) -> str:
    command = pytest_command()
    if command is None:
        return "not run: pytest is not installed here (the shared checks below ran without it)"
    print("gpu_check: tests/kernels", flush=True)
    env = {**os.environ, EXTENSION_LIBRARY_ENV: str(library)}
    code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
    if code == 0:
        return "passed"
    return f"FAILED (pytest exit {code}{f', killed by signal {-code}' if code < 0 else ''}; see the output)"


def find_sanitizer() -> Path | None:
    """compute-sanitizer on PATH or in the CUDA toolkit, if there is one."""
    found = shutil.which("compute-sanitizer")
    if found:
        return Path(found)
    from cuda_build import find_cuda_home

    try:
        home = find_cuda_home()
    except Exception:
        return None
    for candidate in (home / "bin" / "compute-sanitizer", home / "compute-sanitizer" / "compute-sanitizer"):
        if candidate.is_file():
            return candidate
    return None


def sanitizer_commands(sanitizer: Path, library: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    """(tool, command, environment) for each tool: tests/kernels under the tool, in a
    process that loads `library`; the tool's own errors fail the run."""
    env = {**os.environ, EXTENSION_LIBRARY_ENV: str(library)}
    return [
        (
            tool,
            [
                str(sanitizer),
                "--tool",
                tool,
                "--error-exitcode",
                "97",
                sys.executable,
                "-m",
                "pytest",
                *PYTEST_ARGS,
            ],
            env,
        )
        for tool in SANITIZER_TOOLS
    ]


def run_sanitizers(library: Path, sanitizer: Path | None) -> dict[str, str]:
    """Each tool's verdict on tests/kernels: passed, FAILED (with the exit status: 97 is
    the tool's own finding), or why it did not run."""
    if sanitizer is None:
        return dict.fromkeys(SANITIZER_TOOLS, "not run: compute-sanitizer is not in this CUDA toolkit")
    results = {}
    for tool, command, env in sanitizer_commands(sanitizer, library):
        print(f"gpu_check: tests/kernels under compute-sanitizer --tool {tool}", flush=True)
        code = subprocess.run(command, cwd=REPO, env=env, check=False).returncode
        results[tool] = (
            "passed" if code == 0 else f"FAILED (exit {code}{': its own finding' if code == 97 else ''})"
        )
    return results


def attempt(rows: list[tuple[str, dict]], name: str, check) -> None:
    """Run one check into `rows`; an exception is a failed verdict, not the end of the run."""
    try:
        result = check()
    except Exception as e:
        result = {"bit_exact": False, "mismatched": [f"raised {type(e).__name__}: {str(e)[:200]}"]}
    rows.append((name, result))
    print(name, result, flush=True)


def verdicts(quick: bool) -> list[tuple[str, dict]]:
    import kernel_checks as kc

    rows: list[tuple[str, dict]] = []
    for kind, row_bytes in kc.ROW_BYTES.items():
        for miss in (0.0, 0.1, 0.5):
            case = kc.resolution_case(128, 1, 16384, miss, row_bytes, seed=1)
            for fused in (True, False):
                plan = "fused plan kernel" if fused else "torch-operation plan"
                name = f"resolve 128 decode requests, {kind} rows, {miss:.0%} misses, {plan}"
                attempt(rows, name, lambda case=case, fused=fused: kc.check_resolution(case, fused=fused))
        case = kc.resolution_case(64, 4, 16384, 0.1, row_bytes, seed=4)
        name = f"resolve 64 requests x 4 tokens (3 drafts), {kind} rows, 10% misses, fused plan kernel"
        attempt(rows, name, lambda case=case: kc.check_resolution(case, fused=True))
        if not quick:
            case = kc.resolution_case(1, 8192, 65536, 0.5, row_bytes, seed=2)
            name = f"resolve an 8K-token prefill chunk, {kind} rows, 50% misses"
            attempt(rows, name, lambda case=case: kc.check_resolution(case))
        for to_host in (True, False):
            direction = "device->host" if to_host else "host->device"
            name = f"page copy, 128 pages x 8 layers, {kind}, {direction}"
            attempt(rows, name, lambda n=row_bytes, out=to_host: kc.check_page_copy(8, 128, n, out))

    def bounds() -> dict:
        flags = kc.check_out_of_bounds_kernels()
        return {"bit_exact": all(flags.values()), **flags}

    attempt(rows, "out-of-bounds indices flag the error word, write nothing", bounds)
    attempt(
        rows,
        "the registered host pool (cudaHostRegister'd mmap) read by the row and page kernels",
        kc.check_registered_host_pool,
    )
    attempt(
        rows,
        "a worker step (deltas, plan, rows, counters): no host wait (sync debug mode), as on the CPU",
        kc.check_worker_step_without_host_waits,
    )
    return rows


def timings() -> dict:
    import kernel_checks as kc

    resolver, batches, pages, failures = {}, {}, {}, []
    for miss in (0.0, 0.1, 0.5):
        try:
            case = kc.resolution_case(64, 1, 16384, miss, kc.ROW_BYTES["fp8_ds_mla"], seed=3)
            resolver[miss] = kc.time_resolution(case)
            print("resolver", miss, resolver[miss], flush=True)
        except Exception as e:
            failures.append(f"resolver at {miss:.0%} misses raised {type(e).__name__}: {str(e)[:200]}")
    # The plan is one block per request: how its time moves with the batch.
    for batch in (1, 8):
        try:
            case = kc.resolution_case(batch, 1, 16384, 0.1, kc.ROW_BYTES["fp8_ds_mla"], seed=3)
            batches[batch] = kc.time_resolution(case)
            print("resolver batch", batch, batches[batch], flush=True)
        except Exception as e:
            failures.append(f"resolver at batch {batch} raised {type(e).__name__}: {str(e)[:200]}")
    for to_host in (True, False):
        try:
            pages[to_host] = kc.time_page_copy(LAYERS, 128, kc.ROW_BYTES["fp8_ds_mla"], to_host)
            print("pages", to_host, pages[to_host], flush=True)
        except Exception as e:
            failures.append(f"page copy (to_host={to_host}) raised {type(e).__name__}: {str(e)[:200]}")
    return {"resolver": resolver, "batches": batches, "pages": pages, "failures": failures}


def default_out() -> Path:
    """Where the report goes: a runner's output folder ($OUT) when there is one."""
    folder = os.environ.get("OUT")
    if folder and Path(folder).is_dir():
        return Path(folder) / "kernels.md"
    return REPO / "docs" / "gpu-check.md"


def torch_note(version: str) -> str:
    """What the torch on this machine means for the figures: the wheel pins upstream's."""
    import tomllib

    pinned = tomllib.loads((REPO / "upstream.toml").read_text())["upstream"]["cpu_torch"]
    if version.split("+")[0] == pinned:
        return f"torch {version}, the version the wheel pins"
    return (
        f"torch {version}, not the {pinned} the wheel pins: the extension was built here against "
        "this torch, so the checks cover the kernels' code, not the shipped binary"
    )


def simulator_constants(figures: dict) -> dict[str, float]:
    """The measured figures as the capacity simulator's constants (`python -m
    vllm.v1.hisparse.capacity simulate --constants FILE`): whole-page copies each way; the
    resolver's miss path (its rows gathered host -> device) at 10% misses, the share the
    step model's hot-buffer hit rate (90%) leaves; and the resolver's own work, its plan
    (10% misses) and its replay without misses, as the GPU runs them back to back."""
    constants = {}
    pages, resolver = figures.get("pages", {}), figures.get("resolver", {})
    if pages.get(False, {}).get("batched_gbps"):
        constants["h2d_bytes_per_s"] = pages[False]["batched_gbps"] * 1e9
    if pages.get(True, {}).get("batched_gbps"):
        constants["d2h_bytes_per_s"] = pages[True]["batched_gbps"] * 1e9
    if resolver.get(0.1, {}).get("h2d_gbps"):
        constants["row_h2d_bytes_per_s"] = resolver[0.1]["h2d_gbps"] * 1e9
    if resolver.get(0.1, {}).get("fused_plan_pipelined_us"):
        constants["resolver_plan_s"] = resolver[0.1]["fused_plan_pipelined_us"] * 1e-6
    if resolver.get(0.0, {}).get("apply_pipelined_us"):
        constants["resolver_replay_s"] = resolver[0.0]["apply_pipelined_us"] * 1e-6
    return constants


def write_report(
    out: Path, machine: dict, pytest_result: str, rows: list[tuple[str, dict]], figures: dict, command: str
) -> str:
    lines = [
        "# GPU check: the HiSparse kernels",
        "",
        f"Written by `{command}` on {machine['date']}.",
        "",
        f"- GPU: {machine['gpu']} (compute capability {machine['capability']}), CUDA {machine['cuda']}",
        f"- {torch_note(machine['torch'])}; Python {machine['python']}",
        f"- extension built from csrc/ in {machine['build_s']:.0f} s",
        f"- tests/kernels: {pytest_result}",
        "",
        "## Bit-exact against the torch references",
        "",
        "| check | verdict | rows loaded | rows hit |",
        "| --- | --- | --- | --- |",
    ]
    for name, result in rows:
        mismatched = ", ".join(result.get("mismatched", [])) or "see the output"
        verdict = "bit-exact" if result["bit_exact"] else f"MISMATCH: {mismatched}"
        loaded, hit = result.get("rows_loaded", ""), result.get("rows_hit", "")
        lines.append(f"| {name} | {verdict} | {loaded} | {hit} |")
    lines += [
        "",
        "## Resolver, batch 64, top-K 2048, hot buffer 4096, fp8_ds_mla rows",
        "",
        "The plan is made once per step and top-K selection (by the fused kernel when the",
        "step fits it, else by torch operations); each layer that reads that selection",
        "replays it, row copies included. A call timed alone from an idle GPU includes the",
        "host's launch work; back to back (pipelined), the host runs ahead and the time per",
        "call is the GPU's where the GPU is the slower.",
        "",
        "| misses | fused plan (µs) | fused plan: host / pipelined (µs) | torch-operation plan (µs) "
        "| replay per layer (µs) | replay: host / pipelined (µs) | rows loaded per layer "
        "| miss-path H2D GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for miss, r in figures["resolver"].items():
        lines.append(
            f"| {miss:.0%} | {r['fused_plan_us']:.1f} "
            f"| {r['fused_plan_host_us']:.1f} / {r['fused_plan_pipelined_us']:.1f} "
            f"| {r['torch_plan_us']:.1f} | {r['apply_us_per_layer']:.1f} "
            f"| {r['apply_host_us']:.1f} / {r['apply_pipelined_us']:.1f} "
            f"| {r['rows_loaded']} | {r['h2d_gbps']:.1f} |"
        )
    lines += [
        "",
        "By batch, 10% misses (the plan is one block per request):",
        "",
        "| requests | fused plan (µs) | fused plan: host / pipelined (µs) | replay per layer (µs) |",
        "| --- | --- | --- | --- |",
    ]
    by_batch = dict(figures.get("batches", {}))
    if 0.1 in figures["resolver"]:
        by_batch[64] = figures["resolver"][0.1]
    for batch, r in sorted(by_batch.items()):
        lines.append(
            f"| {batch} | {r['fused_plan_us']:.1f} | {r['fused_plan_host_us']:.1f} / "
            f"{r['fused_plan_pipelined_us']:.1f} | {r['apply_us_per_layer']:.1f} |"
        )
    lines += [
        "",
        f"## Page copies, 128 pages (an 8K-token chunk) x {LAYERS} layers, fp8_ds_mla",
        "",
        "| direction | one batched launch (µs) | one launch per layer (µs) | batched GB/s |",
        "| --- | --- | --- | --- |",
    ]
    for to_host, r in figures["pages"].items():
        direction = "device->host (post-forward)" if to_host else "host->device (restore)"
        lines.append(
            f"| {direction} | {r['batched_us']:.0f} | {r['per_layer_us']:.0f} | {r['batched_gbps']:.1f} |"
        )
    for failure in figures["failures"]:
        lines.append(f"\nNot measured: {failure}")
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out(),
        help="the report (default: $OUT/kernels.md when OUT names a folder, as a "
        "remote runner's output folder does; else docs/gpu-check.md)",
    )
    parser.add_argument("--quick", action="store_true", help="skip the 8K-token prefill resolution")
    parser.add_argument(
        "--build-only", action="store_true", help="build and load the extension, then stop (needs no GPU)"
    )
    parser.add_argument(
        "--sanitize",
        action="store_true",
        help="also run tests/kernels under compute-sanitizer's memcheck and racecheck (minutes more)",
    )
    args = parser.parse_args(argv)
    import torch

    if not args.build_only and not torch.cuda.is_available():
        print("gpu_check: this machine has no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 2
    try:
        build_s, library = build_extension()
    except Exception as e:
        print(f"gpu_check: building csrc/ failed: {e}", file=sys.stderr)
        return 2
    if args.build_only:
        print(f"gpu_check: built and loaded the extension in {build_s:.0f} s: {library}")
        return 0
    major, minor = torch.cuda.get_device_capability()
    machine = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "capability": f"{major}.{minor}",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "build_s": build_s,
    }
    pytest_result = run_pytest(library)
    if args.sanitize:
        sanitized = run_sanitizers(library, find_sanitizer())
        pytest_result += "; " + ", ".join(f"{tool}: {verdict}" for tool, verdict in sanitized.items())
    rows = verdicts(args.quick)
    figures = timings()
    command = (
        "python3 scripts/gpu_check.py"
        + (" --quick" if args.quick else "")
        + (" --sanitize" if args.sanitize else "")
    )
    # The formatted report on stdout too: a runner may hand back only its output.
    print(write_report(args.out, machine, pytest_result, rows, figures, command))
    constants = args.out.with_name("simulator-constants.json")
    constants.write_text(json.dumps(simulator_constants(figures), indent=2) + "\n")
    print(f"gpu_check: wrote {args.out} and {constants} (capacity simulate --constants)")
    exact = all(result["bit_exact"] for _, result in rows)
    return 0 if exact and not figures["failures"] and "FAILED" not in pytest_result else 1


if __name__ == "__main__":
    sys.exit(main())
