"""The distribution pipeline: one read per job, one copy per node, one pass.

"Stage" means this, everywhere in mpistage: rank 0 opens the bundle and
checks its manifest (:mod:`~mpistage.runtime.read`), the manifest goes to
one leader per node, each leader makes its place
(:mod:`~mpistage.node.place`), then the bytes flow from the bundle's file
to every node's copy in one pass (:func:`mpistage.runtime.broadcast.stream`):
rank 0 reads each piece, the leaders receive it, hash it (each its share of
the members, :class:`~mpistage.runtime.read.Checksums`) and write it
straight into the members' files (:class:`~mpistage.runtime.extract.Writer`).
The checksums' verdict is agreed before any copy is marked done, so
nothing unchecked is ever run; a failure anywhere removes every copy. The
runner, :func:`mpistage.staged`, ``mpistage stage`` and ``mpistage-env``
all call it; they differ only in where the copy goes (a *place*).
"""

import time as _time

from mpistage import StageError
from mpistage.runtime.broadcast import share
from mpistage.runtime.collective import attempt

RETRY = "retry"  # a leader's copy filled its file system: try another place
STOPPED = "stopped"  # a leader stopped because another failed


class Staged:
    """A node's copy, as every rank of the node knows it."""

    def __init__(self, path, manifest, nbytes, root=None):
        self.path, self.manifest, self.nbytes = path, manifest, nbytes
        self.root = root  # the place.NodePlace, on the node's leader only


class Head:
    """What the leaders know of the bundle before its bytes: all they need.

    The checked manifest, its SHA-256 (the bundle's identity, from the
    header), the file's size and the span of the members' data.
    """

    def __init__(self, bundle):
        self.manifest, self.digest = bundle.manifest, bundle.digest
        self.size, self.span = bundle.size, bundle.span


class Place:
    """Where a node's copy goes: what the pipeline asks of it, on each leader.

    :func:`fill` calls :meth:`make` for a directory to extract into, then
    :meth:`done` once the copy is whole and agreed; on a full file system
    :meth:`retry` says whether to make another, and on any failure
    :meth:`discard` takes the directory away. A place may hand back a
    directory that already holds this bundle (``reused``): nothing is
    extracted into it.
    """

    def make(self, digest, footprint):
        """Return a :class:`~mpistage.node.place.NodePlace` for the bundle *digest*."""
        raise NotImplementedError

    def retry(self, root):
        """*root*'s file system is full: return whether to make another."""
        return False

    def done(self, root, digest):
        """The bundle is in *root*."""

    def discard(self, root):
        """Take *root* away after a failure."""
        raise NotImplementedError


class JobPlace(Place):
    """The runner's place: a fresh per-job root in the first usable candidate.

    The root is guarded (:mod:`~mpistage.node.cleanup`) as soon as it
    exists, before its owner record and the first member are written. A
    candidate that fills up while the bundle is written is passed over and
    the next one tried. With *keep*, the root outlives the job.
    """

    def __init__(self, tag, node, keep=False):
        self.tag, self.node, self.keep, self.full = tag, node, keep, []

    def make(self, digest, footprint):
        """Create, guard and return this node's place."""
        from mpistage.node.cleanup import guard
        from mpistage.node.place import make_root, write_owner

        root = make_root(self.tag, self.node, footprint, skip=self.full, reap=reap)
        guard(root)
        write_owner(root, self.tag)
        return root

    def retry(self, root):
        """Note that *root*'s candidate is full; return ``True`` to try another."""
        self.full.append(root.path.rsplit("/", 2)[0])
        return True

    def done(self, root, digest):
        """A kept root is no longer guarded, and says so for ``mpistage clean``."""
        from mpistage.node.cleanup import disarm
        from mpistage.node.place import mark_kept

        if self.keep:
            disarm(root)
            mark_kept(root)

    def discard(self, root):
        """Remove a failed or unused job root."""
        from mpistage.node.cleanup import release

        release(root)


def read(comm, path, kind, check=None):
    """Rank 0 opens the bundle and checks its manifest; return (bundle, verdict).

    The bundle (:class:`~mpistage.runtime.read.Bundle`, open) is rank 0's;
    other ranks get ``None``. *check*, if given, runs on rank 0 with the
    manifest and returns a verdict (``None`` when all is well), returned on
    every rank; with a verdict, the bundle is closed again.
    """
    from mpistage.runtime.read import open_bundle

    def on_rank0():
        if comm.rank != 0:
            return None, None
        bundle = open_bundle(path, kind)
        try:
            verdict = check(bundle.manifest) if check else None
        except BaseException:
            bundle.close()
            raise
        if verdict:
            bundle.close()
        return bundle, verdict

    bundle, verdict = attempt(comm, on_rank0)
    return bundle, share(comm, verdict)


def distribute(topo, bundle, place, name, clock=None):
    """Bring rank 0's open, checked *bundle* to every node's copy; return Staged.

    Collective over the world. *clock*, a dict, gains the seconds of the
    ``broadcast`` (the bytes' one pass) and ``stage`` (places made and
    marked done) steps. The bundle is closed at the end, whatever happens.
    """
    try:
        head = timed(clock, "broadcast", send_head, topo, bundle)
        return settle(topo, bundle, head, place, name, clock)
    finally:
        if bundle is not None:
            bundle.close()


def send_head(topo, bundle):
    """Send the bundle's :class:`Head` to every leader (agreed); ``None`` elsewhere."""

    def on_leader():
        if not topo.is_leader:
            return None
        return share(topo.leaders, Head(bundle) if bundle is not None else None)

    return attempt(topo.world, on_leader)


def settle(topo, bundle, head, place, name, clock=None):
    """Leaders make their places and fill them (agreed); every rank learns where."""
    holder = []
    try:
        while True:
            timed(clock, "stage", attempt, topo.world, make, topo, head, place, holder)
            outcome = timed(
                clock,
                "broadcast",
                attempt,
                topo.world,
                fill,
                topo,
                bundle,
                head,
                place,
                name,
                holder,
            )
            if not agreed_retry(topo, outcome, place, holder):
                break
        timed(clock, "stage", attempt, topo.world, mark_done, topo, head, place, holder)
    except StageError:
        for root in holder:
            place.discard(root)
        raise
    path, manifest, nbytes = share(
        topo.node, (holder[0].path, head.manifest, head.size) if holder else None
    )
    return Staged(path, manifest, nbytes, holder[0] if holder else None)


def make(topo, head, place, holder):
    """On a leader: make the node's place for the bundle."""
    from mpistage.runtime.extract import Footprint

    if topo.is_leader:
        holder.append(place.make(head.digest, Footprint(head.manifest)))


def fill(topo, bundle, head, place, name, holder):
    """Stream the bytes into every leader's place; return how it ended there.

    ``None`` (whole, or nothing was needed), ``RETRY`` (the place filled
    up; another is to be tried) or ``STOPPED`` (another leader failed and
    says why in the agreement). Every leader checks its share of the
    checksums; the verdict is part of the agreement that ends this step.
    """
    from mpistage.runtime.collective import first_failure
    from mpistage.runtime.extract import NoSpace

    if not topo.is_leader:
        return None
    root = holder[0]
    if first_failure(topo.leaders, not root.reused) is None:
        return None  # Every node holds this bundle already: no bytes needed.
    try:
        complete = flow(topo.leaders, bundle, head, name, root)
    except NoSpace as exc:
        if place.retry(root):
            return RETRY
        raise StageError(f"{exc} in {root.path!r}") from None
    return None if complete else STOPPED


def flow(leaders, bundle, head, name, root):
    """One pass of the bytes into *root* (*leaders* ``None``: this process alone).

    Rank 0 reads (a thread); every leader checks its share of the members'
    checksums (a thread) and writes the members into its copy (a thread).
    Returns whether every piece arrived (``False``: another leader failed,
    and says why in the agreement).
    """
    from mpistage.runtime.broadcast import stream
    from mpistage.runtime.extract import Writer
    from mpistage.runtime.read import Checksums

    start, end = head.span
    index, count = (leaders.rank, leaders.size) if leaders else (0, 1)
    checks = Checksums(head.manifest, name, index, count)
    writer = None if root.reused else Writer(root.fd, head.manifest, name, root.path)
    take = [lambda offset, view: checks.update(start + offset, view)]
    if writer is not None:
        take.append(lambda offset, view: writer.write(start + offset, view))

    def read(offset, view):
        bundle.fill(start + offset, view)

    try:
        complete = stream(
            leaders, end - start, read if bundle is not None else None, take
        )
        if complete:
            checks.verdict(end)
            if writer is not None:
                writer.finish(end)
    finally:
        if writer is not None:
            writer.close()
    return complete


def unpack_here(bundle, place, name):
    """This process alone brings the open *bundle* into *place*; return the root.

    No MPI: the file's bytes go to the copy in the same one pass, read,
    hashed and written on threads of their own. A failure takes the copy
    away (:meth:`Place.discard`).
    """
    from mpistage.runtime.extract import Footprint

    head = Head(bundle)
    root = place.make(head.digest, Footprint(head.manifest))
    if root.reused:
        return root
    try:
        flow(None, bundle, head, name, root)
        place.done(root, head.digest)
    except BaseException:
        place.discard(root)
        raise
    return root


def agreed_retry(topo, outcome, place, holder):
    """Whether some leader's place was full and all try again (agreed).

    Then every leader takes its copy away, all before any makes a new one
    (their room checks must not count the old copies), and the full ones
    try another place (:meth:`Place.retry`): the bytes are sent again to
    all.
    """
    from mpistage.runtime.collective import first_failure

    again = first_failure(topo.world, outcome == RETRY) is not None
    if not again and first_failure(topo.world, outcome == STOPPED) is not None:
        raise StageError("the bundle's bytes stopped on the way")  # never expected
    if again:
        attempt(topo.world, discard, place, holder)
    return again


def discard(place, holder):
    """Take this leader's copy away (if any)."""
    while holder:
        place.discard(holder.pop())


def mark_done(topo, head, place, holder):
    """On a leader: the copy is whole and agreed; the place says so."""
    if topo.is_leader and not holder[0].reused:
        place.done(holder[0], head.digest)


def timed(clock, step, func, *args):
    """Run *func*, adding its seconds to *clock*'s *step* (if *clock*)."""
    begun = _time.perf_counter()
    try:
        return func(*args)
    finally:
        if clock is not None:
            clock[step] = clock.get(step, 0.0) + _time.perf_counter() - begun


def stage(topo, path, place, kind="packages", check=None):
    """Read, check, broadcast and extract the bundle at *path*; return Staged.

    *check*, as for :func:`read`: a verdict it returns is raised on every rank.
    """
    bundle, verdict = read(topo.world, path, kind, check)
    if verdict:
        raise StageError(verdict)
    return distribute(topo, bundle, place, path)


def reap(candidate_fd):
    """Remove this user's leftovers of ended jobs in a candidate: node places,
    and environment copies (``mpistage-env``, ``mpistage run``) that a job
    killed at its time limit left, gigabytes each at GPU size.
    """
    from mpistage.node.cleanup import reap_dead_roots
    from mpistage.runtime.envreap import reap as reap_copies

    reap_dead_roots(candidate_fd)
    try:
        reap_copies(candidate_fd)
    except OSError:
        pass  # A directory that changes under us: `mpistage clean` remains.
