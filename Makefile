# The commands of this distribution (see README.md and docs/).
PYTHON ?= python3
VENV_PY := .venv/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`, a test file at a time each (0: one process)
PYTEST_WORKERS ?= 2
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup test test-fast lint demo wheel image bench stress clean

## setup: build this machine's distribution wheel and install it into .venv (idempotent)
setup:
	$(PYTHON) scripts/setup_env.py $(if $(FORCE),--force,)

## test: setup, then lint and the whole CPU test suite (GPU tests skip without CUDA)
test: lint
	$(VENV_PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

## test-fast: setup, then the unit and integration tests only (a few minutes; CI runs `make test`)
test-fast: setup
	$(VENV_PY) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

## stress: setup, then the scheduler-level stress harness with SEEDS seeds per configuration,
## and as many random simulated runs (MTP, the OffloadingConnector) times ten
stress: setup
	HISPARSE_STRESS_SEEDS=$(or $(SEEDS),50) $(VENV_PY) -m pytest tests/integration/test_hisparse_stress.py
	HISPARSE_SIM_STRESS_SEEDS=$$(( $(or $(SEEDS),50) * 10 )) $(VENV_PY) -m pytest \
		tests/e2e/test_capacity_simulation.py -k random_simulated

## lint: setup, then .pre-commit-config.yaml's hooks over the repository (offline: .venv's tools)
lint: setup
	PRE_COMMIT_HOME=.cache/pre-commit .venv/bin/pre-commit run --all-files --show-diff-on-failure

## wheel: the full distribution wheel in dist/ (FLAVOUR=cpu|cuda, default: this machine's)
wheel:
	$(if $(wildcard $(VENV_PY)),$(VENV_PY),$(PYTHON)) scripts/build_wheel.py $(if $(FLAVOUR),--flavour $(FLAVOUR),)

## image: the container image from the CUDA wheel (needs a Docker engine); BASE_DIGEST=sha256:... pins the base
image:
	$(MAKE) wheel FLAVOUR=cuda
	docker build $(if $(BASE_DIGEST),--build-arg BASE_DIGEST=$(BASE_DIGEST),) \
		-t vllm-hisparse:$$($(PYTHON) scripts/upstream.py image-tag) .

## demo: setup, then vllm serve of a tiny GLM-5 with Hybrid HiSparse under KV pressure, driven by
## a multi-turn agentic client; prints residency states, pages moved, hot hits, preemptions
demo: setup
	$(VENV_PY) scripts/demo.py $(DEMO_ARGS)

## bench: setup, then the agentic benchmark (quick size): preemption, OffloadingConnector, Hybrid
## HiSparse and HiSparse "always" side by side against vllm serve; JSON + PNG in benchmarks/results/
bench: setup
	$(VENV_PY) benchmarks/agentic.py $(BENCH_ARGS)

clean:
	rm -rf dist build .pytest_cache
