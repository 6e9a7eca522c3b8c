# Two commands for a fresh machine:
#   make demo   the side-by-side demo of the runner (installs what it needs)
#   make test   ruff and the test suite (installs what it needs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mpistage-installed

.PHONY: demo test lint venv system clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mpich,test,bench,env,packages]"
	touch $@

system:
	./scripts/ensure-system-packages

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

test: venv system lint
	$(PY) -m pytest -q

demo: venv system
	./scripts/demo

clean:
	rm -rf $(VENV) build bench-out .pytest_cache
