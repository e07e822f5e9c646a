# Two set-up commands: `make demo` and `make test`. Both work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TRACES ?= ../shared/traces
STAMP  := $(VENV)/.installed

.PHONY: demo test lint engine redis clean

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

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
