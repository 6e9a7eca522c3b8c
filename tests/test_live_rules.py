"""Rules of serving imports that need no MPI job.

- The relay never imports. Python runs every finder with its global import
  lock held, so a rank's import can wait, lock in hand, for its leader's
  relay thread; a first import in that thread would then wait for the lock
  for ever (a hang seen once in thirty runs before the rule). Every module
  the thread's code imports must be in ``relay.NEEDS``, imported before the
  thread starts.
- Nothing the finders, the request path or the runner need is imported
  through the finders: it is in ``finders.SERVING`` (or the live package's
  own), imported before they are installed. With an mpi4py built from
  source, which does not load ``importlib.util`` itself, a finder that
  imported it lazily saw it half-initialized and the job aborted.
"""

import ast
import importlib
import sys
from pathlib import Path

import pytest

from mpistage.runtime import finders
from mpistage.runtime.live import relay

THREAD_MODULES = (
    "bulk",
    "live.relay",
    "live.reader",
    "live.mirror",
    "live.request",
    "extract",
)


def lazy_imports(module):
    """Return the modules imported inside functions of *module*."""
    tree = ast.parse(Path(module.__file__).read_text())
    found = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
    return found


# Loaded on every rank before live imports start: the interpreter's own,
# mpi4py and the runtime package.
LOADED = {
    "_thread",
    "importlib",
    "importlib.machinery",
    "mpi4py",
    "mpistage.runtime",
    "mpistage.runtime.live",
    "os",
    "sys",
}


# Modules of the finders, the request path and the runner, used while serving.
SERVING_MODULES = (
    "bulk",
    "finders",
    "activate",
    "live",
    "live.finder",
    "live.request",
    "live.mirror",
    "runner",
)
# Imported by whoever calls the finder method that imports them:
# find_distributions is called by importlib.metadata, get_resource_reader by
# importlib.resources, and both import pathlib.
CALLER_LOADED = {
    "importlib.abc",
    "importlib.metadata",
    "importlib.resources.abc",
    "importlib.resources.readers",
    "pathlib",
}
# runpy: the runner imports it before the finders come, when the target is -m.
RUNNER = {"runpy"}


@pytest.mark.parametrize("name", SERVING_MODULES)
def test_what_serving_imports_is_imported_before_the_finders_come(name):
    module = importlib.import_module(f"mpistage.runtime.{name}")
    used = {m for m in lazy_imports(module) if not m.startswith("mpistage")}
    ready = set(finders.SERVING) | set(sys.builtin_module_names) | LOADED
    missing = used - ready - CALLER_LOADED - RUNNER
    assert missing == set(), sorted(missing)


def test_no_finder_imports_importlib_util():
    """``importlib.util`` is the module a finder would see half-initialized."""
    for name in SERVING_MODULES + THREAD_MODULES:
        module = importlib.import_module(f"mpistage.runtime.{name}")
        assert "importlib.util" not in lazy_imports(module), name


@pytest.mark.parametrize("name", THREAD_MODULES)
def test_what_the_relay_thread_imports_is_imported_before(name):
    module = importlib.import_module(f"mpistage.runtime.{name}")
    missing = lazy_imports(module) - set(relay.NEEDS) - LOADED
    assert missing == set(), sorted(missing)


def test_the_reader_finds_origin_dirs_of_a_real_extension():
    np = pytest.importorskip("numpy")
    from mpistage.runtime.live import reader

    ext = Path(np._core._multiarray_umath.__file__)
    names, dirs = reader.origin_dirs(ext.read_bytes(), str(ext.parent))
    assert any(n.startswith("libscipy_openblas") for n in names), names
    assert str(ext.parents[1].parent / "numpy.libs") in dirs, dirs


def test_what_is_no_elf_object_needs_nothing():
    from mpistage.runtime.live import reader

    assert reader.origin_dirs(b"#!/bin/sh\n", "/x") == ([], [])
    assert reader.origin_dirs(b"\x7fELF" + bytes(60), "/x") == ([], [])
    assert reader.origin_dirs(b"\x7fELF\x02\x01" + bytes(58), "/x") == ([], [])


def test_origin_entries_of_a_run_path():
    from mpistage.node.elf import expand_origin

    assert expand_origin("$ORIGIN/../x.libs", "/a/b") == "/a/x.libs"
    assert expand_origin("${ORIGIN}/lib", "/a") == "/a/lib"
    assert expand_origin("/usr/lib", "/a") is None


def test_tree_of_leaders():
    assert relay.tree(0, 1) == (None, [])
    assert relay.tree(0, 5) == (None, [1, 2])
    assert relay.tree(1, 5) == (0, [3, 4])
    assert relay.tree(2, 5) == (0, [])
    assert relay.tree(4, 5) == (1, [])
