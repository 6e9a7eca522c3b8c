"""The node boot: one rank per node imports mpi4py, the others take its copy.

Before MPI can run, every rank would import mpi4py from the shared file
system: its Python modules, their standard library, the MPI library with the
libraries it needs, and (inside ``MPI_Init``) UCX's or libfabric's plugins.
That is F, the floor, paid per rank. Here the ranks of one launch on one
node meet first, at a private node-local directory, and only one of them
pays it:

- the *first* rank to create the meeting place imports mpi4py as usual and
  leaves what it loaded there (:mod:`mpistage.node.copy`): the code of every
  Python module, and copies of the extension modules and libraries (at
  their original absolute paths below the place, so that ``$ORIGIN``
  finds what they need); then it marks the place complete and only then
  starts MPI;
- every other rank (a *follower*) waits for that mark, bounded, and imports
  the same modules from the place: no metadata operation on the shared file
  system;
- any doubt means the *normal* import: correct, slower, and said in the
  report (:func:`facts`).

A rank recognises its launch from the launcher
(:func:`~mpistage.node.imports.launch`): Slurm's job and step, PMIx's
namespace, Flux's job, or for Hydra the ``hydra_pmi_proxy`` it runs under
(its pid and start time). Variables can be inherited, so two launches may
carry one name: the place's owner record and the first rank's record also
name the launch's *instance* (:func:`~mpistage.node.imports.instance`), the
launcher's process that started this node's ranks, made anew for each
launch; a follower uses only a place of its own instance, and checks
every field of the record before it uses one. Emulated nodes
(``MPISTAGE_EMULATE_NODES``) meet at a place of their own each. The place
is ``<candidate>/mpistage-<uid>/boot-<launch>.<node>`` in the first
staging candidate that passes the safe-directory rules of
:mod:`~mpistage.node.place` (no candidate squatted by another user; a
follower refuses a place that is not this user's own, 0700, no symlink). A
follower checks that the mark names its own launch and that it runs the
same interpreter with the same paths; it uses nothing else.

The place is guarded like a node's place (:mod:`~mpistage.node.cleanup`:
removed on every exit path by the first rank, by its watchdog when it is
killed, and reaped by a later job when all that failed), and the first rank
reaps its user's dead places before making its own.

``MPISTAGE_BOOT=no`` turns it off; ``MPISTAGE_BOOT_WAIT`` is how long a
follower waits for its first rank (seconds, default :data:`WAIT`). This
module runs before MPI in every rank, so it is read the cheap way
(:func:`mpistage.load_local`) and imports nothing it does not need.
"""

import os as _os
import time as _time

from mpistage import NODE, Backoff, StageError, read_fd
from mpistage.node.imports import (
    FILES,
    RECORD,
    VERSION,
    Declined,
    bad_shape,
    entry_modules,
    identity,
)
from mpistage.node.launch import instance, launch, place_name
from mpistage.settings import SETTINGS

WAIT = SETTINGS["MPISTAGE_BOOT_WAIT"].default  # seconds a follower waits
POLL_MIN, POLL_MAX = 0.001, 0.05  # seconds between a follower's looks
CLAIM_TRIES, CLAIM_PAUSE = 200, 0.005  # looks at a place of the same name, pause
FAILED = "failed"  # the first rank's reason, when it could not finish
READ_FLAGS = _os.O_RDONLY | _os.O_NOFOLLOW | _os.O_CLOEXEC


class Boot:
    """How this rank started: its role, why, and where it met its node."""

    def __init__(self):
        self.role, self.reason, self.path = "normal", None, None
        self.seconds = self.waited = 0.0
        self.root = None  # the first rank's guarded place
        self.copies, self.bypassed = None, []  # what /proc/self/maps shows

    def facts(self):
        """Return what the report says of this rank's start."""
        return {
            "role": self.role,
            "reason": self.reason,
            "seconds": round(self.seconds, 6),
            "waited": round(self.waited, 6),
            "place": self.path,
            "copies_mapped": self.copies,
            "originals_mapped": self.bypassed,
        }


state = Boot()  # this process's start


def import_mpi():
    """Import and return mpi4py's ``MPI`` module, the node boot's way.

    The caller has set ``sys.path`` for the import (:func:`mpistage.__main__.boot`).
    """
    from mpistage import load_local

    start = _time.perf_counter()
    load_local("mpistage.node", NODE)
    try:
        meeting = Meeting.find()
    except Declined as exc:
        state.reason = str(exc)
        return plain_import(start)
    try:
        first = meeting.claim()
    except Declined as exc:
        state.reason = str(exc)
        meeting.close()
        return plain_import(start)
    MPI = first_import(meeting, start) if first else follower_import(meeting, start)
    if state.path is not None:
        state.copies, state.bypassed = mapped_from(state.path)
    return MPI


def mapped_from(place):
    """Return (how many, which originals) of the shared objects mapped here.

    Counted from ``/proc/self/maps``, which is what the loader really did:
    the copies of the *place* mapped, and the originals mapped although
    the place holds their copy (the loader found them first, say through
    ``LD_LIBRARY_PATH``; the report names them).
    """
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return None, []
    paths = {parts[5].strip() for parts in fields if len(parts) == 6}
    shared = [p for p in paths if p.startswith("/") and ".so" in _os.path.basename(p)]
    copies = [p for p in shared if p.startswith(place + "/")]
    files = f"{place}/files"
    bypassed = sorted(p for p in shared if not p.startswith(place + "/")
                      and _os.path.exists(files + p))  # fmt: skip
    return len(copies), bypassed


def plain_import(start):
    """Import mpi4py the usual way (a rank with no usable copy)."""
    from mpi4py import MPI

    for name in entry_modules():
        __import__(name)
    state.seconds = _time.perf_counter() - start
    return MPI


def first_import(meeting, start):
    """Import mpi4py, leave it for the node, then start MPI (the first rank)."""
    from mpistage import load_local

    state.role, state.path, state.root = "first", meeting.path, meeting.root
    load_local("mpistage.node", ("imports", "elf", "originals", "copy"))
    from mpistage.node.copy import import_and_copy

    MPI = import_and_copy(meeting)
    state.seconds = _time.perf_counter() - start
    return MPI


def follower_import(meeting, start):
    """Import mpi4py from the first rank's copy, or as usual if it cannot be used."""
    try:
        record = meeting.wait(meeting.seconds)
    except Declined as exc:
        state.reason, state.waited = str(exc), _time.perf_counter() - start
        meeting.close()
        return plain_import(start)
    state.waited = _time.perf_counter() - start
    state.role, state.path = "copy", meeting.path
    MPI = serve(meeting.path, record)
    meeting.close()
    state.seconds = _time.perf_counter() - start
    return MPI


def leave():
    """End the node boot in this process: the first rank removes the place."""
    if state.root is not None:
        from mpistage.node.cleanup import release

        release(state.root)
        state.root = None


def facts():
    """Return this rank's start for the report."""
    return state.facts()


def original(path):
    """Return the original of a file this rank loaded from its node's copy.

    Other paths are returned as they are. What records a program's files
    (``--auto``, ``mpistage record``) names the originals, as a plain run
    would have.
    """
    if state.path is None:
        return path
    prefix = f"{state.path}/{FILES}/"
    return path[len(prefix) - 1 :] if path.startswith(prefix) else path


# -- settings -------------------------------------------------------------------


def wait_seconds():
    """How long a follower waits (``MPISTAGE_BOOT_WAIT``, seconds)."""
    from mpistage.settings import get

    return get("MPISTAGE_BOOT_WAIT")


# -- the meeting place ---------------------------------------------------------------


class Meeting:
    """This node's meeting place for this launch, in the first usable candidate."""

    def __init__(self, launch, name, candidate_fd, user_fd, path):
        self.launch, self.name, self.path = launch, name, path
        self.instance = None  # the launcher's process that started our ranks
        self.candidate_fd, self.user_fd = candidate_fd, user_fd
        self.fd = self.root = None
        self.made = False  # this rank made the place (it may remove it)
        self.seconds = WAIT  # how long a follower waits here

    @classmethod
    def find(cls):
        """Return the meeting place of this rank, or raise :class:`Declined`."""
        from mpistage.settings import get

        try:
            if not get("MPISTAGE_BOOT"):
                raise Declined("turned off (MPISTAGE_BOOT=no)")
            name = launch()
            if name is None:
                raise Declined("no launcher tells which ranks share this node")
            started_by = instance()
            if started_by is None:
                raise Declined("no launcher process started this rank")
            seconds = wait_seconds()
            meeting = cls.open(name, place_name(name))
            meeting.seconds, meeting.instance = seconds, started_by
            return meeting
        except StageError as exc:
            raise Declined(str(exc)) from None

    @classmethod
    def open(cls, launch_name, name):
        """Open this user's directory in the first candidate that allows it."""
        from mpistage.node.place import candidates, open_safe, own_dir

        refused = []
        for candidate in candidates():
            try:
                real, fd = open_safe(candidate)
            except (StageError, OSError) as exc:
                refused.append(str(exc) if isinstance(exc, StageError) else candidate)
                continue
            user = f"mpistage-{_os.getuid()}"
            try:
                user_fd = own_dir(fd, user, f"{real}/{user}")
            except (StageError, OSError) as exc:
                _os.close(fd)
                refused.append(str(exc) if isinstance(exc, StageError) else real)
                continue
            return cls(launch_name, name, fd, user_fd, f"{real}/{user}/{name}")
        raise Declined("no place to meet: " + "; ".join(refused or ["none given"]))

    def claim(self):
        """Create the place; return whether this rank is the first (then it owns it)."""
        from mpistage.node.cleanup import reap_dead_roots

        for _ in range(CLAIM_TRIES):
            reap_dead_roots(self.candidate_fd)
            try:
                self.make()
                return True
            except FileExistsError:
                if self.to_follow():
                    return False
                # A dead launch's place of the same name, going away under a
                # sibling's reaping, or one a sibling is just making: look again.
                _time.sleep(CLAIM_PAUSE)
            except FileNotFoundError:
                self.forget()  # a sibling's reaping of the dead place took ours
            except OSError as exc:
                if self.made:
                    self.give_back()
                raise Declined(f"cannot use {self.path!r}: {exc.strerror}") from None
        return False  # the follower's checks decide about what is there

    def make(self):
        """Make the place, guard it and write its owner record (the first rank)."""
        from mpistage.node.cleanup import guard
        from mpistage.node.place import DIR_FLAGS, NodePlace, write_owner

        self.made = False
        _os.mkdir(self.name, 0o700, dir_fd=self.user_fd)
        self.made = True
        self.fd = _os.open(self.name, DIR_FLAGS, dir_fd=self.user_fd)
        self.root = NodePlace(self.path, self.fd, _os.dup(self.user_fd))
        guard(self.root)
        write_owner(self.root, self.owner_job(), kind="boot")

    def owner_job(self):
        """The owner record's job: the launch and its instance on this node."""
        return f"{self.launch}@{self.instance}"

    def to_follow(self):
        """Whether the place that exists is one to follow rather than wait out.

        It is, if a rank of this host that is alive owns it, and also if it
        is not plainly ours (the follower's checks then refuse it in one
        line). A place with no owner yet (a sibling is making it), or a dead
        one's (being reaped), or gone already, is looked at again.
        """
        from mpistage.node.cleanup import alive
        from mpistage.node.place import DIR_FLAGS, check_own, read_owner

        try:
            fd = _os.open(self.name, DIR_FLAGS, dir_fd=self.user_fd)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        try:
            st = _os.fstat(fd)
            check_own(st, self.path, True)
            owner = read_owner(fd) if st.st_nlink else None
        except StageError:
            return True
        except OSError:
            return False
        finally:
            _os.close(fd)
        here = bool(owner) and owner.get("host") == _os.uname().nodename
        return here and alive(owner.get("pid"), owner.get("start"))

    def forget(self):
        """Let go of a place that is gone already: stop guarding, close, no removal.

        Its name may be a sibling's new place by now.
        """
        from mpistage.node.cleanup import disarm

        if self.root is not None:
            disarm(self.root)
            self.root.close()
        elif self.fd is not None:
            _os.close(self.fd)
        self.root = self.fd = None

    def give_back(self):
        """Remove a place this rank made and cannot use (its followers see it go)."""
        from mpistage.node.cleanup import release, remove_entry

        if self.root is not None:
            release(self.root)
        else:
            remove_entry(self.user_fd, self.name)
        self.root = self.fd = None

    def wait(self, seconds):
        """Wait for the first rank's mark; return its record, or raise Declined."""
        deadline, pauses = _time.monotonic() + seconds, Backoff(POLL_MIN, POLL_MAX)
        self.fd = self.open_place()
        while True:
            record = self.read_record()
            if record is not None:
                return self.check(record)
            self.check_first()
            if _time.monotonic() >= deadline:
                raise Declined(
                    f"waited {seconds:g} s for the node's first rank "
                    "(MPISTAGE_BOOT_WAIT)"
                )
            pauses.sleep()

    def open_place(self):
        """Open the place the first rank made; refuse one that is not ours alone."""
        from mpistage.node.place import check_own, open_dir

        try:
            fd = open_dir(self.user_fd, self.name, self.path)
        except StageError as exc:
            raise Declined(str(exc)) from None
        try:
            check_own(_os.fstat(fd), self.path, True)
        except StageError as exc:
            _os.close(fd)
            raise Declined(str(exc)) from None
        return fd

    def read_record(self):
        """Return the first rank's record if it is there and ours, else None."""
        import marshal
        import stat

        try:
            fd = _os.open(RECORD, READ_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Declined(f"cannot read the record: {exc.strerror}") from None
        try:
            st = _os.fstat(fd)
            if st.st_uid != _os.getuid() or not stat.S_ISREG(st.st_mode):
                raise Declined(f"{self.path}/{RECORD} is not this user's file")
            data = read_fd(fd, st.st_size)
        finally:
            _os.close(fd)
        try:
            return marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            raise Declined(f"{self.path}/{RECORD} is unreadable") from None

    def check_first(self):
        """Decline at once if the first rank gave up, or is gone."""
        from mpistage.node.cleanup import alive
        from mpistage.node.place import read_fields, read_owner

        if _os.fstat(self.fd).st_nlink == 0:
            raise Declined("the node's first rank gave its place up")
        failed = read_fields(self.fd, FAILED)
        if failed:
            raise Declined("the node's first rank failed: " + failed.get("reason", "?"))
        owner = read_owner(self.fd)
        if owner and owner.get("host") == _os.uname().nodename:
            if not alive(owner.get("pid"), owner.get("start")):
                raise Declined(
                    f"the node's first rank (pid {owner.get('pid')}) ended before "
                    "its copy was complete"
                )

    def check(self, record):
        """Return *record* if it is of this launch and interpreter, else decline.

        Every field is checked before any is used: a record of the wrong
        shape is a decline, never an error.
        """
        if not isinstance(record, dict) or record.get("version") != VERSION:
            raise Declined(f"{self.path}/{RECORD} is of another mpistage version")
        wrong = bad_shape(record)
        if wrong:
            raise Declined(f"{self.path}/{RECORD} {wrong}")
        if (record["launch"], record["instance"]) != (self.launch, self.instance):
            other = f"{record['launch']}@{record['instance']}"
            raise Declined(f"{self.path} is of another launch ({other!r})")
        if record.get("identity") != identity():
            raise Declined(
                "the node's first rank runs another interpreter, or other paths"
            )
        return record

    def fail(self, reason):
        """Tell the followers to import as usual (the first rank, best effort)."""
        from mpistage.node.place import write_fields

        try:
            write_fields(self.fd, FAILED, {"reason": reason}, _os.O_CREAT | _os.O_EXCL)
        except OSError:
            pass

    def close(self):
        """Close the descriptors a follower holds (the first rank's stay guarded)."""
        for fd in (self.candidate_fd, self.user_fd, None if self.root else self.fd):
            if fd is not None:
                _os.close(fd)
        self.candidate_fd = self.user_fd = None
        if self.root is None:
            self.fd = None


# -- a follower imports from the copy --------------------------------------------


def serve(place, record):
    """Import ``mpi4py.MPI`` with the recorded modules served from *place*."""
    from mpistage import load_local

    load_local("mpistage.node", ("imports",))
    from mpistage.node.imports import Server

    server = Server(place, record)
    server.install()
    try:
        from mpi4py import MPI

        for name in entry_modules():
            __import__(name)
    finally:
        server.remove()
    return MPI
