# One entry point. `make demo` installs only what the demo needs (the `demo` extra: the
# daemons and torch) and runs the main job; `make test` installs everything and runs the
# whole suite (lint, types, tests). Both create ./.venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# torch is pinned to the CPU wheel available here; it goes in first so that the extras'
# range (torch>=2.7,<3) is already satisfied and nothing pulls CUDA.
TORCH  := torch==2.13.0

.PHONY: venv demo test testbed lint typecheck unit bench chaos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[daemon,dev,torch,interop,s3,gcs,ray,controller]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/mtc demo --nodes 4

lint: $(STAMP)
	$(VENV)/bin/ruff check mtc_replicator tests scripts
	$(VENV)/bin/ruff format --check mtc_replicator tests scripts
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# The controller's tests need a real kube-apiserver: built once from Debian's source into
# ~/.cache/mtc-replicator (minutes the first time, a no-op after; tests/controller skip,
# saying why, where it cannot be built).
testbed:
	scripts/k8s_testbed.sh || echo "make: scripts/k8s_testbed.sh failed: tests/controller will skip"

# Two pytest-xdist workers, each taking whole test files (a file's tests share fixed
# addresses and module fixtures), for all but the Ray tests; then the Ray tests alone:
# Ray's scheduling waits on CPU, and beside another worker they took 2.5x as long
# (docs/testing.md).
test: $(STAMP) lint typecheck testbed
	$(PY) -m pytest -q -ra --durations=25 -n 2 --dist loadfile --ignore=tests/ray tests
	$(PY) -m pytest -q -ra --durations=5 tests/ray

bench: $(STAMP)
	$(PY) scripts/bench_local.py --size-mib 1024
	$(PY) scripts/bench_peer.py --size-mib 1024
	$(PY) scripts/bench_restore.py --size-mib 1024
	$(PY) scripts/bench_backup.py --size-mib 1024 --cluster
	$(PY) scripts/bench_fanout.py --size-mib 256
	$(PY) scripts/bench_scale.py
	$(PY) scripts/bench_ranks.py
	$(PY) scripts/bench_interference.py --size-mib 1024
	$(PY) scripts/bench_async_save.py --size-mib 1024 --threads 1
	$(PY) scripts/bench_ray.py --state-mib 256
	$(PY) scripts/bench_tune.py --state-mib 128 --checkpoints 20
	$(PY) scripts/bench_footprint.py --step-mib 256 --saves 4 --idle-seconds 30
	$(PY) scripts/bench_cores.py

# Seeded chaos trials against real daemons (root: a tmpfs and a network namespace per node).
# A failing trial prints its seed and the command that replays it alone. Not in `make test`,
# which runs a few fixed seeds.
TRIALS ?= 100
SEED   ?= 0
chaos: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) -m tests.chaos --trials $(TRIALS) --seed $(SEED)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
