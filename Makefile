# The two commands of the README:
#   make lab    set up (or reuse) .venv and open the course in JupyterLab
#   make test   set up (or reuse) .venv and run every test: engine, checkers, notebooks (nbval), browser;
#               each notebook once, the lessons that print computed floats with torch's CPU kernels forced down
#               to the baseline instruction set (another machine's arithmetic; the root conftest.py, CONTRIBUTING.md)
# and for a contributor:
#   make test-baseline-cpu   those lessons (or NOTEBOOKS) forced down, alone
# TESTS and NOTEBOOKS narrow a run: make test TESTS=tests/test_plots.py, make test-baseline-cpu
# NOTEBOOKS=notebooks/03_all_reduce_by_hand.ipynb. Without them, make test is exactly `python -m pytest`.
# Without Chromium the browser test skips itself (it fails under CI=true); to leave it out on purpose:
#   make test TESTS=--deselect=tests/test_browser.py
# TORCH_INDEX_URL: the index torch's wheel comes from, empty by default (PyPI, as CI and the course's machines
# use). A Linux laptop without a GPU gets the CPU-only build (a few hundred MB instead of several GB of CUDA libraries):
#   make lab TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The version is pyproject.toml's one torch pin, installed first from that index; the course's packages follow.
# It acts when the venv is set up: on a fresh machine, or after `make clean`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TESTS ?=
TORCH_INDEX_URL ?=
TORCH_PIN := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
NOTEBOOKS ?=
# ATen's dispatch (no AVX2/AVX-512 kernels), MKL and oneDNN limited to SSE: torch 2.13 reports
# torch.backends.cpu.get_cpu_capability() == "DEFAULT", MKL_VERBOSE "SSE4.2", oneDNN "isa:Intel SSE4.1".
BASELINE_CPU := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41

# Bytecode is compiled the first time a module is imported, once, by whichever process imports it first: uv
# installs without compiling (about 14,000 modules, most never imported: 1-2 minutes less on a fresh machine), and
# a PYTHONDONTWRITEBYTECODE=1 in the environment (some CI images set it) is dropped from make's commands, since with
# it and no compiled files every process would compile torch again (a fresh `import torch` 3 s -> 10 s).
unexport PYTHONDONTWRITEBYTECODE
# rfc3987-syntax is uninstalled after the set-up. It comes with jupyter-events (jsonschema[format-nongpl]); jsonschema
# imports it, when installed, only to check strings of the "iri" format, which nothing here validates, and it builds
# an Earley parser as it is imported: 4-5 s of CPU in every process that imports nbformat (each pytest process,
# nbval, JupyterLab). Without it jsonschema leaves that one format unchecked.

# The packages are installed by uv (pip installs uv into the venv, then uv the rest): the same packages and versions
# as pip chooses, in about 15 s instead of 55 on 2 cores (it downloads and unpacks in parallel). uv reads no pip
# configuration: the folder of wheels pip is told to look in (PIP_FIND_LINKS, or pip.conf's find-links; on the
# course's machines the CPU build of torch lies there) is passed on.
UV_OPTS = --quiet --python $(BIN)/python
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

.PHONY: lab test test-baseline-cpu test-gpu notebooks bench clean site

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): $(TORCH_PIN) from $(or $(TORCH_INDEX_URL),PyPI) and the course's packages, a few minutes the first time"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "uv>=0.5"
	$(if $(TORCH_INDEX_URL),$(BIN)/uv pip install $(UV_OPTS) --index-url "$(TORCH_INDEX_URL)" "$(TORCH_PIN)")
	$(BIN)/uv pip install $(UV_OPTS) $(FIND_LINKS:%=--find-links %) -e ".[test]"
	$(BIN)/uv pip uninstall $(UV_OPTS) rfc3987-syntax
	touch $(STAMP)

# The learner works in my-notebooks/ (git-ignored): scripts/learner_copy.py copies each lesson it lacks with
# outputs cleared and never overwrites one; notebooks/ keeps the stored outputs that nbval checks.
lab: $(STAMP)
	$(BIN)/python scripts/learner_copy.py
	@echo "Lesson 00 of your copy (my-notebooks/) opens in your browser. Without one: open the URL printed below"
	@echo "  with /lab replaced by /lab/tree/my-notebooks/00_launcher_tour.ipynb   (same ?token=...), e.g."
	@echo "  http://127.0.0.1:8888/lab/tree/my-notebooks/00_launcher_tour.ipynb?token=<the token below>"
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root,) \
		my-notebooks/00_launcher_tour.ipynb

# pytest's exit code is make's verdict: any non-zero code (1 failed, 5 collected nothing) fails the target.
test: $(STAMP)
	$(BIN)/python -m pytest $(TESTS)

# `make test` already runs the rule's lessons forced down (conftest.py); this target runs them alone.
# The baseline pass checks the lessons whose checked outputs hold computed floats (a trained loss, an error, a
# ratio): scripts/stored_outputs.py --baseline chooses them by that rule from the stored outputs, so a new lesson is
# classified without anyone listing it; NOTEBOOKS=... names others. The rest print only integers, versions and
# masked timings, which another CPU's arithmetic cannot change.
# `pytest notebooks` does not load tests/conftest.py, which gives every other run a temporary MICRO_DDP_CACHE and
# IPython/Jupyter folders: here the recipe does, so lesson 04 never overwrites the learner's
# ~/.cache/micro-ddp/bandwidth.json and nbval's kernels never read or write ~/.ipython.
test-baseline-cpu: $(STAMP)
	notebooks="$(or $(NOTEBOOKS),$$($(BIN)/python scripts/stored_outputs.py --baseline))" && test -n "$$notebooks" && \
		cache=$$(mktemp -d) && $(BASELINE_CPU) MICRO_DDP_KERNELS=baseline MICRO_DDP_CACHE=$$cache IPYTHONDIR=$$cache/ipython \
		JUPYTER_CONFIG_DIR=$$cache/jupyter JUPYTER_DATA_DIR=$$cache/jupyter JUPYTER_RUNTIME_DIR=$$cache/runtime \
		MPLCONFIGDIR=$$cache/matplotlib $(BIN)/python -m pytest $$notebooks; \
		rc=$$?; rm -rf "$$cache"; exit $$rc

# On a machine with one or more GPUs (and a CUDA build of torch in $(VENV)): scripts/gpu_check.py starts ranks
# with the course's engine on NCCL and on gloo with CUDA tensors (MicroDDP, MicroFSDP, bf16_compress_hook, the
# lessons' NCCL-capable cells), prints a table of what ran and what passed, and fails if a check failed. A few
# minutes on one GPU. Without CUDA it says so and exits 0 (every row skipped). GPU_CHECK_ARGS=--quick skips the
# lessons' cells; GPU_CHECK_ARGS="--lessons 02 11" runs only those lessons' cells.
test-gpu: $(STAMP)
	$(BIN)/python scripts/gpu_check.py $(GPU_CHECK_ARGS)

notebooks: $(STAMP)  # re-execute every notebook in place (stored outputs)
	$(BIN)/python scripts/execute_notebooks.py

# The course as a static site: every lesson with its stored outputs (never executed), README as the home page,
# CONTRIBUTING, a launch link per lesson (docs/conf.py says how). Warnings are errors and every link must resolve.
# SITE (git-ignored docs/_build/html by default) is what .github/workflows/pages.yml publishes; about 20 s on
# 2 cores. tests/test_site.py runs this target into a temporary folder.
SITE ?= docs/_build/html
SITE_DOCTREES ?= $(dir $(patsubst %/,%,$(SITE)))doctrees
site: $(STAMP)
	$(BIN)/python -m sphinx -b html -W --keep-going -n -q -c docs -d $(SITE_DOCTREES) . $(SITE)
	@echo "The site is in $(SITE)/: open $(SITE)/index.html"

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py

clean:
	rm -rf $(VENV) test-artifacts
