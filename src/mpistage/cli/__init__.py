"""The ``mpistage`` command: ``pack``, ``record``, ``inspect``, ``stage``,
``clean``, ``bench``, or run a target.

``mpistage pack|inspect|clean ...`` are tools; anything else (``mpistage
app.py``, ``mpistage -m mod``, ``mpistage run ...``) is the runner, exactly
as ``python -m mpistage ...``. User errors print ``mpistage: error: ...``
on one line and exit with status 1.
"""

import sys as _sys

from mpistage.errors import StageError

TOOLS = ("pack", "record", "inspect", "stage", "clean", "bench")


def main(argv=None):
    """Dispatch *argv* (default ``sys.argv[1:]``) to a tool or the runner."""
    argv = list(_sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        argv.pop(0)
    if not argv or argv[0] not in TOOLS:
        from mpistage.launch import main as run

        return run(argv)
    try:
        code = tool(argv[0])(argv[1:])
    except StageError as exc:
        print(f"mpistage: error: {exc}", file=_sys.stderr)
        code = 1
    _sys.exit(code)


def tool(name):
    """Return the entry point of the tool *name*."""
    import importlib

    module = importlib.import_module(f"mpistage.{TOOL_MODULES[name]}")
    return module.cli


TOOL_MODULES = {
    "pack": "pack_cli",
    "record": "record_cli",
    "inspect": "summary",
    "stage": "stage_cli",
    "clean": "clean",
    "bench": "bench.cli",
}
