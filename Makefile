# `make run`: every notebook in smoke mode through papermill, with a summary.
# `make test`: the test suite. Both create or update the virtualenv first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# No GPU: the CPU build of torch (on the project's machines `torch==2.13.0` resolves to a local
# CPU wheel; elsewhere pip takes what the index gives). GPU machines: the index's CUDA build.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch>=2.9,<2.15
else
TORCH_SPEC ?= torch==2.13.0
endif

# Tests run in a network namespace with only loopback where the kernel allows it (root, or
# unprivileged user namespaces): outbound connections are impossible there.
NETNS := $(shell unshare -n true >/dev/null 2>&1 && echo "unshare -n ci/with-loopback.sh" || \
           (unshare -rn true >/dev/null 2>&1 && echo "unshare -rn ci/with-loopback.sh"))

.PHONY: install run test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python requirements.txt pyproject.toml
	$(BIN)/python -m pip install --upgrade --quiet pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -r requirements.txt
	@# jsonschema imports rfc3987-syntax whenever it is installed (jupyter-events pulls it in, only to
	@# check URI formats), and that import builds a parser: 1.6 s in every process that imports ray.
	@# Measured here: ray.init 15 s -> 6 s, an empty 2-worker TorchTrainer.fit() 34 s -> 18 s without it.
	$(BIN)/python -m pip uninstall --quiet --yes rfc3987-syntax
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (ray-llm-notebooks)" >/dev/null
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python ci/run_notebooks.py

test: install
	@echo "network isolation: $(if $(NETNS),$(NETNS),none available - offline guard and env vars only)"
	$(NETNS) $(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check helpers tests ci notebooks
	$(BIN)/ruff format --check helpers tests ci notebooks

clean:
	rm -rf $(VENV) runs test-artifacts .cache
