"""Learn what a program uses, and turn that into a bundle.

A :class:`Recorder` runs inside the program. An audit hook notes every file
it opens for reading (``open``, ``importlib.resources``,
``importlib.metadata``, ``get_data``), every directory it lists, and every
library ``ctypes`` loads; at the end, the modules in ``sys.modules`` and the
files mapped into the process (``/proc/self/maps``: extension modules and
the shared libraries they link) are added. Paths are normalized, so a data
file reached as ``pkg/../data/x`` counts as ``data/x``.

:func:`build` groups the used files by sys.path root and writes a bundle:

- ``package`` granularity takes whole top-level packages, with their
  distribution metadata and ``.libs`` directories, so that a submodule that
  only some ranks import later is present too;
- ``file`` granularity takes only the files that were used, plus every
  entry of the directories the program listed, so ``os.listdir`` and
  ``importlib.resources`` ``iterdir`` see what they saw before.

The standard library modules the program used are taken too (unless
``stdlib=False``), and every sys.path directory is recorded with its
listing. mpistage itself is left out. Top-level ``.pth`` files of each used
root are always taken: the interpreter reads them before any recorder can
start.
"""

import os as _os
import sys as _sys

from mpistage import StageError

GRANULARITIES = ("package", "file")
_EVENTS = ("open", "ctypes.dlopen", "os.listdir", "os.scandir")


class Recorder:
    """Notes the files this process uses; see the module docstring."""

    def __init__(self):
        self.paths, self.listed = set(), set()
        self.active = True
        # Loaded before any runner can act (.pth hooks, the runner itself):
        # staging them would not help, so they are not recorded.
        self.preloaded = set(_sys.modules)
        _sys.addaudithook(self.hook)

    def hook(self, event, args):
        """Audit hook: remember paths opened for reading, listed or dlopened."""
        if not self.active or event not in _EVENTS:
            return
        if event == "open" and writes(args):
            return
        path = args[0] if args else None
        if isinstance(path, bytes):
            path = _os.fsdecode(path)
        if not isinstance(path, str) or (
            event == "ctypes.dlopen" and _os.sep not in path
        ):
            return
        if event.startswith("os.") and by_import_system():
            return
        path = _os.path.normpath(_os.path.abspath(path))
        (self.listed if event.startswith("os.") else self.paths).add(path)

    def usage(self):
        """Stop recording; return what was used, as JSON-ready data."""
        from mpistage.runtime.bundlefile import python_tag

        self.active = False
        paths = self.paths | module_files(self.preloaded) | mapped_files()
        entries = [_os.path.abspath(p or ".") for p in _sys.path]
        entries += finder_roots(entries)
        return {
            "python": python_tag(),
            "sys_path": entries,
            "files": sorted(paths),
            "listed": sorted(self.listed),
        }


def by_import_system():
    """Whether the audited call came from the import system (its own listings)."""
    try:
        frame = _sys._getframe(2)
    except ValueError:
        return False
    return frame.f_code.co_filename.startswith("<frozen importlib")


def finder_roots(entries):
    """Return the roots of top-level modules found off ``sys.path``.

    A finder-based editable install (PEP 660) maps a package to its source
    tree without putting that tree on ``sys.path``; the tree's parent is a
    root all the same.
    """
    found = set()
    prefixes = tuple(e + _os.sep for e in entries)
    for name, module in list(_sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if "." in name or not origin or not _os.path.isabs(origin):
            continue
        if origin.startswith(prefixes) or not _os.path.isfile(origin):
            continue
        is_package = _os.path.basename(origin).startswith("__init__.")
        top = _os.path.dirname(origin)
        found.add(_os.path.dirname(top) if is_package else top)
    return sorted(found)


def writes(args):
    """Whether an ``open`` audit event's (path, mode, flags) opens for writing."""
    _, mode, flags = args
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & (_os.O_WRONLY | _os.O_RDWR))


def module_files(skip=()):
    """Return the source, bytecode and extension files of loaded modules."""
    found = set()
    for name, module in list(_sys.modules.items()):
        if name in skip:
            continue
        spec = getattr(module, "__spec__", None)
        for path in (getattr(spec, "origin", None), getattr(spec, "cached", None)):
            if path and _os.path.isabs(path) and _os.path.isfile(path):
                found.add(_os.path.normpath(path))
    return found


def mapped_files():
    """Return the files mapped into this process (shared libraries)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    found.add(fields[5].strip())
    except OSError:
        pass
    return found


def usable_roots(usages, stdlib):
    """Return the sys.path directories of *usages*, deepest first."""
    from mpistage.runtime.roots import in_stdlib

    roots = {p for u in usages for p in u["sys_path"] if _os.path.isdir(p)}
    keep = [r for r in roots if stdlib or not in_stdlib(r)]
    return sorted(keep, key=len, reverse=True)


def choose(selection, path, roots, granularity, done):
    """Add the member(s) that a use of *path* calls for.

    *done* holds the (root, name) packages already added whole.
    """
    from mpistage.bundle.pack import add_top
    from mpistage.runtime.roots import METADATA_SUFFIXES, root_of, top_name

    found = root_of(path, roots)
    if found is None or not _os.path.exists(path):
        return
    root, top, rel = found
    is_dir = "/" in rel or _os.path.isdir(_os.path.join(root, top))
    name = top_name(top, is_dir)
    if name == "mpistage" or top == "mpistage.pth":
        return
    if granularity == "file" or (name is None and top == "__pycache__"):
        selection.take(root, path)
    elif top.endswith(METADATA_SUFFIXES + (".libs",)):
        selection.take(root, _os.path.join(root, top))
    elif name is not None:
        if (root, name) not in done:
            done.add((root, name))
            add_top(selection, root, name, top_locations(root, name))
    else:
        selection.take(root, path)


def top_locations(root, name):
    """Return the entries of *root* that make up the top-level module *name*."""
    from mpistage.runtime.roots import top_name

    entries = []
    with _os.scandir(root) as found:
        for entry in found:
            if top_name(entry.name, entry.is_dir()) == name:
                entries.append(entry.path)
    cache = _os.path.join(root, "__pycache__")
    if _os.path.isdir(cache):
        for entry in _os.listdir(cache):
            if entry.split(".", 1)[0] == name:
                entries.append(_os.path.join(cache, entry))
    return entries


def take_listed(selection, usages, roots):
    """File granularity: take the direct entries of every directory listed."""
    from mpistage.runtime.roots import root_of

    for folder in sorted({p for u in usages for p in u.get("listed", [])}):
        found = root_of(folder, roots)
        if found and _os.path.isdir(folder) and found[1] != "mpistage":
            for entry in _os.listdir(folder):
                path = _os.path.join(folder, entry)
                if not _os.path.isdir(path):
                    selection.take(found[0], path)


def build(
    output, usages, granularity="package", created_by="record", extra=None, stdlib=True
):
    """Write the bundle of what *usages* used; return its manifest."""
    from mpistage.bundle.pack import TEST_DIRS
    from mpistage.bundle.writer import Selection, write

    check_same_python(usages)
    roots, selection, done = usable_roots(usages, stdlib), Selection(TEST_DIRS), set()
    used = sorted({p for u in usages for p in u["files"]})
    for path in used:
        choose(selection, path, roots, granularity, done)
    keep_used_tests(selection, used, roots)
    if granularity == "file":
        take_listed(selection, usages, roots)
    if not selection.paths:
        raise StageError("the program used no files outside the standard library")
    for root in list(selection.paths):
        for entry in _os.listdir(root):
            if entry.endswith(".pth"):
                selection.take(root, _os.path.join(root, entry))
    for root in roots:
        selection.index(root)
    names = sorted({n for r in selection.paths for n in tops(selection, r)})
    info = dict(extra or {}, granularity=granularity)
    fields = {"created_by": created_by, "packages": names, "recorded": info}
    fields["python"] = usages[0]["python"]
    return write(output, selection, fields)


def keep_used_tests(selection, used, roots):
    """Take back the files of test directories that the program did use."""
    from mpistage.runtime.roots import root_of

    for path in used:
        found = root_of(path, roots)
        if found and selection.excluded(found[2]) and _os.path.isfile(path):
            selection.files[selection.paths[selection.index(found[0])]].add(path)


def tops(selection, root):
    """Return the top-level module names *selection* takes from *root*."""
    from mpistage.runtime.roots import top_name

    for path in selection.files[root]:
        rel = _os.path.relpath(path, root)
        first, sep, _ = rel.partition(_os.sep)
        name = top_name(first, bool(sep) or _os.path.isdir(path))
        if name:
            yield name


def check_same_python(usages):
    """Refuse usages recorded by different Pythons."""
    if not usages:
        raise StageError("no Python process was recorded")
    tags = {tuple(sorted(u["python"].items())) for u in usages}
    if len(tags) > 1:
        raise StageError("the recorded processes ran different Pythons")


def start_child(folder):
    """Record this process; write its usage to *folder* at exit."""
    import atexit

    recorder = Recorder()
    atexit.register(save_usage, recorder, folder)
    return recorder


def save_usage(recorder, folder):
    """Write *recorder*'s usage as ``usage.<pid>.json`` in *folder*.

    It runs at the program's exit: its ``json`` may be the program's own.
    """
    from mpistage import lend, own_module

    json = own_module("json")

    path = _os.path.join(folder, f"usage.{_os.getpid()}.json")
    usage = recorder.usage()
    with open(path + ".tmp", "w") as f, lend("json"):
        json.dump(usage, f)
    _os.replace(path + ".tmp", path)


def record(output, command, granularity="package", stdlib=True):
    """Run *command* with a recorder in each Python process; write the bundle."""
    if not command:
        raise StageError("no command to record: mpistage record -o X -- python app.py")
    if granularity not in GRANULARITIES:
        raise StageError(f"granularity {granularity!r}: use package or file")
    status, usages = record_command(command)
    if status != 0:
        raise StageError(
            f"the recorded command exited with status {status}; no bundle written"
        )
    if not usages:
        raise StageError(
            "no Python process was recorded: run a Python program "
            "of this environment (python app.py)"
        )
    extra = {"command": list(command), "processes": len(usages)}
    return build(output, usages, granularity, "record", extra, stdlib)


def record_command(command):
    """Run *command* with recorders; return (exit status, usages)."""
    import glob
    import json
    import subprocess
    import tempfile

    hook = _os.path.join(
        _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "_hook"
    )
    with tempfile.TemporaryDirectory(prefix="mpistage-record-") as folder:
        env = dict(_os.environ, MPISTAGE_RECORD_DIR=folder)
        env["PYTHONPATH"] = _os.pathsep.join(
            p for p in (hook, _os.environ.get("PYTHONPATH")) if p
        )
        try:
            status = subprocess.call(command, env=env)
        except OSError as exc:
            raise StageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
        usages = []
        for path in sorted(glob.glob(_os.path.join(folder, "usage.*.json"))):
            with open(path) as f:
                usages.append(json.load(f))
    return status, usages
