"""Live imports: no bundle, and still one reader and one copy per node.

``python -m mpistage app.py`` with no bundle, and the first run of
``--auto``, serve imports live. World rank 0, the reader
(:mod:`~.reader`), resolves names and reads the originals; what it reads
goes once to every node leader (:mod:`~.relay`) and into the node's copy
(:mod:`~.mirror`); every rank imports from that copy (:mod:`~.finder`)
and asks its leader for what is not there yet (:mod:`~.request`). Nothing
is collective per import, so ranks that import different things, or
nothing, or that fail an import, cannot hang each other.

:class:`LiveSession` is the whole life of it on one rank: :meth:`start`
(collective) and :meth:`close` (collective, also from inside
``MPI_Finalize``). The relays are threads, so MPI must allow
``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default); when any rank has
less, the job runs the plain way, and rank 0 says so in one line.
"""

import os as _os
import sys as _sys

from mpistage import StageError
from mpistage.runtime.collective import attempt, barrier, wait

# What a rank's finder and request path use besides the finders' own needs
# (:data:`~mpistage.runtime.finders.SERVING`); imported before installing.
SERVING = (
    "mpistage.runtime.bulk",
    "mpistage.runtime.live.finder",
    "mpistage.runtime.live.mirror",
    "mpistage.runtime.live.request",
)


class NoFootprint:
    """A live copy starts empty: only the root needs room."""

    inodes = 1

    def bytes(self, block):
        """No blocks are needed before the first file."""
        return 0


class LiveSession:
    """Live imports on one rank, from the first request to the copy's removal."""

    def __init__(self, session, args, sources=False):
        self.session, self.args, self.sources = session, list(args), sources
        self.mode = None  # "live", or why the job runs the plain way
        self.root = self.writer = self.relay = self.client = self.listings = None
        self.roots, self.copy_root, self.installed = (), None, None
        self.comms = ()
        self.closed, self.pid, self.generation = False, _os.getpid(), 0
        self.fresh = {}  # directory: the cache reset its listing was read after
        self.counts = {"requests": 0, "fallbacks": 0, "late": 0}
        self.late = []  # the first keys that went unanswered in time
        self.wait = None  # seconds a request waits (MPISTAGE_LIVE_WAIT)
        self.served = []  # the reader's files, for --auto

    # -- start ---------------------------------------------------------------

    def start(self):
        """Set up the reader, the relays and the finder on every rank (collective)."""
        topo = self.session.discover()
        why = self.threads_missing(topo.world)
        if why:
            self.mode = "plain: no MPI_THREAD_MULTIPLE"
            if topo.world.rank == 0:
                print(f"mpistage: {why}", file=_sys.stderr, flush=True)
            return False
        self.wait = attempt(topo.world, wait_seconds)
        self.comms = (topo.world.Dup(), topo.world.Dup())
        try:
            self.place(topo)
            self.serve(topo)
            self.mode = "live"
            attempt(topo.world, self.install)
        except StageError:
            self.abandon()
            raise
        return True

    def threads_missing(self, world):
        """Return why live imports cannot run here (agreed), or ``None``."""
        from mpi4py import MPI

        from mpistage.runtime.collective import first_failure

        level = MPI.Query_thread()
        rank = first_failure(world, level < MPI.THREAD_MULTIPLE)
        if rank is None:
            return None
        return (
            f"no live imports: MPI gives rank {rank} no MPI_THREAD_MULTIPLE; "
            "the program imports the plain way"
        )

    def place(self, topo):
        """Leaders make the node's copy (a guarded per-job root); all learn where."""
        from mpistage.node.place import job_tag
        from mpistage.runtime.broadcast import share
        from mpistage.runtime.stage import JobPlace

        tag = topo.world.bcast(job_tag() if topo.world.rank == 0 else None, root=0)

        def on_leader():
            from mpistage.runtime.live.mirror import CopyWriter

            if topo.is_leader:
                place = JobPlace(tag, topo.index, self.session.keep)
                self.root = place.make(None, NoFootprint())
                self.writer = CopyWriter(self.root)

        attempt(topo.world, on_leader)
        self.copy_root = share(topo.node, self.root.path if self.root else None)

    def serve(self, topo):
        """Start the relays (leaders; the reader on rank 0) and this rank's client."""
        from mpistage.runtime.live import mirror, request

        serve, reply = self.comms
        world = topo.world
        leaders = topo.leaders.allgather(world.rank) if topo.is_leader else None
        leader = topo.node.bcast(world.rank if topo.is_leader else None, root=0)
        if topo.is_leader:
            self.relay = self.make_relay(topo, leaders)
            self.relay.start()
        if world.rank == 0:
            self.client = request.ReaderClient(self.relay, self.wait)
        elif topo.is_leader:
            self.client = request.LeaderClient(self.relay, self.wait)
        self.listings = mirror.Listings(self.copy_root)
        if not topo.is_leader:
            copy = NodeCopy(self.copy_root, self.listings)
            self.client = request.RankClient(serve, reply, leader, self.wait, copy)

    def make_relay(self, topo, leaders):
        """Return this leader's relay, holding the reader on world rank 0."""
        from mpistage.runtime.live.reader import Reader
        from mpistage.runtime.live.relay import Relay

        reader = Reader(self.sources) if topo.world.rank == 0 else None
        serve, reply = self.comms
        return Relay(serve, reply, leaders, topo.leaders.rank, self.writer, reader)

    def install(self):
        """Serve imports live: the path hook, distributions, no stale finders."""
        from mpistage.runtime import finders
        from mpistage.runtime.live import finder as livefinder

        finders.import_serving(finders.SERVING + SERVING)
        self.roots = served_roots(self.args)
        hook = livefinder.LiveHook(self)
        _sys.path_hooks.insert(0, hook)
        meta = finders.stand_in(lambda base: livefinder.LiveMetaFinder(base, self))
        livefinder.CURRENT[0] = self
        self.installed = (hook, meta)
        if "pkgutil" in _sys.modules:
            finders.register_pkgutil(_sys.modules["pkgutil"])
        finders.forget(self.serves)

    # -- what the finder asks ------------------------------------------------

    def usable(self):
        """Whether imports are served live in this process now."""
        return not self.closed and _os.getpid() == self.pid

    def serves(self, folder):
        """Whether the directory *folder* is served live.

        Only plain absolute paths are (no ``.``, ``..`` or empty part): a
        path such as ``pkg/../data`` is read as plain python reads it.
        """
        if folder.startswith(self.copy_root + "/") or not plain_path(folder):
            return False
        return any(folder == r or folder.startswith(r + "/") for r in self.roots)

    def listing(self, path):
        """Return the listing of *path* (asking for it once); raise if none comes."""
        from mpistage.runtime.finders import Unknown

        found = self.listings.get(path)
        if found is None:
            self.need(("d", path))
            found = self.listings.get(path)
            if found is None:
                raise Unknown(path)
        return found[0]

    def served_listing(self, folder):
        """Return the listing of *folder*; raise ``Unknown`` unless served live now."""
        from mpistage.runtime.finders import Unknown

        if not self.usable() or not self.serves(folder):
            raise Unknown(folder)
        return self.listing(folder)

    def knows(self, path):
        """Whether the listing of *path* is here."""
        return self.listings.get(path) is not None

    def module_key(self, folder, name):
        """Return the key that asks for module *name* in *folder*."""
        found = self.listings.get(folder)
        return ("m", folder, name, found[1] if found else 0)

    def stale(self, path):
        """Whether *path*'s listing came before this rank's last cache reset."""
        return self.fresh.get(path, 0) < self.generation

    def refresh(self, path):
        """Ask for a listing of *path* read after the last cache reset."""
        from mpistage.runtime.finders import Unknown

        rank = self.session.topology.world.rank
        if self.need(("r", path, rank, self.generation)) is not None:
            raise Unknown(path)  # no fresh listing: the regular finder looks
        self.fresh[path] = self.generation
        self.listings.get(path, fresh=True)

    def invalidate(self):
        """``importlib.invalidate_caches()``: listings read before are stale.

        A name then missing from a listing makes the reader list that
        directory again, once per reset and rank (the rank's reset and the
        reader's new listing are then in order), so a module the program
        created after the listing was read is found, as ``FileFinder``
        finds it.
        """
        self.generation += 1

    def copy(self, path):
        """Return where the original *path* is in this node's copy.

        Once the copy is gone, that is the original itself.
        """
        from mpistage.runtime.live.mirror import copy_path

        return copy_path(self.copy_root, path) if self.copy_root else path

    def present(self, kind, path):
        """Whether the node's copy holds the module file(s) of *path*."""
        if kind == "source":
            from mpistage.runtime.finders import cache_from_source

            if _os.path.exists(self.copy(cache_from_source(path))):
                return True
        return _os.path.exists(self.copy(path))

    def fetch(self, path):
        """Return the copy of the file *path*, asking for it if needed; or ``None``."""
        if not plain_path(path):
            return None
        copy = self.copy(path)
        if not _os.path.exists(copy):
            self.need(("f", path))
            if not _os.path.exists(copy):
                self.counts["fallbacks"] += 1
                return None
        return copy

    def need(self, key):
        """Ask along the request path until the node's copy answers *key*.

        Returns ``None`` when it does; ``"late"`` or ``"closed"`` when the
        caller must read the original instead (:mod:`~.request`).
        """
        from mpistage.runtime.live.request import LATE

        self.counts["requests"] += 1
        result = self.client.need(key)
        if result == LATE:
            self.counts["late"] += 1
            if len(self.late) < LATE_SHOWN:
                self.late.append(key_name(key))
        return result

    # -- the end -------------------------------------------------------------

    def close(self):
        """After the program: stop serving and uninstall (collective).

        From its first step, this (the main) thread serves the leader's relay
        (:meth:`~.relay.Relay.take_over`): one thread calls MPI, as
        ``MPI_Finalize`` needs. The node's copy stays until :meth:`release`:
        ``--auto`` builds the bundle from node 0's copy.
        """
        if self.mode != "live" or self.closed or not self.usable():
            return
        if self.relay is not None:
            self.relay.take_over()  # from here on one thread calls MPI
        everyone = self.session.topology.world.Ibarrier()  # all done with the program
        if self.relay is None:
            wait(everyone)
        self.client.close()
        self.closed = True
        if self.relay is not None:
            self.relay.close(everyone)
            if self.relay.reader is not None:
                self.served = sorted(self.relay.reader.sent)
        self.uninstall()
        for comm in self.comms:
            comm.Free()
        self.comms = ()

    def release(self):
        """Remove the node's copy between two node barriers (collective).

        What was loaded from the copy (extensions, bytecode) is pointed back
        at the originals first, as after a ``staged()`` block.
        """
        from mpi4py import MPI

        from mpistage.runtime.finders import repoint

        if self.mode != "live" or not self.closed or self.copy_root is None:
            return
        node = self.session.topology.node
        if self.relay is not None and self.relay.reader is not None:
            self.relay.reader.close()  # kept open for --auto's bundle until now
        repoint([(self.copy("/"), "")])
        barrier(node)
        self.remove()
        if not MPI.Is_finalized():
            barrier(node)
        self.copy_root = None

    def uninstall(self):
        """Take the hook and the distribution finder out; drop live finders."""
        from mpistage.runtime import finders
        from mpistage.runtime.live import finder as livefinder

        hook, meta = self.installed or (None, None)
        if hook in _sys.path_hooks:
            _sys.path_hooks.remove(hook)
        finders.step_aside([meta])
        finders.drop_finders(livefinder.LiveFinder)
        livefinder.CURRENT[0] = None
        if self.listings is not None:
            self.listings.close()

    def remove(self):
        """The leader removes its node's copy (unless kept)."""
        from mpistage.node.cleanup import disarm, release
        from mpistage.node.place import mark_kept

        if self.root is None:
            return
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.session.keep:
            disarm(self.root)
            mark_kept(self.root)
        else:
            release(self.root)
        self.root = None

    def abandon(self):
        """An agreed error ends the job: stop serving, remove this leader's copy.

        Every rank is here (the error was agreed), so the relays end as usual.
        """
        if self.mode == "live" and not self.closed:
            self.close()
        self.closed = True
        if self.root is not None:
            try:
                self.remove()
            except (OSError, StageError):
                pass  # The watchdog removes it when the leader is gone.
            self.root = None

    def facts(self):
        """Return this rank's figures for the report."""
        facts = {"mode": self.mode, **self.counts, "late_keys": self.late}
        if self.relay is not None:
            facts.update({f"relay_{k}": v for k, v in self.relay.counts.items()})
            if self.relay.reader is not None:
                facts.update(
                    {f"read_{k}": v for k, v in self.relay.reader.counts.items()}
                )
        return facts

    def usage(self, found):
        """Return a recorder's *found* usage with copies as originals, plus served.

        On rank 0, ``copies`` says where node 0's copy holds each served
        file, so that the bundle is built without reading them again.
        """
        files = {self.original(p) for p in found["files"]} | set(self.served)
        listed = {self.original(p) for p in found.get("listed", [])}
        files.discard(None)
        listed.discard(None)
        copies = {p: self.copy(p) for p in self.served if _os.path.isfile(self.copy(p))}
        return dict(found, files=sorted(files), listed=sorted(listed), copies=copies)

    def served_modules(self):
        """Return the names of the loaded modules whose source was served live."""
        from mpistage.runtime.live.finder import LiveSourceLoader

        return {
            name
            for name, module in list(_sys.modules.items())
            if isinstance(getattr(module, "__loader__", None), LiveSourceLoader)
        }

    def original(self, path):
        """Return the original of a path in this node's copy, else *path*.

        mpistage's own files in the copy (the listings) have none: ``None``.
        """
        from mpistage.node.imports import FILES

        if not self.copy_root or not path.startswith(self.copy_root + "/"):
            return path
        head = f"{self.copy_root}/{FILES}/"
        return path[len(head) - 1 :] if path.startswith(head) else None


LATE_SHOWN = 5  # late keys a rank names in the report


def wait_seconds():
    """How long a request waits for its answer (``MPISTAGE_LIVE_WAIT``)."""
    from mpistage.settings import get

    return get("MPISTAGE_LIVE_WAIT")


class NodeCopy:
    """What a rank waiting for an answer can see of its node's copy."""

    def __init__(self, root, listings):
        self.root, self.listings = root, listings

    def taken(self):
        """The bytes the node's leader has taken in so far."""
        from mpistage.runtime.live.mirror import taken

        return taken(self.root)

    def answers(self, key):
        """Whether the leader logged *key* as answered."""
        return self.listings.answers(key)


def plain_path(path):
    """Whether *path* is absolute, with no ``.``, ``..`` or empty part."""
    parts = path.split("/")
    return parts[0] == "" and not any(p in ("", ".", "..") for p in parts[1:])


def key_name(key):
    """Name what a request asked for: a module, a listing or a file."""
    if key[0] == "m":
        return f"{key[1]}/{key[2]}"
    return key[1]


def served_roots(args):
    """Return the directories served live: ``sys.path`` now, the target's."""
    from mpistage.runtime.auto import target_path0

    found = [_os.path.abspath(p or ".") for p in _sys.path]
    found.append(target_path0(args))
    return tuple(dict.fromkeys(p for p in found if p and p != "/"))
