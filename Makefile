# hettrain — the two commands a person needs: `make demo` and `make test`.
# Every target sets itself up on a fresh machine (venv, Python deps, control plane build).

SHELL := /bin/bash
PY_VERSION ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.deps-stamp
PYTEST_ARGS ?=

.PHONY: help venv lint test test-unit test-integration test-e2e demo plan-examples bench clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(PY):
	$(PY_VERSION) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Reinstall only when pyproject.toml changes; torch is pinned so pip keeps it (and its cache).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[viz,operator,runtime,test,lint]'
	touch $(STAMP)

venv: $(STAMP)  ## create .venv with the project and all test/lint deps

lint: $(STAMP)  ## ruff + import-linter contracts (pure core stays pure)
	$(VENV)/bin/ruff check operator tests e2e bench
	$(VENV)/bin/lint-imports

# One pytest session: the local control plane (e2e/cluster, built once into ~/.cache/hettrain)
# starts once and serves tests/ (unit, multi-process runtime, operator integration, chart,
# monitoring, demo) and e2e/tests (chart RBAC, examples, 1000-node scale test).
test: lint  ## lint, then every test (unit, multi-process runtime, real control plane, e2e)
	$(PY) -m pytest tests e2e/tests $(PYTEST_ARGS)

test-integration: $(STAMP)  ## only the operator's integration suite on the real control plane
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: $(STAMP)  ## only the e2e suite (KUBECONFIG=... to run it against your own cluster)
	$(PY) -m pytest e2e/tests $(PYTEST_ARGS)

test-unit: $(STAMP)  ## tests that need no control plane
	$(PY) -m pytest -m 'not k8s' $(PYTEST_ARGS)

plan-examples: $(STAMP)  ## plan every example job against its cluster
	@for job in examples/jobs/*.yaml; do \
	  cluster=$$(sed -n 's/^# cluster: *//p' $$job); \
	  echo "=== $$job on $$cluster"; \
	  $(VENV)/bin/hettrain plan $$job --cluster $$cluster || exit 1; \
	done

# demo: builds the control plane once (~12 min cold on 2 cores, progress on stderr), then runs
# `hettrain demo` (docs/demo.md); pass options with DEMO_ARGS="--steps 20 --keep".
demo: $(STAMP)  ## the embedded demo: local control plane, operator, plan, CPU training, node failure, repair
	e2e/cluster/build >/dev/null
	$(VENV)/bin/hettrain demo $(DEMO_ARGS)

bench: $(STAMP)  ## run the benchmarks (ratios, medians of repeats; collectives needs root for netns)
	$(PY) bench/plan_scale.py
	$(PY) bench/fidelity.py
	$(PY) bench/simulate.py
	$(PY) bench/operator_latency.py
	$(PY) bench/runtime.py
	$(PY) bench/collectives.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
