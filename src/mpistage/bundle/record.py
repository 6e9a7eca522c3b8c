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
not from the shared file system again. ``--auto`` also gives :func:`build`
its view of the files (:class:`~mpistage.bundle.files.Known`: what the
live reader learned), so nothing the run read is looked at again.

What a replay needs and what it must not have:

- files the program only checked (``os.stat``, ``os.path.exists``...: a
  package that refuses to import without ``bin/tool`` beside it) are taken
  where they exist, as files it read are;
- nothing the program wrote is taken (:class:`Written`): not the files it
  wrote, not what is below a directory it made, not the other files of a
  directory it wrote into (unless that directory was on ``sys.path`` when
  it started: a script writes its output beside itself), and, outside
  those directories, no file changed since the run started (C code
  writes unseen). Such a directory
  is no root either: TensorFlow's autograph writes the modules it imports
  into ``/tmp``, and a bundle rooted there would be stale on every run.

The standard library modules the program used are taken too (unless
``stdlib=False``), and every sys.path directory is recorded with its
listing. mpistage itself is left out. Top-level ``.pth`` files of each used
root are always taken: the interpreter reads them before any recorder can
start.
"""

import os as _os

from mpistage import StageError

GRANULARITIES = ("package", "file")


def usable_roots(usages, stdlib, files, written):
    """Return the sys.path directories of *usages*, deepest first."""
    from mpistage.runtime.roots import in_stdlib

    roots = {p for u in usages for p in u["sys_path"]}
    keep = [r for r in roots if stdlib or not in_stdlib(r)]
    keep = [r for r in keep if files.isdir(r) and not written.root(r)]
    return sorted(keep, key=len, reverse=True)


def choose(selection, path, roots, granularity, done, copies=None):
    """Add the member(s) that a use of *path* calls for.

    *done* holds the (root, name) packages already added whole; *copies*
    the files known to exist, with where a copy of each is.
    """
    from mpistage.bundle.pack import add_top
    from mpistage.runtime.roots import METADATA_SUFFIXES, root_of, top_name

    copies, files = copies or {}, selection.files
    found = root_of(path, roots)
    if found is None or not (path in copies or files.exists(path)):
        return
    root, top, rel = found
    is_dir = "/" in rel or files.isdir(_os.path.join(root, top))
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
            add_top(selection, root, name, top_locations(root, name, files))
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


def top_locations(root, name, files):
    """Return the entries of *root* that make up the top-level module *name*."""
    from mpistage.runtime.roots import top_name

    entries = []
    for entry in files.listing(root):
        if top_name(entry) == name:
            entries.append(_os.path.join(root, entry.rstrip("/")))
    cache = _os.path.join(root, "__pycache__")
    if files.isdir(cache):
        for entry in files.listdir(cache):
            if entry.split(".", 1)[0] == name:
                entries.append(_os.path.join(cache, entry))
    return entries


def take_listed(selection, usages, roots, written):
    """File granularity: take the direct entries of every directory listed."""
    from mpistage.runtime.roots import root_of

    files = selection.files
    for folder in sorted({p for u in usages for p in u.get("listed", [])}):
        found = root_of(folder, roots)
        if found and files.isdir(folder) and found[1] != "mpistage":
            for entry in files.listing(folder):
                path = _os.path.join(folder, entry)
                if not entry.endswith("/") and not written.file(path):
                    selection.take(found[0], path)


def take_checked(selection, usages, roots, granularity, done, written):
    """Take the files the program checked (``os.path.exists``) but did not read."""
    from mpistage.runtime.roots import root_of

    for path in sorted({p for u in usages for p in u.get("checked", [])}):
        found = root_of(path, roots)
        if found and not written.file(path) and selection.files.isfile(path):
            choose(selection, path, roots, granularity, done)


def build(
    output,
    usages,
    granularity="package",
    created_by="record",
    extra=None,
    stdlib=True,
    files=None,
):
    """Write the bundle of what *usages* used; return its manifest.

    *files* is the view of the file system to build from (default: the
    file system itself; see :mod:`~mpistage.bundle.files`).
    """
    from mpistage.bundle.pack import TEST_DIRS
    from mpistage.bundle.writer import Selection, write

    check_same_python(usages)
    selection, done = Selection(TEST_DIRS, files), set()
    written = Written(usages, selection.files)
    roots = usable_roots(usages, stdlib, selection.files, written)
    used = sorted({p for u in usages for p in u["files"]})
    copies = {k: v for u in usages for k, v in u.get("copies", {}).items()}
    for path in used:
        if not written.file(path):
            choose(selection, path, roots, granularity, done, copies)
    take_checked(selection, usages, roots, granularity, done, written)
    keep_used_tests(selection, used, roots, written)
    if granularity == "file":
        take_listed(selection, usages, roots, written)
    written.drop(selection)
    if not selection.paths:
        raise StageError("the program used no files outside the standard library")
    for root in list(selection.paths):
        for entry in selection.files.listdir(root):
            if entry.endswith(".pth"):
                selection.take(root, _os.path.join(root, entry))
    for root in roots:
        selection.index(root)
    if files is None:
        read_from_copies(selection, copies)
    names = sorted({n for r in selection.paths for n in tops(selection, r)})
    info = dict(extra or {}, granularity=granularity)
    fields = {"created_by": created_by, "packages": names, "recorded": info}
    fields["python"] = usages[0]["python"]
    return write(output, selection, fields, durable=created_by != "auto")


def keep_used_tests(selection, used, roots, written):
    """Take back the files of test directories that the program did use."""
    from mpistage.runtime.roots import root_of

    for path in used:
        found = root_of(path, roots)
        if found and selection.excluded(found[2]) and not written.file(path):
            if selection.files.isfile(path):
                selection.add(found[0], path)


def tops(selection, root):
    """Return the top-level module names *selection* takes from *root*."""
    from mpistage.runtime.roots import top_name

    for path in selection.taken(root):
        rel = _os.path.relpath(path, root)
        first, sep, _ = rel.partition(_os.sep)
        name = top_name(first, bool(sep) or selection.files.isdir(path))
        if name:
            yield name


class Written:
    """What the program wrote: never bundled, never a root (module docstring).

    From the recorders' usages: ``written`` (files opened for writing,
    created, renamed or linked into place), ``made`` (directories made),
    ``start_path`` (``sys.path`` when recording began) and ``started_ns``
    (when it began; files changed after it were written by the run).
    """

    def __init__(self, usages, files):
        self.files = files
        self.wrote = {p for u in usages for p in u.get("written", ())}
        self.made = {p for u in usages for p in u.get("made", ())}
        self.into = {_os.path.dirname(p) for p in self.wrote} | self.made
        self.kept = {p for u in usages for p in u.get("start_path", ())}
        started = [u["started_ns"] for u in usages if u.get("started_ns")]
        self.started = min(started) if started else None

    def file(self, path):
        """Whether the file *path* is (or sits among) what the program wrote.

        Changed since the run started counts only outside the directories
        that were on ``sys.path`` then: a file there touched before the run
        (an mtime in the future, a clock of another host) is the user's.
        """
        folder = _os.path.dirname(path)
        if path in self.wrote or self.below_made(path):
            return True
        if folder in self.into and folder not in self.kept:
            return True
        return not self.in_kept(path) and self.changed(path)

    def in_kept(self, path):
        """Whether *path* lies below a directory on ``sys.path`` at the start."""
        return any(path.startswith(k.rstrip(_os.sep) + _os.sep) for k in self.kept)

    def root(self, root):
        """Whether the directory *root* is one the program wrote into or made."""
        if root in self.kept:
            return False
        return root in self.into or self.below_made(root) or self.changed(root)

    def below_made(self, path):
        """Whether *path* lies below a directory the program made."""
        while True:
            parent = _os.path.dirname(path)
            if parent == path:
                return False
            if parent in self.made:
                return True
            path = parent

    def changed(self, path):
        """Whether *path* changed after the run started (``lstat``, once).

        Bytecode the import system wrote during the run is not the
        program's: it is checked against its source where it is used.
        """
        if self.started is None or "__pycache__" in path.split(_os.sep):
            return False
        try:
            return self.files.lstat(path).st_mtime_ns > self.started
        except (OSError, ValueError):
            return False

    def drop(self, selection):
        """Leave out what whole directories taken hold of the program's writes."""
        if not (self.wrote or self.made):
            return
        for root in selection.paths:
            for path in selection.taken(root):
                if path in self.wrote or self.below_made(path):
                    selection.drop(root, path)
                elif _os.path.dirname(path) in self.into - self.kept:
                    selection.drop(root, path)


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
