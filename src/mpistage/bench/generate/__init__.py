"""``mpistage bench generate``: a Pynamic-like workload for start-up benchmarks.

Why: LLNL's Pynamic showed that what makes Python start slowly at scale is
not computation but the file system traffic of importing many modules and
loading many shared libraries. This generator builds such a workload, sized
on the command line, with nothing to download: pure-Python modules, real
CPython C extensions and the shared libraries they link against, data files
read through ``importlib.resources``, and dist-info metadata.

What: ``generate(DIR)`` makes DIR a ``sys.path`` root (like site-packages)::

    DIR/NAME/__init__.py, driver.py
    DIR/NAME/sub00/sub01/.../modNNNN.py        pure-Python modules, spread over
                                               nested subpackages
    DIR/NAME/.../_extNNN<EXT_SUFFIX>           C extensions, each calling one of
    DIR/NAME.libs/libNAME_utilK.so             the utility libraries, found via
                                               an $ORIGIN-relative RPATH (as
                                               auditwheel lays out wheels)
    DIR/NAME/data/dataN.txt                    data files
    DIR/NAME-1.0.dist-info/                    METADATA, RECORD, top_level.txt

``python -m NAME.driver`` (with DIR on ``PYTHONPATH``) imports every module
and extension, calls one function in each, reads every data file and prints a
JSON summary whose ``checksum`` must equal ``expected_checksum``. Modules are
byte-compiled by the generating interpreter, as an installer would, so run
the benchmark with that same interpreter.

One module per job: :mod:`.spec` (the workload's sizes, their defaults and
the error), :mod:`.sources` (the text of every generated file and the value
each returns), :mod:`.native` (compiling the libraries and extensions),
:mod:`.tree` (writing the tree: :func:`generate`) and :mod:`.cli`.
"""

from mpistage.bench.generate.cli import cli_generate
from mpistage.bench.generate.native import find_compiler
from mpistage.bench.generate.spec import GenerateError
from mpistage.bench.generate.tree import generate

__all__ = ["GenerateError", "cli_generate", "find_compiler", "generate"]
