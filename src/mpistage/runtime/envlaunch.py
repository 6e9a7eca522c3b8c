"""The extraction of ``mpistage-env``: one process per node, the node's own Python.

``mpistage-env BUNDLE -- COMMAND`` (``bin/mpistage-env``, a POSIX ``sh``
script) starts in every rank. Per node, the rank whose ``mkdir`` of the
claim ``DIR.in`` succeeds runs the node's own ``/usr/bin/python3`` (``-E -s
-S``: no ``PYTHON*`` variables, no site directories) with the script's
boot code, which opens the bundle once, reads its header and manifest and
takes this module, and the few it needs, from the manifest (``pack --env``
puts them there, :mod:`mpistage.bundle.envboot`): nothing of the shared
environment is opened but the bundle. :func:`main` then checks the bundle
and unpacks it into ``DIR`` from the open file, piece by piece, as
``mpistage stage`` does (:class:`TargetPlace`: the same
safe-directory rule, marker and crash-only reaping of dead stages beside
it). The node's other ranks wait for the marker to say ``complete`` and
never read the bundle.

Outside a scheduler's job, and for a launcher's copy of a self-extracting
bundle, the copy belongs to the launch on this node (the ranks' parent:
``hydra_pmi_proxy``, ``orted``, ``mpirun``, ``slurmstepd``): the script's
watchdog, in a session of its own, removes ``DIR`` and its claim once that
process has ended. In a job, the copy serves the job's later launches with
the same bundle and goes when a launch on the node finds the job ended.
"""

import os as _os
import sys as _sys

from mpistage import StageError

FAILED, LAUNCH, LIBRARIES = "failed", "launch", "libraries"  # files in DIR.in
KEPT = ("spread", "spread_ino")  # the claim's fields the script wrote, kept


def main(source, argv):
    """Unpack the bundle *source* names; return the exit status (0 or 1).

    *source* is ``(fd, start)``: the bundle's file, opened once by the boot
    code, and where the bundle starts in it (a self-extracting one's bytes
    follow a script). *argv*: the bundle's path, ``DIR``, the claim
    ``DIR.in``, the node's name for messages, the launch's owner
    ``host:pid:start`` outside a job (else empty), and the launcher's copy
    of a self-extracting bundle that goes with the launch's copy (else
    empty; the script's watchdog removes it).
    """
    bundle, folder, claim, node, owner, _spread = argv
    try:
        extract_here(source, bundle, folder, claim, owner)
    except (StageError, OSError, MemoryError) as exc:
        from mpistage.runtime.collective import describe

        return failed(claim, f"mpistage-env: error: on {node}: {describe(exc)}")
    return 0


def extract_here(source, bundle, folder, claim, owner):
    """Check the bundle and unpack it into *folder*, in one pass.

    The bytes go from the file to the copy piece by piece, hashed as they
    are read (:func:`mpistage.runtime.stage.flow`): no buffer of the
    bundle's size. A checksum that does not match leaves no copy.
    """
    from mpistage.runtime.read import open_bundle

    if owner:
        _os.environ["MPISTAGE_RUN_OWNER"] = owner  # the stage marker's owner
    fd, start = source
    opened = open_bundle(bundle, "env", fd=fd, base=start)
    try:
        unpack(opened, bundle, folder, claim)
    finally:
        opened.close()


def unpack(opened, bundle, folder, claim):
    """Unpack the open, checked bundle *opened* into *folder* (``TargetPlace``)."""
    from mpistage.runtime.extract import Footprint
    from mpistage.runtime.stage import Head, flow
    from mpistage.runtime.stager import TargetPlace

    head = Head(opened)
    mark_claim(claim, head.digest)
    place = TargetPlace(folder)
    root = place.make(head.digest, Footprint(head.manifest))
    if root.reused:
        root.close()
        return
    try:
        flow(None, opened, head, bundle, root)
        if head.manifest.get("env", {}).get("libraries"):
            write_file(claim, LIBRARIES, "yes\n")
        place.done(root, head.digest)
    except BaseException:
        mark_failed(root, head.digest)
        raise
    root.close()


def mark_claim(claim, digest):
    """Give the claim an owner record: the next launch reaps it if we die.

    The fields the script wrote that only it knows (the launcher's copy
    that goes with the claim) are kept.
    """
    from mpistage.node.place import DIR_FLAGS
    from mpistage.runtime.envreap import read_marker
    from mpistage.runtime.stager import write_marker

    fd = _os.open(claim, DIR_FLAGS)
    try:
        kept = {k: v for k, v in read_marker(fd).items() if k in KEPT}
        write_marker(fd, digest, "claim", kept)
    finally:
        _os.close(fd)


def mark_failed(root, digest):
    """Empty a failed ``DIR`` and mark it, so that the reaper can judge it."""
    from mpistage.node.cleanup import empty
    from mpistage.runtime.stager import write_marker

    try:
        empty(root.fd)
        write_marker(root.fd, digest, "failed")
    except OSError:
        pass  # What is left has no marker: `mpistage clean DIR` removes it.
    root.close()


def failed(claim, line):
    """Say *line*, and leave it in the claim for the node's waiting ranks."""
    print(line, file=_sys.stderr, flush=True)
    try:
        write_file(claim, FAILED, line + "\n")
    except OSError:
        pass  # The waiting ranks see the claimer gone, and say so.
    return 1


def write_file(claim, name, text):
    """Write *text* to *name* in the claim directory, atomically, no symlink."""
    from mpistage.node.place import DIR_FLAGS

    fd = _os.open(claim, DIR_FLAGS)
    try:
        tmp = f"{name}.{_os.getpid()}"
        flags = _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_NOFOLLOW
        out = _os.open(tmp, flags | _os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            _os.write(out, text.encode())
        finally:
            _os.close(out)
        _os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        _os.close(fd)
