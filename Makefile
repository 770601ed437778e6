# One-command entry points. `make install` is implied by the others and is idempotent.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LINTED := extproc devstack tests $(wildcard bench)

ENGINE_VENV ?= .venv-vllm

.PHONY: install lock system-deps engine-env run test test-fast lint proto bench bench-full clean

## Installs exactly requirements.lock (every dependency pinned; `make lock` refreshes it deliberately).
$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## Re-resolve pyproject.toml's dependencies into requirements.lock (then run the tests and commit it).
lock:
	PYTHON=$(PYTHON) bash scripts/lock.sh

## System programs the tests run for real (redis-server, redis-cli, prometheus, promtool, openssl): installed
## with apt-get when missing, otherwise a clear error naming the packages. Tests never skip for want of them.
system-deps:
	bash scripts/system-deps.sh

## The real-engine tier's vLLM 0.32.0 (CPU build) in its own venv (3.5 GB; reused when present).
engine-env:
	bash scripts/engine-env.sh $(ENGINE_VENV)

## Start the local stack: simulator + sidecar + Envoy on 127.0.0.1 (Ctrl-C stops it). In front of a server of
## your own instead of the simulator: make run UPSTREAM=http://HOST:PORT
run: $(STAMP)
	$(BIN)/python -m devstack $(if $(UPSTREAM),--upstream $(UPSTREAM))

## Lint, type-check and run every test: unit, component, end-to-end (real Envoy) and the real-engine tier
## (a real vLLM behind the gateway, tests/engine).
test: $(STAMP) system-deps engine-env lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/engine
	EXTPROC_ENGINE_VENV=$(abspath $(ENGINE_VENV)) $(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 tests/engine

## Unit and component tests only (no Envoy processes).
test-fast: $(STAMP) system-deps
	$(BIN)/python -m pytest -q -m "not e2e and not engine"

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy $(LINTED)

## Regenerate the gRPC code of proto/ (CI fails when the committed code is stale).
proto: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/gen_proto.sh

## Short benchmark run (under five minutes); results go to bench/results/.
bench: $(STAMP)
	$(BIN)/python -m bench --short

bench-full: $(STAMP)
	$(BIN)/python -m bench --full

clean:
	rm -rf $(VENV) $(ENGINE_VENV) run .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
