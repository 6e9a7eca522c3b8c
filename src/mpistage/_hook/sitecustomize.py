"""Started in Python processes that mpistage launches or that a job starts.

The directory of this module goes first on ``PYTHONPATH`` in two cases:

- ``mpistage record`` (``MPISTAGE_RECORD_DIR``): every Python process of
  the recorded command starts a recorder that writes its usage there at exit;
- child processes of a staged job (``MPISTAGE_CHILD``: the node's plan):
  ``subprocess`` and ``multiprocessing`` children import from the node's
  staged copy for the life of the job.

It takes itself back off ``sys.path``, does its part, and then runs the
user's own ``sitecustomize``, if there is one.
"""

import os
import sys


def _start():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        from mpistage.settings import get
    except ImportError:  # mpistage is not importable here: nothing to do
        get = dict().get
    folder = get("MPISTAGE_RECORD_DIR")
    if folder:
        from mpistage.runtime.auto import start_child

        start_child(folder)
    plan = get("MPISTAGE_CHILD")
    if plan:
        _activate(plan)
    _run_users_sitecustomize()


def _activate(plan):
    """Serve this child's imports from the node's copy; go on without it if gone."""
    try:
        from mpistage.runtime.activate import activate_child

        activate_child(plan)
    except Exception as exc:  # the child still runs, from the originals
        print(f"mpistage: warning: not staged in this child: {exc}", file=sys.stderr)


def _run_users_sitecustomize():
    """Run the next ``sitecustomize`` on sys.path, as if it had been imported."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    spec = PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None:
        module = module_from_spec(spec)
        # The import system hands back whatever this name maps to when this
        # module finishes, so the user's module takes our place.
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_start()
