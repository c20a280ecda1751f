# SPDX-License-Identifier: Apache-2.0
"""HiSparse's modules depend on each other one way, the way data flows.

Every import counts, a lazy one inside a function too: config and the plan's
message types are leaves, and no chain of imports among HiSparse's modules
comes back to where it started.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "vllm"
HISPARSE_MODULES = {
    "vllm.config.hisparse": OVERLAY / "config" / "hisparse.py",
    **{
        f"vllm.v1.hisparse.{path.stem}": path
        for path in sorted((OVERLAY / "v1" / "hisparse").glob("*.py"))
        if path.stem != "__init__"
    },
}
LEAVES = ("vllm.config.hisparse", "vllm.v1.hisparse.plan")


def imported_hisparse_modules(path: Path) -> set[str]:
    """HiSparse modules `path` imports anywhere (module level, functions, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in HISPARSE_MODULES)
    return found


def dependency_graph() -> dict[str, set[str]]:
    return {name: imported_hisparse_modules(path) - {name} for name, path in HISPARSE_MODULES.items()}


def test_config_and_plan_are_leaves():
    graph = dependency_graph()
    for leaf in LEAVES:
        assert not graph[leaf], f"{leaf} imports {sorted(graph[leaf])}"


def test_hisparse_modules_import_each_other_without_a_cycle():
    graph = dependency_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_the_cycle_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from vllm.v1.hisparse.worker import HiSparseWorker\n")
    assert imported_hisparse_modules(module) == {"vllm.v1.hisparse.worker"}
