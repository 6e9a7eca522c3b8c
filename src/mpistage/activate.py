"""Step 5 of the runner: every rank imports from its node's staged copy.

Each bundled sys.path root gets its staged copy inserted just ahead of it,
and importlib's caches are dropped, so the next import of a bundled module
finds the staged file first; its ``__file__`` points into the staging root
and C extensions find their ``$ORIGIN``-relative libraries there too. A
module that is not in the bundle still imports from its original location:
correct, only slower, and counted as a miss in the report.
"""

import os as _os
import sys as _sys


class Activation:
    """What activation changed, kept to classify the job's imports later."""

    def __init__(self, root, mapping, before):
        self.root, self.mapping, self.before = root, mapping, before


def activate(root, roots):
    """Put the staged copies of *roots* (original paths) ahead on sys.path."""
    import importlib

    mapping = {path: _os.path.join(root, f"r{i}") for i, path in enumerate(roots)}
    new_path = []
    for entry in _sys.path:
        staged = mapping.get(_os.path.abspath(entry)) if entry else None
        if staged and staged not in new_path:
            new_path.append(staged)
        new_path.append(entry)
    _sys.path[:] = new_path
    importlib.invalidate_caches()
    return Activation(root, mapping, set(_sys.modules))


def stdlib_dirs():
    """Return the directories of the standard library (not site-packages)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({paths["stdlib"] + _os.sep, paths["platstdlib"] + _os.sep})


def classify(activation):
    """Sort modules imported since activation: served, missed, stdlib."""
    served, missed, stdlib = [], [], []
    root, std = activation.root + _os.sep, stdlib_dirs()
    for name, module in list(_sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if name in activation.before or name.partition(".")[0] == "mpistage":
            continue
        if not origin or not _os.path.isabs(origin):
            continue
        if origin.startswith(root):
            served.append(name)
        elif origin.startswith(std) and "-packages" + _os.sep not in origin:
            stdlib.append(name)
        else:
            missed.append(name)
    return {"served": served, "missed": missed, "stdlib": stdlib}
