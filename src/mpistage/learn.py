"""Learning a bundle: what an ``--auto`` run used, saved as the cache's bundle.

Learning needs both the runtime (the recorders of every rank, the live
reader's facts) and the bundle writer, so it lives above both: the
runtime never imports the writer. ``python -m mpistage`` hands
:func:`save` to the runner (:func:`mpistage.runtime.runner.main`), which
calls it at the end of a learning run.

Rank 0 builds the bundle in its own process, from the node's copy and what
the live reader learned while serving (listings, identities, staleness
facts: :class:`mpistage.bundle.files.Known`). The bundle writer's modules
are read relative to their directory (:func:`mpistage.load_local`), its
standard library modules are mpistage's own copies
(:func:`mpistage.own_module`).
"""

import os as _os

from mpistage import StageError
from mpistage.runtime.auto import merge


def save(comm, recorder, path, args, live=None):
    """Reduce every rank's usage to rank 0, which builds the bundle (collective).

    After live imports (*live*), paths in a node's copy count as their
    originals, and rank 0 adds every file the reader served, builds from
    node 0's copy and what the reader learned, at file granularity; without
    them (``MPISTAGE_LIVE=no``), whole packages from the file system. A
    failure is agreed: one line on rank 0, on every rank the same error.
    """
    from mpistage.runtime.collective import attempt

    served = live is not None and live.mode == "live"

    def usage():
        if not served:
            return recorder.usage()
        found = live.usage(recorder.usage(served=live.served_modules()))
        checked = {live.original(p) for p in found["checked"]} - {None}
        return dict(found, checked=sorted(checked))

    usage = comm.reduce(attempt(comm, usage), op=merge, root=0)
    if comm.rank == 0:
        usage.update(created_by="auto", processes=comm.size)
        usage["command"] = ["python", "-m", "mpistage", "--auto", *args]
    reader = live.relay.reader if served and live.relay is not None else None
    attempt(comm, lambda: build(path, usage, reader) if comm.rank == 0 else None)


def build(path, usage, reader=None):
    """Rank 0: build the bundle of *usage* at *path*, in this process.

    With the live *reader*, from what it learned and node 0's copy (file
    granularity); else from the file system (whole packages).
    """
    from mpistage import load_local

    load_local("mpistage.bundle", ("__init__", "files", "writer", "pack", "record"))
    from mpistage.bundle import record

    extra = {"command": usage.get("command", []), "processes": usage.get("processes")}
    files = learned(reader, usage.get("copies", {})) if reader is not None else None
    granularity = "file" if files is not None else "package"
    try:
        record.build(path, [usage], granularity, "auto", extra, files=files)
    except (OSError, StageError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise StageError(f"cannot save the --auto bundle {path!r}: {why}") from None
    finally:
        if reader is not None:
            reader.close()


def learned(reader, copies):
    """Return the view of the files that the live *reader* learned, with *copies*."""
    from mpistage.bundle.files import Known

    listings, stats, links, digests = reader.facts()
    return Known(listings, stats, links, copies, ReaderFiles(reader), digests)


class ReaderFiles:
    """The originals, reached relative to the live reader's directory descriptors.

    What the reader did not learn is asked this way: a lookup and a stat
    relative to an open directory, not a walk of the whole path.
    """

    def __init__(self, reader):
        self.reader = reader

    def lstat(self, path):
        """``os.lstat`` of *path*, relative to its directory's descriptor."""
        folder, name = _os.path.split(path)
        return _os.stat(name, dir_fd=self.reader.dir_fd(folder), follow_symlinks=False)

    def stat(self, path):
        """``os.stat`` of *path*, relative to its directory's descriptor."""
        folder, name = _os.path.split(path)
        if not name:
            return _os.stat(path)
        return _os.stat(name, dir_fd=self.reader.dir_fd(folder))

    def listing(self, path):
        """The entries of the directory *path* (directories with ``/``)."""
        from mpistage.runtime.live.reader import LIST_FLAGS
        from mpistage.runtime.roots import listing

        return listing(self.reader.dir_fd(path, LIST_FLAGS))

    def readlink(self, path):
        """``os.readlink`` of *path*, relative to its directory's descriptor."""
        folder, name = _os.path.split(path)
        return _os.readlink(name, dir_fd=self.reader.dir_fd(folder))

    def digest(self, path):
        """The digest of the directory *path*'s entries, from its descriptor."""
        from mpistage.runtime.live.reader import LIST_FLAGS
        from mpistage.runtime.roots import entries_digest

        return entries_digest(self.reader.dir_fd(path, LIST_FLAGS))

    def chunks(self, path):
        """The content of the file *path*, read once (a big file in pieces)."""
        folder, name = _os.path.split(path)
        got = self.reader.read(folder, name)
        if got is None:
            raise OSError(2, "cannot read", path)
        return got[0].chunks() if hasattr(got[0], "chunks") else [got[0]]
