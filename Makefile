# Two commands for a fresh machine:
#   make demo   the side-by-side demo of the runner (installs what it needs)
#   make test   ruff and the test suite, the launcher tier included (installs
#               what it needs, brings up the Slurm test cluster)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mpistage-installed

# The suite runs as users run Python: bytecode written, output buffered, no
# path of the caller's (a test that wants one sets it).
AS_USERS := env -u PYTHONDONTWRITEBYTECODE -u PYTHONUNBUFFERED -u PYTHONPATH -u PYTHONSAFEPATH

.PHONY: demo test test-fast test-extended lint venv system system-demo launchers clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mpich,test,bench,env,packages]"
	touch $@

# What each target needs from Debian: the demo only fuse3, strace and a C
# compiler; the test suite's launcher tier also Slurm, munge, Open MPI, MPICH.
system-demo:
	./scripts/ensure-system-packages demo

system:
	./scripts/ensure-system-packages launchers

lint: venv
	$(VENV)/bin/ruff check src tests bin
	$(VENV)/bin/ruff format --check src tests bin

# The launcher tier's systems: a two-node Slurm cluster on this machine
# (scripts/slurm-cluster) and two venvs whose mpi4py is built from source
# against Debian's Open MPI and MPICH (scripts/source-venv openmpi|mpich).
# They need root and the Debian packages; without them the tier skips
# itself, with one line.
launchers: venv system
	@if [ "$$(id -u)" -eq 0 ] && command -v slurmd >/dev/null && \
	    command -v mpicc.openmpi >/dev/null; then \
	  ./scripts/slurm-cluster up && ./scripts/source-venv openmpi >/dev/null; fi
	@if [ "$$(id -u)" -eq 0 ] && command -v mpicc.mpich >/dev/null; then \
	  ./scripts/source-venv mpich >/dev/null; fi

test: venv system lint launchers
	$(AS_USERS) $(PY) -m pytest -q

# The whole suite and the extended tier: slower variants of cases the suite
# covers already (h5py in every mode, a Slurm time limit, ...).
test-extended: venv system lint launchers
	$(AS_USERS) $(PY) -m pytest -q --extended

# The quick subset while editing: no tier of real launchers or packages, no
# end-to-end bench or environment runs (a few minutes).
test-fast: venv lint
	$(AS_USERS) $(PY) -m pytest -q -m "not slow and not packages and not launchers"

demo: venv system-demo
	./scripts/demo

clean:
	rm -rf $(VENV) .venv-openmpi .venv-mpich build bench-out .pytest_cache
