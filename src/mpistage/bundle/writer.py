"""The one bundle writer: fed (source, target) member records.

:class:`Selection` is what a bundle will hold: its roots, and per root the
:class:`Member` records (source, where it goes, new content) of the
original files it takes (``pack``, ``record`` and ``pack --env`` each fill
one). :func:`write` turns a selection into a bundle, atomically: members are
streamed to a temporary file in the target's directory, the manifest comes
last, the header is filled in, and the file is renamed into place; on any
error the temporary file is removed and the target is untouched.

For each root the manifest records its listing (so absent names can be
answered without the file system), its own identity, the listing and mtime
of each directory the bundle holds only in part, and, for each bundled
distribution, the identity of its ``RECORD`` (inode, size, mtime); members
its ``RECORD`` lists are marked ``owned``, and members directly in a root
keep their inode. That is what lets the staleness check cost
O(distributions + directories) (see :mod:`mpistage.runtime.validate`).

Every question about the originals goes to the selection's view of the
file system (:mod:`~mpistage.bundle.files`): the file system itself, or
what an ``--auto`` learning run learned already. The standard library
modules the writer needs (``json``, ``csv``, ``fnmatch``) are mpistage's
own copies (:func:`mpistage.own_module`): it also runs inside a program
that is done, whose own ``json.py`` may be ``json``.

Bundles are never bundled: files ending in ``.mpistage`` (and the writer's
own temporaries) are left out, so ``pack --path .`` with the output in
``.`` does not take the previous bundle and is not stale at once. Nor are
names at the top of a root that start with ``.mpistage``: a staging
directory reserves them for mpistage's own files.
"""

import os as _os
import stat as _stat

from mpistage import StageError, lend, own_module
from mpistage.bundle.files import Files
from mpistage.runtime import bundlefile

# Never bundled: bundles, the writer's temporaries, and names at the top of a
# root that a staging directory reserves for mpistage's own files.
BUNDLES = ("*" + bundlefile.SUFFIX, "*.mpistage-*.tmp", "/" + bundlefile.RESERVED + "*")


class Member:
    """One file, directory or symlink a bundle will hold (conda-pack's ``File``).

    It is read from *source* (the original, or the file a symlink resolves
    to) and stored as *rel* below its root; *data*, when given, replaces the
    content (a relocated script or binary).
    """

    __slots__ = ("data", "rel", "source")

    def __init__(self, source, rel, data=None):
        self.source, self.rel, self.data = source, rel, data


class Selection:
    """The roots of a bundle and, for each, the members it takes from it.

    Roots keep the order they were first named in (their number in the
    manifest). Members are keyed by their original path. The tools fill a
    selection through these methods only.
    """

    def __init__(self, exclude=(), files=None):
        self.exclude = tuple(exclude) + BUNDLES
        self.roots, self.dests, self.links = {}, {}, []
        self.files = files if files is not None else Files()

    @property
    def paths(self):
        """The roots, in order."""
        return list(self.roots)

    def index(self, root):
        """Return the number of *root*, registering it on first use."""
        root = _os.path.abspath(root)
        self.roots.setdefault(root, {})
        return self.paths.index(root)

    def taken(self, root):
        """Return the original paths taken below *root*."""
        return set(self.roots.get(_os.path.abspath(root), ()))

    def take(self, root, path):
        """Add *path* (below *root*) and, for a directory, all below it."""
        self.index(root)
        root = _os.path.abspath(root)
        for found in walk(path, self.files):
            if not self.excluded(_os.path.relpath(found, root)):
                self.add(root, found)

    def add(self, root, path):
        """Add *path* below *root* alone, exclusions or not."""
        self.index(root)
        root = _os.path.abspath(root)
        if path != root and path not in self.roots[root]:
            self.roots[root][path] = Member(path, _os.path.relpath(path, root))

    def drop(self, root, path):
        """Leave *path* out after all."""
        self.roots[_os.path.abspath(root)].pop(path, None)

    def relocate(self, root, path, rel=None, source=None, data=None):
        """Store *path* as *rel*, read from *source*, or with *data* instead."""
        member = self.roots[_os.path.abspath(root)][path]
        member.rel = member.rel if rel is None else rel
        member.source = member.source if source is None else source
        member.data = member.data if data is None else data

    def place(self, root, dest):
        """Put *root* at *dest* below the staging directory (environments)."""
        self.dests[_os.path.abspath(root)] = dest

    def link(self, root, rel, target):
        """Add a symlink *rel* below *root* that points to *target*."""
        self.links.append((self.index(root), rel, target))

    def excluded(self, rel):
        """Whether *rel* or one of its parent directories matches an exclusion.

        Patterns match path components (:mod:`mpistage.bundle.globs`).
        """
        from mpistage.bundle.globs import excludes

        if not rel or rel == ".":
            return False
        return any(excludes(pattern, rel) for pattern in self.exclude)

    def excluding(self, patterns):
        """A context in which *patterns* are excluded too."""
        return _Excluding(self, tuple(patterns))

    def records(self):
        """Yield (root index, original path, member) in manifest order."""
        for index, members in enumerate(self.roots.values()):
            for path in sorted(members):
                yield index, path, members[path]


class _Excluding:
    """Adds exclusion patterns to a selection for a while."""

    def __init__(self, selection, patterns):
        self.selection, self.patterns = selection, patterns

    def __enter__(self):
        self.saved = self.selection.exclude
        self.selection.exclude = self.saved + self.patterns

    def __exit__(self, *exc):
        self.selection.exclude = self.saved


def walk(path, files):
    """Yield *path* and, for a real directory, everything below it (a view's)."""
    yield _os.path.abspath(path)
    if files.isdir(path) and not files.islink(path):
        for found in files.walk(path):
            yield _os.path.abspath(found)


# A tool's progress display (mpistage.cli.progress): ``observer(total)`` is
# called with the number of members and returns ``advance(size)``, called per
# member written. None in a job: rank 0 of an --auto run writes silently.
observer = None


def write(output, selection, fields, durable=True):
    """Write the bundle of *selection* to *output*; return its manifest.

    *fields* are more manifest fields (``created_by``, ``packages``, ...).
    Unless *durable*, the file is not synced before its rename: an ``--auto``
    bundle, checksummed and learned again when it cannot be read, does not
    keep the job waiting for the disk.
    """
    import time

    from mpistage import __version__
    from mpistage.runtime.roots import partial_dirs

    if not output.endswith(bundlefile.SUFFIX):
        raise StageError(f"bundle name {output!r} must end in {bundlefile.SUFFIX!r}")
    drop_escaping_links(selection, fields.get("kind", "packages"))
    files = selection.files
    roots = [root_entry(selection, p) for p in selection.paths]
    manifest = {
        "kind": "packages",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mpistage": __version__,
        "python": bundlefile.python_tag(),
        **fields,
        "roots": roots,
    }
    owned = [set(r.pop("_owned")) for r in roots]
    records = list(selection.records())
    advance = observer(len(records)) if observer is not None else None
    with Writer(output, files, durable) as writer:
        for index, path, member in records:
            rel = member.rel
            writer.add(index, rel, member.source, member.data, rel in owned[index])
            if advance is not None:
                advance(writer.members[-1]["size"])
            if incomplete(selection, index, path):
                writer.members[-1]["partial"] = True
        for index, rel, target in selection.links:
            writer.add_link(index, rel, target)
        for index, root in enumerate(roots if fields.get("kind") != "env" else ()):
            rels = partial_dirs({"members": writer.members}, index)
            record_partial(root, rels, files)
        return writer.finish(manifest)


def record_partial(entry, rels, files):
    """Record the listing and mtime of each directory held in part (no bytecode).

    A name absent from the staged copy is then looked for in the original
    only when the original holds it; the mtime tells when the listing is
    no longer true.
    """
    found = {}
    for rel in rels:
        if "__pycache__" in rel.split("/"):
            continue
        path = _os.path.join(entry["path"], rel)
        if files.isdir(path) and not files.islink(path):
            found[rel] = {
                "mtime_ns": files.stat(path).st_mtime_ns,
                "listing": files.listing(path),
                "entries": files.digest(path),
            }
    if found:
        entry["partial"] = found


def incomplete(selection, index, path):
    """Whether the directory *path* has entries the selection left out."""
    files = selection.files
    if files.islink(path) or not files.isdir(path):
        return False
    taken = selection.taken(selection.paths[index])
    return any(_os.path.join(path, name) not in taken for name in files.listdir(path))


def drop_escaping_links(selection, kind):
    """Leave out the symlinks that lead out of their root, to the originals.

    A bundle's link may only point inside its own root (the reader's rule,
    :func:`~mpistage.runtime.bundlefile.check_links`): a venv's
    ``bin/python`` → ``/usr/bin/python3`` may not be one. Such a name is
    left to the original, as an excluded one is (its directory is then
    held in part). Resolution follows the bundle's other links as the
    reader's does.
    """
    entries = [{"dest": selection.dests[p]} if p in selection.dests else {}
               for p in selection.paths]  # fmt: skip
    bases = [bundlefile.base_of(entry, i) for i, entry in enumerate(entries)]
    found, links, files = [], {}, selection.files
    for index, path, member in selection.records():
        if member.data is None and files.islink(member.source):
            target = files.readlink(member.source)
            found.append((index, path, member.rel, target))
            links["/".join(bases[index] + member.rel.split("/"))] = target
    for index, rel, target in selection.links:
        links["/".join(bases[index] + rel.split("/"))] = target
    for index, path, rel, target in found:
        base = bases[index] if kind == "packages" else []
        parts = base + rel.split("/")
        if not bundlefile.resolves_inside(parts[:-1], target, links, len(base)):
            selection.drop(selection.paths[index], path)


def root_entry(selection, root):
    """Describe a root for the manifest: path, listing, distributions."""
    from mpistage.runtime.roots import in_stdlib

    files = selection.files
    is_dir = files.isdir(root)
    entry = {"path": root, "listing": files.listing(root) if is_dir else []}
    if is_dir:
        st = files.stat(root)
        entry["identity"] = [st.st_ino, st.st_mtime_ns]
    if root in selection.dests:
        entry["dest"] = selection.dests[root]
    dists, owned = distributions(root, selection.taken(root), files)
    if dists:
        entry["dists"] = dists
    if in_stdlib(root):
        entry["stdlib"] = stamp(root, files)
        entry["entries"] = files.digest(root)
    entry["_owned"] = owned
    return entry


def stamp(root, files):
    """The identity of a standard library root: its ``os.py``, or itself."""
    if files.exists(_os.path.join(root, "os.py")):
        name, st = "os.py", files.stat(_os.path.join(root, "os.py"))
    else:
        name, st = ".", files.stat(root)
    return [name, st.st_ino, st.st_size, st.st_mtime_ns]


def distributions(root, taken, files):
    """Return the RECORD identities of the distributions that own bundled files.

    Every installed distribution of the root is looked at, bundled or not
    (``--granularity file`` may take a package's files without its metadata);
    returns ({dist-info: [inode, size, mtime]}, the bundled files they own).
    """
    from mpistage.runtime.roots import METADATA_SUFFIXES

    dists, owned = {}, set()
    rels = {_os.path.relpath(path, root) for path in taken}
    if not files.isdir(root):
        return dists, owned
    for name in sorted(files.listdir(root)):
        record = _os.path.join(root, name, "RECORD")
        if not name.endswith(METADATA_SUFFIXES) or not files.isfile(record):
            continue
        mine = record_paths(record, files) & rels
        if mine:
            st = files.stat(record)
            dists[name] = [st.st_ino, st.st_size, st.st_mtime_ns]
            owned |= mine
    return dists, owned


def record_paths(record, files):
    """Return the root-relative paths a ``RECORD`` file lists, normalized."""
    csv = own_module("csv")
    text = b"".join(files.chunks(record)).decode("utf-8", errors="replace")
    found = set()
    for row in csv.reader(text.splitlines()):
        if row and row[0]:
            rel = _os.path.normpath(row[0])
            if not rel.startswith(".."):
                found.add(rel)
    return found


class Writer:
    """Stream members to a temporary file; add the manifest and header last."""

    def __init__(self, path, files=None, durable=True):
        self.path, self.durable = _os.path.abspath(path), durable
        self.files = files if files is not None else Files()
        try:
            fd, self.tmp = make_temporary(_os.path.dirname(self.path))
        except OSError as exc:
            raise StageError(f"cannot write bundle {path!r}: {exc.strerror}") from None
        self.file = _os.fdopen(fd, "wb")
        self.file.write(bytes(bundlefile.HEADER_SIZE))
        self.members = []

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            self.file.close()
            _os.unlink(self.tmp)

    def add(self, root, rel, path, data=None, owned=False):
        """Add the file, directory or symlink at *path* as *rel* under *root*.

        *data*, when given, replaces the file's content (a relocated script
        or binary); its mode and mtime still come from *path*.
        """
        st = self.files.lstat(path)
        member = {"rel": rel, "root": root, "mode": st.st_mode & 0o7777}
        member["mtime_ns"] = st.st_mtime_ns
        if "/" not in rel:  # a rename-replace in a root changes only the inode
            member["ino"] = st.st_ino
        if _stat.S_ISLNK(st.st_mode):
            member.update(type="link", target=self.files.readlink(path), size=0)
        elif _stat.S_ISDIR(st.st_mode):
            member.update(type="dir", size=0, entries=self.files.digest(path))
        else:
            member.update(type="file", **self.copy(path, data))
        if owned:
            member["owned"] = True
        self.members.append(member)

    def add_link(self, root, rel, target):
        """Add a symlink *rel* under *root* pointing to *target*."""
        member = {"rel": rel, "root": root, "mode": 0o777, "mtime_ns": 0}
        self.members.append(dict(member, type="link", target=target, size=0))

    def copy(self, path, data=None):
        """Append a file's content (or *data*); return offset, size, digest."""
        offset, digest, size = self.file.tell(), bundlefile.sha256(), 0
        chunks = [data] if data is not None else self.files.chunks(path)
        for chunk in chunks:
            digest.update(chunk)
            self.file.write(chunk)
            size += len(chunk)
        return {"offset": offset, "size": size, "sha256": digest.hexdigest()}

    def finish(self, manifest):
        """Append *manifest* (plus the members), fill the header, rename."""
        json = own_module("json")
        manifest = dict(manifest, format=bundlefile.FORMAT, members=self.members)
        with lend("json"):
            raw = json.dumps(manifest, separators=(",", ":")).encode()
        offset = self.file.tell()
        self.file.write(raw)
        self.file.seek(0)
        digest = bundlefile.sha256(raw).digest()
        header = bundlefile.HEADER.pack(
            bundlefile.MAGIC, bundlefile.FORMAT, 0, offset, len(raw), digest
        )
        self.file.write(header)
        self.file.flush()
        if self.durable:
            _os.fsync(self.file.fileno())
        self.file.close()
        _os.chmod(self.tmp, 0o644)
        _os.replace(self.tmp, self.path)
        return manifest


def make_temporary(folder):
    """Create a new file for the bundle in *folder*; return (fd, path).

    What ``tempfile.mkstemp`` does, without importing ``tempfile`` (and
    ``random``, ``shutil``...) into a program that is done.
    """
    import errno

    for _ in range(100):
        path = _os.path.join(folder, f".mpistage-{_os.urandom(6).hex()}.tmp")
        flags = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_CLOEXEC
        try:
            return _os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free temporary name", folder)
