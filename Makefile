# The two set-up commands of the README:  `make run`  and  `make test`.
# Each creates or refreshes its own virtual environment in .venv.
SHELL  := bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A pinned torch goes in first: where a CPU build of it sits in pip's find-links it is taken
# from there in seconds; elsewhere pip gets PyPI's build (CUDA on Linux). Override freely,
# e.g. `make run TORCH_SPEC=torch` or a CUDA index URL in PIP_EXTRA_INDEX_URL.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test venv clean mutation gpu-check

$(VENV)/.installed: pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "pdchat needs Python 3.11+")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (first time takes a minute)…"
	@$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" 2>&1 | { grep -v "^WARNING: Location" || true; }
	@$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | { grep -v "^WARNING: Location" || true; }
	@$(PY) -c "import pdchat.engine, pdchat.chatapp" && touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/pdchat $(ARGS)

# Test workers: two fill CI's two cores (files stay whole on one worker, so a module's engine
# is loaded once); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# On a machine with a CUDA GPU: the GPU tests and benchmarks, one report (build/gpu-check/report.md
# and .json). Installs nothing: it runs under the Python that has torch and triton (GPU_PYTHON).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out build/gpu-check $(GPU_CHECK_ARGS)

# Mutation testing of the critical modules (sampler, spec, block manager, scheduler, step cost, server errors):
# tools/mutation.py stages a pdchat/ copy under build/mutation, runs mutmut with one worker and
# writes build/mutation/report.md (docs/mutation.md). Not part of `make test`: 18 minutes on 2 cores
# with MUTATION_ARGS="--workers 2" (measured), longer with the default single worker.
MUTMUT_VERSION ?= 3.8.1
mutation: venv
	@$(PY) -c 'import importlib.metadata as m, sys; sys.exit(m.version("mutmut") != "$(MUTMUT_VERSION)")' 2>/dev/null \
		|| $(PY) -m pip install -q --disable-pip-version-check "mutmut==$(MUTMUT_VERSION)" 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) tools/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
