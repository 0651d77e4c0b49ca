# `make lab`: JupyterLab on the notebooks in smoke mode. `make run`: every notebook in smoke mode through papermill, with a summary.
# `make test`: the test suite. `make docs`: the docs site in docs/_build/html (DOCS_EXECUTE=1: with the
# notebooks executed in smoke mode). All create or update the virtualenv first.
SHELL := /bin/bash
# The project's folder, wherever make runs from (`make -f path/to/Makefile clean` included).
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))

ifneq ($(CURDIR),$(ROOT))
# Run from another folder (`make -f <project>/Makefile job`): every target runs in the project's folder, so
# that no path it uses (.venv, requirements.txt, cluster.env, which is shell code) is ever the caller's.
_FORWARDED := $(or $(MAKECMDGOALS),_default)
.PHONY: $(_FORWARDED)
$(_FORWARDED):
	@$(MAKE) --no-print-directory -C "$(ROOT)" $(MAKECMDGOALS)
else
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

# DeepSpeed compiles its CPU ops (CPU Adam, shared-memory collectives: 75 s on 2 cores) on first use into
# torch's extension cache: `make install` builds the shared-memory one (every DeepSpeed run on CPU loads
# it), `make test` the rest at idle priority as it starts (by hand: `.venv/bin/python
# ci/build_deepspeed_ops.py`). One cache per virtualenv: with the default (~/.cache/torch_extensions,
# shared by every virtualenv of the user) two checkouts recompile each other's ops, the paths in the build
# differing.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

# Tests run in a network namespace with only loopback where the kernel allows it (root, or
# unprivileged user namespaces): outbound connections are impossible there.
NETNS := $(shell unshare -n true >/dev/null 2>&1 && echo "unshare -n ci/with-loopback.sh" || \
           (unshare -rn true >/dev/null 2>&1 && echo "unshare -rn ci/with-loopback.sh"))

# The docs test opens the site in Debian's chromium (playwright drives it; it never downloads a browser).
# A missing one is installed with apt-get where that can be done (as root, or with sudo that asks no
# password). Where it cannot, make says so and the browser tests are skipped (the reason is in pytest's
# summary), except under CI=true, where a missing browser fails the run.
CHROMIUM ?= /usr/bin/chromium
# where Debian's chromium package puts it: only that path is installed
CHROMIUM_APT := /usr/bin/chromium
IN_CI := $(filter true True TRUE 1 yes Yes YES,$(CI))
DOCS_OUT := docs/_build/html
SPHINX_OPTS := -W --keep-going -E -b html  # warnings are errors (all reported), fresh environment
# DOCS_EXECUTE is on unless unset or 0/false/no (as docs/conf.py reads it)
DOCS_EXECUTED := $(filter-out 0 false False FALSE no No NO,$(DOCS_EXECUTE))

.PHONY: install lab run test docs lint clean plan cluster-up cluster-down cluster-kill-node cluster-add-node cluster-pause-storage job

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python requirements.txt requirements-dev.txt requirements-docs.txt pyproject.toml
	$(BIN)/python -m pip install --upgrade --quiet pip
	@# pip byte-compiles what it installs one file at a time (47 s of 91 s here); compileall below does it
	@# on every core (34 s). Compiled here because where PYTHONDONTWRITEBYTECODE is set, Python never writes
	@# .pyc files itself: every run would compile every import from source.
	$(BIN)/python -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-compile -r requirements-dev.txt -r requirements-docs.txt
	@# jsonschema imports rfc3987-syntax whenever it is installed (jupyter-events pulls it in, only to
	@# check URI formats), and that import builds a parser: 1.6 s in every process that imports ray.
	@# Measured here: ray.init 15 s -> 6 s, an empty 2-worker TorchTrainer.fit() 34 s -> 18 s without it.
	$(BIN)/python -m pip uninstall --quiet --yes rfc3987-syntax
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@# (-qq, and no failure: a few files are test data for other Pythons; pip skips those too)
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (ray-llm-notebooks)" >/dev/null
	@# DeepSpeed's shared-memory collectives op, which every DeepSpeed run on CPU loads: built now, at low
	@# priority (29-32 s of both cores here), not in the middle of a learner's first GPT-2 run (+50 s there).
	nice -n 19 $(BIN)/python ci/build_deepspeed_ops.py ShareMemCommBuilder
	touch $(STAMP)

install: $(STAMP)

# Every notebook on one local Ray (a node with token auth, started before the first and stopped after the
# last, by its process ids), or on the cluster at RAY_ADDRESS where one is set.
# CLUSTER=1: every notebook on a two-node Ray with checkpoints in an S3 bucket (ci/local_cluster.py), started
# before and stopped after, also when a notebook fails; all inside the loopback-only network namespace.
# NOTEBOOK=llama_fsdp (or a comma-separated list): only those notebooks. Prints each notebook's sections and
# training lines as they come; writes runs/<timestamp>/ with summary.html (see ci/run_notebooks.py).
RUN_ARGS = $(if $(NOTEBOOK),--notebook "$(NOTEBOOK)")
run: install
ifneq ($(filter-out 0 false no,$(CLUSTER)),)
	$(NETNS) $(BIN)/python -m ci.run_notebooks --cluster $(RUN_ARGS)
else
	$(BIN)/python -m ci.run_notebooks $(RUN_ARGS)
endif

# JupyterLab on the notebooks in smoke mode (SMOKE_TEST=1: each notebook's Set up cell swaps in a tiny model
# and fixtures), on 127.0.0.1 with JupyterLab's token. JUPYTER_ARGS passes more, e.g. --no-browser.
lab: install
	SMOKE_TEST=1 $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=notebooks \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(JUPYTER_ARGS)

# Two Ray nodes (token authentication on) and an S3 server with a bucket; writes cluster.env. By hand:
#   make cluster-up && source cluster.env && papermill notebooks/X.ipynb out.ipynb -p SMOKE_TEST True ...
cluster-up: install
	$(BIN)/python -m ci.local_cluster up

# Stops exactly the processes cluster-up started (never `ray stop`, which stops every Ray on the machine).
cluster-down:
	$(BIN)/python -m ci.local_cluster down

# A node lost as a reclaimed instance is: SIGKILL to the second node's raylet and every process it started.
cluster-kill-node:
	$(BIN)/python -m ci.local_cluster kill-node

# A new second node, joining the same head with the same credentials (after cluster-kill-node).
cluster-add-node:
	$(BIN)/python -m ci.local_cluster add-node

# A notebook as a Ray Job (ci/submit_job.py): on the cluster the shell names (RAY_API_SERVER_ADDRESS, with
# STORAGE_PATH and MLFLOW_TRACKING_URI) at the notebook's full-scale values, or, where the shell names none, on
# the local cluster of `make cluster-up` (its cluster.env) in smoke mode; ARGS changes either:
# make job NOTEBOOK=glue_text_classification ARGS="-p TASK stsb". The project's files are the job's working_dir
# (helpers shipped with it); the executed notebook goes to $STORAGE_PATH/jobs/<job id>/.
# NOTEBOOK and ARGS reach the script through the environment, never pasted into the shell line.
job: export NOTEBOOK := $(NOTEBOOK)
job: export ARGS := $(ARGS)
job: install
	@test -n "$$NOTEBOOK" || { echo "NOTEBOOK=<name> is required, e.g. make job NOTEBOOK=glue_text_classification"; exit 1; }
	@if [ -z "$$RAY_API_SERVER_ADDRESS$$RAY_ADDRESS" ]; then \
	  test -f "$(ROOT)/cluster.env" || { echo "No cluster: set RAY_ADDRESS (or RAY_API_SERVER_ADDRESS) and STORAGE_PATH for yours, or start the local one (make cluster-up)."; exit 1; }; \
	  . "$(ROOT)/cluster.env"; \
	fi; \
	"$(ROOT)/$(BIN)/python" -m ci.submit_job --from-environment

# A notebook's "will it fit?" plan for its full-scale values, offline, without running it (ci/plan.py):
# make plan NOTEBOOK=llama_fsdp ARGS="-p NUM_WORKERS 8". Exits 2 where the run would not fit.
# NOTEBOOK and ARGS reach the script through the environment, never pasted into the shell line.
plan: export NOTEBOOK := $(NOTEBOOK)
plan: export ARGS := $(ARGS)
plan: install
	@$(BIN)/python -m ci.plan --from-environment

# Storage that stalls: the bucket answers nothing for SECONDS (the S3 server paused, then resumed).
SECONDS ?= 25
cluster-pause-storage:
	$(BIN)/python -m ci.local_cluster pause-storage --seconds $(SECONDS)

$(CHROMIUM):
	@as_root=; \
	if [ "$(CHROMIUM)" = "$(CHROMIUM_APT)" ] && command -v apt-get >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then as_root=env; elif sudo -n true 2>/dev/null; then as_root="sudo env"; fi; \
	fi; \
	if [ -n "$$as_root" ]; then \
	  echo "Installing Debian's chromium for the docs tests (apt-get install chromium)"; \
	  $$as_root apt-get update -qq && \
	  $$as_root DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	fi; \
	if [ ! -e "$(CHROMIUM)" ]; then \
	  if [ -n "$$as_root" ]; then why="apt-get could not install chromium"; \
	  elif [ "$(CHROMIUM)" != "$(CHROMIUM_APT)" ]; then why="not where Debian's chromium package would put it"; \
	  elif ! command -v apt-get >/dev/null; then why="no apt-get to install it with"; \
	  else why="installing it needs root or sudo without a password"; fi; \
	  if [ -n "$(IN_CI)" ]; then \
	    echo "No Chromium at $(CHROMIUM) ($$why). CI=$(CI): the browser tests must run; install Chromium and set CHROMIUM=/path/to/it."; \
	    exit 1; \
	  fi; \
	  echo "No Chromium at $(CHROMIUM) ($$why): the docs' browser tests will be SKIPPED. Install Chromium and set CHROMIUM=/path/to/it to run them."; \
	fi

test: install $(CHROMIUM)
	@echo "network isolation: $(if $(NETNS),$(NETNS),none available - offline guard and env vars only)"
	CHROMIUM=$(CHROMIUM) $(NETNS) $(BIN)/python -m pytest

# DOCS_EXECUTE=1 runs every notebook in smoke mode during the build (about 6 minutes on 2 cores), then
# checks the executed pages in the browser (each shows a plot and says it comes from the smoke run); as in
# `make test`, those checks are skipped where there is no Chromium and none can be installed, unless CI=true.
docs: install $(if $(DOCS_EXECUTED),$(CHROMIUM))
	$(NETNS) $(BIN)/python -m sphinx $(SPHINX_OPTS) docs $(DOCS_OUT)
	@echo "Site: $(DOCS_OUT)/index.html"
ifneq ($(DOCS_EXECUTED),)
	DOCS_SITE=$(DOCS_OUT) CHROMIUM=$(CHROMIUM) $(NETNS) $(BIN)/python -m pytest tests/test_docs.py -m docs_executed
endif

lint: install
	$(BIN)/ruff check basics harness helpers tests ci notebooks docs/conf.py
	$(BIN)/ruff format --check basics harness helpers tests ci notebooks docs/conf.py

# Every path is the project's (never the current folder's); refused while a local cluster runs from .venv.
clean:
	@if [ -x "$(ROOT)/$(BIN)/python" ]; then "$(ROOT)/$(BIN)/python" -m ci.local_cluster idle; fi
	rm -rf "$(ROOT)/$(VENV)" "$(ROOT)/runs" "$(ROOT)/test-artifacts" "$(ROOT)/.cache" "$(ROOT)/docs/_build"

endif
