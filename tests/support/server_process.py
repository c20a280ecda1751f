# SPDX-License-Identifier: Apache-2.0
"""What a running `vllm serve` owns on this machine: its process tree and the shared memory it maps.

For tests that kill part of a server and then check that nothing of it is left:
the processes under the server's pid (API server, engine core, workers), the
one that runs the model, and the names under /dev/shm that those processes map
or hold open. Reads /proc and psutil only; never signals anything itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import psutil

SHM = Path("/dev/shm")
# Process titles vLLM gives its engine core and its executor's workers.
WORKER_TITLE = "VLLM::Worker"
ENGINE_CORE_TITLE = "VLLM::EngineCore"


def process_tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and every process below it."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _title(process: psutil.Process) -> str:
    try:
        return " ".join([process.name(), *process.cmdline()])
    except psutil.Error:
        return ""


def model_runner_process(pid: int) -> psutil.Process:
    """The process under `pid` that runs the model: an executor worker, else the engine core
    (an in-process executor runs the model there)."""
    tree = process_tree(pid)
    for title in (WORKER_TITLE, ENGINE_CORE_TITLE):
        found = [p for p in tree if title in _title(p)]
        if found:
            return found[0]
    raise LookupError(f"no {WORKER_TITLE} or {ENGINE_CORE_TITLE} process under pid {pid}: {tree}")


def _shm_names_of(pid: int) -> set[Path]:
    names: set[Path] = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                # A name unlinked already cannot be left behind: the kernel frees it with the last user.
                if len(fields) == 6 and fields[5].startswith(f"{SHM}/") and "(deleted)" not in fields[5]:
                    names.add(Path(fields[5].strip()))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(f"{SHM}/") and "(deleted)" not in target:
                names.add(Path(target))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass  # the process ended while being read
    return names


def shared_memory_in_use(processes: Iterable[psutil.Process]) -> set[Path]:
    """Names under /dev/shm that these processes map or hold open now."""
    return set().union(*(_shm_names_of(p.pid) for p in processes))
