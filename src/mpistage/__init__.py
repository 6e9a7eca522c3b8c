"""mpistage: fast startup for MPI-parallel Python.

One process reads the shared file system, the bytes travel over MPI to one
leader per node, each node keeps one local copy, and every rank imports from
it. The runner is ``python -m mpistage``; see :mod:`mpistage.launch`.
"""

__version__ = "0.1.0"
