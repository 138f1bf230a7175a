# The two commands of the README:
#   make lab    set up (or reuse) .venv and open the course in JupyterLab
#   make test   set up (or reuse) .venv and run every test: engine, checkers, notebooks (nbval), browser
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test notebooks bench clean

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): torch (CPU) and the course's packages, about 2 minutes and 1.5 GB the first time"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root,) \
		notebooks/00_launcher_tour.ipynb

test: $(STAMP)
	$(BIN)/python -m pytest

notebooks: $(STAMP)  # re-execute every notebook in place (stored outputs)
	$(BIN)/python scripts/execute_notebooks.py

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py

clean:
	rm -rf $(VENV) test-artifacts notebooks/.measurements
