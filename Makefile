# The two commands of the README:
#   make lab    set up (or reuse) .venv and open the course in JupyterLab
#   make test   set up (or reuse) .venv and run every test: engine, checkers, notebooks (nbval), browser
# and what CI (.ci/run) adds:
#   make test-baseline-cpu   the notebooks under nbval again, with torch's CPU kernels forced down to the
#                            baseline instruction set (another machine's arithmetic; see CONTRIBUTING.md)
# TESTS and NOTEBOOKS narrow a run: make test TESTS=tests/test_plots.py, make test-baseline-cpu
# NOTEBOOKS=notebooks/03_all_reduce_by_hand.ipynb. Without them, make test is exactly `python -m pytest`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TESTS ?=
NOTEBOOKS ?= notebooks
# ATen's dispatch (no AVX2/AVX-512 kernels), MKL and oneDNN limited to SSE: torch 2.13 reports
# torch.backends.cpu.get_cpu_capability() == "DEFAULT", MKL_VERBOSE "SSE4.2", oneDNN "isa:Intel SSE4.1".
BASELINE_CPU := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41

.PHONY: lab test test-baseline-cpu notebooks bench clean

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): torch (CPU) and the course's packages, about 2 minutes and 1.5 GB the first time"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root,) \
		notebooks/00_launcher_tour.ipynb

# pytest's exit code is make's verdict: any non-zero code (1 failed, 5 collected nothing) fails the target.
test: $(STAMP)
	$(BIN)/python -m pytest $(TESTS)

test-baseline-cpu: $(STAMP)
	$(BASELINE_CPU) $(BIN)/python -m pytest $(NOTEBOOKS)

notebooks: $(STAMP)  # re-execute every notebook in place (stored outputs)
	$(BIN)/python scripts/execute_notebooks.py

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py

clean:
	rm -rf $(VENV) test-artifacts
