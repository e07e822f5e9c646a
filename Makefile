# Two set-up commands: `make demo` and `make test`. Both work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TRACES ?= ../shared/traces
STAMP  := $(VENV)/.installed

.PHONY: demo test lint engine redis clean compiled test-compiled

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: a side-by-side bench on a real shared trace (synthetic when ../shared is absent).
demo: $(STAMP)
	$(BIN)/python -m turnstile.demo --traces $(TRACES)

# llama.cpp's llama-server, built once from source and cached under .cache/ (about 7 min on 2 cores).
engine:
	PYTHON=$(BIN)/python bash scripts/build_llama_server.sh

# Redis's redis-server for the gateway-replica tests (Debian's package, installed when missing).
redis:
	bash scripts/install_redis.sh

test: $(STAMP) engine redis
	$(BIN)/ruff check src tests benchmarks
	TURNSTILE_LLAMA_SERVER="$$(bash scripts/build_llama_server.sh | tail -n 1)" \
	TURNSTILE_REDIS_SERVER="$$(bash scripts/install_redis.sh | tail -n 1)" \
		$(BIN)/pytest -q --timeout=600

# Opt-in: the simulator's hot modules compiled with mypyc into their own venv, .venv-compiled
# (nothing is built into src/; `make test` and `make demo` never use it). Needs a C compiler.
# Rebuilds on every call. Run the benchmark with .venv-compiled/bin/python benchmarks/sim_speed.py.
COMPILED := .venv-compiled

$(COMPILED)/bin/python:
	$(PYTHON) -m venv $(COMPILED)
	$(COMPILED)/bin/pip install -q --upgrade pip

$(COMPILED)/.deps: $(COMPILED)/bin/python pyproject.toml
	$(COMPILED)/bin/pip install -q '.[test]' 'mypy==2.4.1' setuptools wheel
	touch $@

compiled: $(COMPILED)/.deps
	$(COMPILED)/bin/python scripts/build_compiled.py
	$(COMPILED)/bin/turnstile version

# The simulator's exactness tests against the compiled build (bit-identical results).
test-compiled: compiled
	TURNSTILE_EXPECT_COMPILED=1 $(COMPILED)/bin/python -m pytest -q -p no:cacheprovider \
		tests/test_build_info.py tests/sim/test_golden_run.py tests/sim/test_leap_exact.py \
		tests/sim/test_leap_sums.py tests/sim/test_prefill_leap.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(COMPILED) build/compiled .pytest_cache .ruff_cache

# The robustness suite (simulated): every policy on every workload family, cluster and load
# (docs/robustness.md); `make robustness SUITE=quick` for the ≤ 3 min form CI runs.
SUITE ?= full
.PHONY: robustness
robustness: $(STAMP)
	$(BIN)/python benchmarks/robustness.py --suite $(SUITE) --out benchmarks/results/robustness-$(SUITE)
