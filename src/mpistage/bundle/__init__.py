"""Making and reading bundles off-line: pack, record, inspect.

Nothing here runs in the ranks of a job at start-up (``record``'s recorder
runs inside recorded programs, and in ``--auto`` learning runs, whose rank
0 builds its bundle here once the program is done).
:mod:`~mpistage.bundle.writer` is the one bundle writer; ``pack``, ``record``
and ``envpack`` choose what goes in and feed it.
"""
