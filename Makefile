# One entry point. `make lab` and `make test` are the README's two commands: each builds the local
# virtual environment .venv (once) and then opens the workbench or runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU build of torch (pip finds it on disk in our CI image); a machine whose
# python3 already has a CUDA torch >= 2.11 keeps it (the venv then sees the system site packages).
TORCH_SPEC ?= torch==2.13.0
LAB_ARGS ?=
LAB_NOTEBOOK ?= notebooks/00_start_here.ipynb
# JupyterLab refuses to run as root unless told to (containers, CI machines).
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root,)
PYTEST_ARGS ?=
RESULTS ?= results
SUITES ?=

.PHONY: lab test gpu-test bench check clean

$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  echo "keeping the CUDA torch of $(PYTHON)"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install -q -e ".[notebook,test]"
	touch $@

# The repository is the file browser's root (README, docs, tutorials and results beside the notebooks);
# the lab opens on the first notebook, /lab/tree/$(LAB_NOTEBOOK).
lab: $(VENV)/.installed
	$(PY) -m jupyter lab $(ROOT_ARGS) --ServerApp.root_dir="$(CURDIR)" $(LAB_ARGS) $(LAB_NOTEBOOK)

test: $(VENV)/.installed
	$(PY) -m pytest --nbval tests notebooks $(PYTEST_ARGS)

check: $(VENV)/.installed
	$(PY) -m jfa check

# GPU host: no venv (no network there); the TLX bundle puts triton 3.8 + TLX ahead of the host's packages.
gpu-test:
	bash scripts/gpu_test.sh $(RESULTS)

bench:
	OUT=$(RESULTS) bash scripts/bench_gpu.sh $(SUITES)

clean:
	rm -rf $(VENV) .pytest_cache
