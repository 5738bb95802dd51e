# Trainyard: `make run` starts a single-machine cluster, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
PYTEST := $(BIN)/python -m pytest

.PHONY: venv deps test-deps run test test-integration test-fast test-postgres lint docs bench gpu-checks clean

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11) on PATH" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

deps:
	@scripts/ensure_system_deps.sh

# The browser tests drive Debian's Chromium through Playwright (never `playwright install`).
test-deps:
	@scripts/ensure_system_deps.sh chromium iproute2

# Each process's whole output goes to var/log/<process>.log; the terminal shows starts, exits, job and
# node events, warnings and errors. `make run VERBOSE=1` (or TRAINYARD_RUN_VERBOSE=1) shows every line.
run: venv deps
	$(if $(VERBOSE),TRAINYARD_RUN_VERBOSE=$(VERBOSE)) scripts/run.sh

# Everything but the whole-cluster suites, real processes included (Redis on a free port, Celery
# workers, torchrun, daphne, Chromium), then `test-integration`: on 2 cores the two together ran
# past the 40 minutes one make target may take, so CI (.ci/run) runs them as two targets.
test: venv test-deps
	$(PYTEST) -q --ignore=tests/integration

# tests/integration: whole Trainyard clusters (tests/integration/cluster.py: Redis, web, control
# worker, beat, relay, two sandboxed node agents) per module: control path, chaos, hostile jobs,
# network-namespace hosts, user code, CLI, and a real Slurm cluster (slurmctld + one slurmd per test
# host, tests/integration/slurm_cluster.py: Debian's slurm-wlm and munge; sshd as its login node).
test-integration: venv test-deps
	@scripts/ensure_system_deps.sh slurm openssh-server
	$(PYTEST) -q tests/integration

# The control-plane suite and the integration tests of the control plane's own behaviour (chaos, API
# fuzz, every control-path test, the live dashboard) on a real PostgreSQL server (Debian's postgresql,
# started by tests/postgres.py in a temporary directory on a free port, stopped at the end).
# `make test-postgres PG_TESTS="tests/jobs tests/integration"` runs everything.
PG_TESTS ?= tests/jobs tests/integration/test_chaos.py tests/integration/test_api_fuzz.py \
	tests/integration/test_control_path.py tests/integration/test_live.py
# The straggler test judges step-time ratios on a timer; it is not about the database (it runs on
# SQLite in `make test`) and timed out once on PostgreSQL on a loaded 2-core machine.
PG_DESELECT ?= --deselect tests/integration/test_chaos.py::test_a_slowed_rank_is_flagged_as_straggler_and_cleared_when_it_recovers
test-postgres: venv test-deps
	@scripts/ensure_system_deps.sh postgresql
	$(PYTEST) -q -p tests.postgres --postgres $(PG_TESTS) $(PG_DESELECT)

# ruff, and import-linter's layer contracts (pyproject.toml).
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The generated references (docs/reference/jobspec.md from the JobSpec, rest-api.md from the
# OpenAPI document); tests/test_docs_reference.py fails when they are stale.
docs: venv
	DJANGO_SETTINGS_MODULE=controlplane.settings $(BIN)/python scripts/gen_reference.py

# Only tests that start no processes, on two workers (pytest-xdist: each its own test database).
test-fast: venv
	$(PYTEST) -q -m "not procs" -n 2

# The GPU checks of the CUDA/NCCL paths (bench/gpu_checks.py): one JSON line per check; checks
# that need more GPUs than the machine has are printed as skipped. Not part of CI (no GPU there).
gpu-checks: venv
	$(BIN)/python bench/gpu_checks.py

# Benchmarks print one JSON object each (BENCH_ARGS=--quick for ~2 min telemetry and load runs).
# compression.py and localsgd.py rate-limit a veth pair between network namespaces (root,
# iproute2); without them they fall back to loopback and report bytes and loss only.
bench: venv deps
	@scripts/ensure_system_deps.sh iproute2
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/sdk_overhead.py
	$(BIN)/python bench/prepare.py
	$(BIN)/python bench/auto_user.py
	$(BIN)/python bench/sandbox.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/telemetry.py $(BENCH_ARGS)
	$(BIN)/python bench/load.py $(BENCH_ARGS)
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/scheduler.py
	$(BIN)/python bench/joblist.py
	$(BIN)/python bench/hetero.py
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/localsgd.py
	$(BIN)/python bench/planner_published.py
	$(BIN)/python bench/calibration.py
	$(BIN)/python bench/recompute_zero.py

clean:
	rm -rf var .pytest_cache
