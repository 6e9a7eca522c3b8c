"""Step 7: run the target, ``app.py``, ``-m mod`` or ``-c code``, as plain python does.

What the program finds must be what plain ``python`` leaves: ``sys.argv``,
``sys.path[0]``, ``__main__`` and ``sys.modules`` (a script is compiled
and run here, not by ``runpy.run_path``, which imports ``pkgutil`` and
more first). The runner (:mod:`~mpistage.runtime.runner`) calls
:func:`run_command_line` once the node's copy is active.
"""

import os as _os
import sys as _sys

from mpistage import read_fd


def run_command_line(args):
    """Run ``app.py | -m mod | -c code`` with *args* as ``sys.argv``."""
    _sys.argv[:] = args
    if args[0] == "-c":
        _sys.path[0] = ""  # as plain python: the directory current at each import
        code = compile(_sys.argv.pop(1), "<string>", "exec", 0, True)
        run_main(code, None)
    elif args[0] == "-m":
        import runpy  # imported before the finders came (see import_runpy)

        del _sys.argv[0]
        runpy.run_module(_sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        _sys.path[0] = _os.path.realpath(_os.path.dirname(args[0]))
        run_script(args[0])


def import_runpy(args):
    """Import ``runpy`` now if the target needs it: before any finder is in place.

    ``runpy`` imports ``importlib.util``, which a finder of mpistage would
    otherwise see half-initialized. Scripts and ``-c`` code run without it,
    as with plain python, which leaves no ``runpy`` in ``sys.modules``.
    """
    if args[0] == "-m":
        import runpy  # noqa: F401


def run_script(path):
    """Run the script *path* as ``__main__``, as plain ``python app.py`` does.

    A source file is compiled and run here: ``runpy.run_path`` imports
    ``pkgutil`` (and with it ``typing`` and ``weakref``) first, which plain
    ``python app.py`` does not, and the program must find in ``sys.modules``
    what plain python leaves there. Compiled files, directories and zip
    files go to ``run_path``.
    """
    from mpistage.runtime.finders import MAGIC_NUMBER

    source = read_script(path)
    if source is None or source[:4] == MAGIC_NUMBER or is_zip(source):
        import runpy

        runpy.run_path(path, run_name="__main__")
        return
    run_main(compile(source, path, "exec", dont_inherit=True), path)


def read_script(path):
    """The bytes of the file *path*, read for its size; ``None`` if not a file."""
    try:
        fd = _os.open(path, _os.O_RDONLY | _os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return read_fd(fd, _os.fstat(fd).st_size)
    except OSError:
        return None  # A directory: ``runpy`` runs it as plain python does.
    finally:
        _os.close(fd)


def run_main(code, path):
    """Run *code* as the module ``__main__`` (of the file *path*, if any).

    As ``runpy`` does it: a fresh module stands in ``sys.modules`` while the
    code runs, and ``sys.argv[0]`` names the file.
    """
    main = type(_sys)("__main__")
    main.__dict__.update(__loader__=None, __package__=None, __spec__=None)
    if path is not None:
        main.__dict__.update(__file__=path, __cached__=None)
    saved, argv0 = _sys.modules.get("__main__"), _sys.argv[0]
    _sys.modules["__main__"] = main
    _sys.argv[0] = path or "-c"
    try:
        exec(code, main.__dict__)
    finally:
        _sys.argv[0] = argv0
        if saved is None:
            del _sys.modules["__main__"]
        else:
            _sys.modules["__main__"] = saved


def is_zip(data):
    """Whether *data* is a zip archive (``zipapp``'s, perhaps after a ``#!`` line).

    Its end-of-directory record lies in the last 64 KiB and 22 bytes.
    """
    return b"PK\x05\x06" in data[-(1 << 16) - 22 :]
