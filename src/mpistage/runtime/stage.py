"""The distribution pipeline: one read per job, one copy per node.

"Stage" means this, everywhere in mpistage: rank 0 reads the bundle and
checks it (:mod:`~mpistage.runtime.read`), the bytes go to one leader per
node (:mod:`~mpistage.runtime.broadcast`), each leader extracts them into a
safe directory (:mod:`~mpistage.node.place`,
:mod:`~mpistage.runtime.extract`), and every rank agrees on each step. The
runner, :func:`mpistage.staged` and ``mpistage stage`` all call
:func:`stage`; they differ only in where the copy goes (a *place*).
"""

from mpistage import StageError
from mpistage.runtime.broadcast import share
from mpistage.runtime.collective import attempt


class Staged:
    """A node's copy, as every rank of the node knows it."""

    def __init__(self, path, manifest, nbytes, root=None):
        self.path, self.manifest, self.nbytes = path, manifest, nbytes
        self.root = root  # the place.NodePlace, on the node's leader only


class Place:
    """Where a node's copy goes: what the pipeline asks of it, on each leader.

    :func:`leader_extract` calls :meth:`make` for a directory to extract
    into, then :meth:`done`; on a full file system :meth:`retry` says
    whether to make another, and on any failure :meth:`discard` takes the
    directory away. A place may hand back a directory that already holds
    this bundle (``reused``): nothing is extracted into it.
    """

    def make(self, buf, footprint):
        """Return a :class:`~mpistage.node.place.NodePlace` for the bundle *buf*."""
        raise NotImplementedError

    def retry(self, root):
        """*root*'s file system is full: return whether to make another."""
        return False

    def done(self, root, buf):
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

    def make(self, buf, footprint):
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

    def done(self, root, buf):
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
    """Rank 0 reads and checks the bundle; return (bytes, manifest) there.

    *check*, if given, runs on rank 0 with the manifest and returns a
    verdict (``None`` when all is well); the verdict is returned on every
    rank as the third value. Other ranks get ``(None, None, verdict)``.
    """
    from mpistage.runtime.read import read_checked

    def on_rank0():
        if comm.rank != 0:
            return None, None, None
        buf, manifest = read_checked(path, kind)
        return buf, manifest, (check(manifest) if check else None)

    buf, manifest, verdict = attempt(comm, on_rank0)
    return buf, manifest, share(comm, verdict)


def distribute(topo, buf, manifest, place, name):
    """Broadcast the checked bundle to the leaders, extract, agree; return Staged."""
    buf, manifest = send(topo, buf, manifest)
    return settle(topo, buf, manifest, place, name)


def send(topo, buf, manifest):
    """Broadcast the bytes and the checked manifest to every leader (agreed)."""
    from mpistage.runtime.broadcast import broadcast

    def on_leader(data, checked):
        if not topo.is_leader:
            return None, None
        return broadcast(topo.leaders, data), share(topo.leaders, checked)

    return attempt(topo.world, on_leader, buf, manifest)


def settle(topo, buf, manifest, place, name):
    """Leaders extract into their place (agreed); every rank learns where it is."""
    holder = []
    try:
        attempt(topo.world, leader_extract, topo, buf, manifest, place, name, holder)
    except StageError:
        for root in holder:
            place.discard(root)
        raise
    nbytes = len(buf) if buf is not None else 0
    path, manifest, nbytes = share(
        topo.node, (holder[0].path, manifest, nbytes) if topo.is_leader else None
    )
    return Staged(path, manifest, nbytes, holder[0] if holder else None)


def leader_extract(topo, buf, manifest, place, name, holder):
    """On a leader: make the place and extract into it, trying again if full."""
    from mpistage.runtime.extract import Footprint, NoSpace, extract

    if not topo.is_leader:
        return
    footprint = Footprint(manifest)
    while True:
        root = place.make(buf, footprint)
        if root.reused:
            holder.append(root)
            return
        try:
            extract(root.fd, buf, manifest, name, root.path)
            place.done(root, buf)
        except NoSpace as exc:
            place.discard(root)
            if not place.retry(root):
                raise StageError(f"{exc} in {root.path!r}") from None
            continue
        except BaseException:
            place.discard(root)
            raise
        holder.append(root)
        return


def stage(topo, path, place, kind="packages", check=None):
    """Read, check, broadcast and extract the bundle at *path*; return Staged.

    *check*, as for :func:`read`: a verdict it returns is raised on every rank.
    """
    buf, manifest, verdict = read(topo.world, path, kind, check)
    if verdict:
        raise StageError(verdict)
    return distribute(topo, buf, manifest, place, path)


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
