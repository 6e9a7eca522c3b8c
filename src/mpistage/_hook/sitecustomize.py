"""Started in every Python process of ``mpistage record``'s command.

``mpistage record`` puts this directory first on ``PYTHONPATH``; this module
takes itself back off ``sys.path``, starts a recorder that writes the
process's usage to ``$MPISTAGE_RECORD_DIR`` at exit, and then runs the
user's own ``sitecustomize``, if there is one.
"""

import os
import sys


def _start():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    folder = os.environ.get("MPISTAGE_RECORD_DIR")
    if folder:
        from mpistage.bundle.record import start_child

        start_child(folder)
    _run_users_sitecustomize()


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
