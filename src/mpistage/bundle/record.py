"""Learn what a program uses, and turn that into a bundle.

A recorder (:class:`mpistage.runtime.auto.Recorder`) runs inside each
Python process of the recorded command, as it does in every rank of an
``--auto`` learning run, and writes what the process used (its *usage*).

:func:`build` groups the used files by sys.path root and writes a bundle:

- ``package`` granularity takes whole top-level packages, with their
  distribution metadata and ``.libs`` directories, so that a submodule that
  only some ranks import later is present too;
- ``file`` granularity takes only the files that were used, plus every
  entry of the directories the program listed, so ``os.listdir`` and
  ``importlib.resources`` ``iterdir`` see what they saw before.

A usage may say where a copy of some files is (``copies``: an ``--auto``
run with live imports learned from node 0's copy): those are read there,
not from the shared file system again.

The standard library modules the program used are taken too (unless
``stdlib=False``), and every sys.path directory is recorded with its
listing. mpistage itself is left out. Top-level ``.pth`` files of each used
root are always taken: the interpreter reads them before any recorder can
start.
"""

import os as _os

from mpistage import StageError

GRANULARITIES = ("package", "file")


def usable_roots(usages, stdlib):
    """Return the sys.path directories of *usages*, deepest first."""
    from mpistage.runtime.roots import in_stdlib

    roots = {p for u in usages for p in u["sys_path"] if _os.path.isdir(p)}
    keep = [r for r in roots if stdlib or not in_stdlib(r)]
    return sorted(keep, key=len, reverse=True)


def choose(selection, path, roots, granularity, done, copies=None):
    """Add the member(s) that a use of *path* calls for.

    *done* holds the (root, name) packages already added whole; *copies*
    the files known to exist, with where a copy of each is.
    """
    from mpistage.bundle.pack import add_top
    from mpistage.runtime.roots import METADATA_SUFFIXES, root_of, top_name

    copies = copies or {}
    found = root_of(path, roots)
    if found is None or not (path in copies or _os.path.exists(path)):
        return
    root, top, rel = found
    is_dir = "/" in rel or _os.path.isdir(_os.path.join(root, top))
    name = top_name(top, is_dir)
    if name == "mpistage" or top == "mpistage.pth":
        return
    if path in copies and granularity == "file":
        take_copied(selection, root, path, rel)
    elif granularity == "file" or (name is None and top == "__pycache__"):
        selection.take(root, path)
    elif top.endswith(METADATA_SUFFIXES + (".libs",)):
        selection.take(root, _os.path.join(root, top))
    elif name is not None:
        if (root, name) not in done:
            done.add((root, name))
            add_top(selection, root, name, top_locations(root, name))
    else:
        selection.take(root, path)


def take_copied(selection, root, path, rel):
    """Take a file that has a copy, without looking at the original."""
    selection.index(root)
    if not selection.excluded(rel):
        selection.add(root, path)


def read_from_copies(selection, copies):
    """Read files from their copies; not those directly in a root (inodes count)."""
    for root in selection.paths:
        for path in selection.taken(root):
            if path in copies and _os.path.dirname(path) != root:
                selection.relocate(root, path, source=copies[path])


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
    copies = {k: v for u in usages for k, v in u.get("copies", {}).items()}
    for path in used:
        choose(selection, path, roots, granularity, done, copies)
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
    read_from_copies(selection, copies)
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
            selection.add(found[0], path)


def tops(selection, root):
    """Return the top-level module names *selection* takes from *root*."""
    from mpistage.runtime.roots import top_name

    for path in selection.taken(root):
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


def record(output, command=(), granularity="package", stdlib=True, usage=()):
    """Run *command* with a recorder in each Python process; write the bundle.

    Or, given *usage* files (what ``--auto`` learning runs save), build the
    bundle from them without running anything.
    """
    if granularity not in GRANULARITIES:
        raise StageError(f"granularity {granularity!r}: use package or file")
    if usage:
        return from_usage(output, usage, granularity, stdlib)
    if not command:
        raise StageError("no command to record: mpistage record -o X -- python app.py")
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


def from_usage(output, files, granularity, stdlib):
    """Build the bundle of the usage saved in *files*; return its manifest."""
    import json

    usages = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                usages.append(json.load(f))
        except (OSError, ValueError) as exc:
            raise StageError(f"cannot read usage {path!r}: {exc}") from None
    first = usages[0]
    extra = {"command": first.get("command", []), "processes": first.get("processes")}
    created_by = first.get("created_by", "record")
    return build(output, usages, granularity, created_by, extra, stdlib)


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
