# Each target sets itself up on a fresh machine: a virtual environment with the CPU build of
# torch (pinned: an unpinned torch pulls a CUDA build of several GB), then fxfuse editable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# Where the CPU build comes from: this project's machines find it locally (pip's find-links);
# elsewhere: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: setup test demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# CPU tests: generated kernels run under the Triton interpreter (tests/conftest.py sets it).
test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest tests

# The main job: optimize the seed network, check it against eager, print explain().
demo: setup
	$(PY) -m fxfuse.demo

bench: setup
	$(PY) -m benchmarks.mlp --quick --out .out/bench   # .out/ is git-ignored: a smoke run adds no results

clean:
	rm -rf $(VENV) .pytest_cache
