# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch when no torch is present
# (an unpinned torch would pull a multi-GB CUDA build), then this package.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hf-mhc-installed
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test test-other-cpu lint docs install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_CPU)"
	$(PY) -m pip install -e ".[dev,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py --overwrite

# pytest and ruff run from the venv, not `python -m`, which would put the repo root on sys.path
# and let the top-level kernels/ folder shadow the `kernels` package that transformers imports.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) docs
	$(VENV)/bin/pytest -q

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on any warning (a broken link or anchor, a
# docstring mkdocstrings cannot read). NO_MKDOCS_2_WARNING silences mkdocs-material's banner about MkDocs 2.0.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The suite on other CPU kernels of this machine: MKL's SSE4.2 path and torch's AVX2 kernels, as another x86 CPU would
# take them (tolerances must hold on any of them).
test-other-cpu: $(STAMP)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=avx2 $(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
