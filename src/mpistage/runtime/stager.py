"""``mpistage stage BUNDLE --to DIR [--print-env]``: an environment, once per node.

Run under the launcher with any number of ranks per node, for example
``srun --ntasks-per-node=1 mpistage stage env.mpistage --to /dev/shm/env``.
It is the distribution pipeline (:func:`mpistage.runtime.stage.stage`) with
``DIR`` as the place: rank 0 reads the bundle once, the bytes go to one
leader per node, and each leader extracts them into ``DIR`` (``{node}`` in
``DIR`` becomes the node's index, for emulated nodes on one machine). Then
``DIR/bin/python`` runs with everything node-local.

``DIR`` follows the safe-directory rule of :mod:`mpistage.node.place`. A
non-empty ``DIR`` is refused unless it is a stage of the same bundle: a
complete one is reused as it is, an interrupted one is refused with the
hint to clean it (``mpistage clean DIR``). Like the runner, the stager runs
in every rank at start-up, so it parses its options by hand and imports
nothing it does not need.
"""

import os as _os
import sys as _sys

from mpistage import StageError
from mpistage.runtime.envreap import MARKER, dead, read_marker
from mpistage.runtime.stage import Place

# What a node-side extraction imports (the Slurm stage step's extractor,
# mpistage-env's), as paths below the package: they travel with it.
NODE_MODULES = (
    "__init__", "settings", "node/__init__", "node/launch", "node/place",
    "node/cleanup", "runtime/__init__", "runtime/bundlefile", "runtime/read",
    "runtime/extract", "runtime/roots", "runtime/stager", "runtime/stage",
    "runtime/collective", "runtime/broadcast", "runtime/bulk",
    "runtime/envreap",
    "runtime/topology",
)  # fmt: skip
NODE = "{node}"  # in DIR: the node's index, for emulated nodes on one machine
UNSET = ("PYTHONHOME", "PYTHONPATH")  # a staged environment is a plain prefix
USAGE = """\
usage: mpistage stage BUNDLE --to DIR [--print-env] [--token TOKEN] [--trust]

Unpack an environment bundle (mpistage pack --env) into node-local DIR, once
per node; run it under mpiexec, srun or flux run.

  --to DIR      node-local directory ({node} becomes the node index)
  --print-env   print only the shell lines that put it to use, for eval
  --token TOKEN the token of the `mpistage run` this stage step is part of:
                a DIR this step makes is marked with it, for its clean step
  --trust       stage the bundle even if the environment it was packed from
                changed since (it is a snapshot; by default that is refused)"""


def parse(argv):
    """Return (bundle, DIR, print_env, token, trust) from *argv*."""
    args, bundle, folder, print_env, token = list(argv), None, None, False, ""
    trust = False
    while args:
        arg = args.pop(0)
        opt, eq, value = arg.partition("=")
        if arg in ("-h", "--help"):
            print(USAGE)
            _sys.exit(0)
        elif opt == "--to":
            folder = value if eq else (args.pop(0) if args else None)
        elif arg == "--print-env":
            print_env = True
        elif arg == "--trust":
            trust = True
        elif opt == "--token":
            token = value if eq else (args.pop(0) if args else "")
        elif arg.startswith("-") or bundle is not None:
            usage_error(f"stage: unexpected argument {arg!r}")
        else:
            bundle = arg
    if not bundle or not folder:
        usage_error("stage: give BUNDLE and --to DIR")
    return bundle, folder, print_env, token, trust


def node_dir(template, index):
    """Return the directory for node *index* (``{node}`` replaced)."""
    return _os.path.abspath(template.replace(NODE, str(index)))


def per_node(template):
    """Whether *template* names one directory per emulated node (``{node}``)."""
    return NODE in template


class TargetPlace(Place):
    """The stager's place: ``DIR`` itself, empty or a stage of this bundle.

    The stage marker says who made what (:func:`made_fields`): the *token*
    of the ``mpistage run`` whose stage step this is, the real path of
    ``DIR``, and whether the step made ``DIR`` itself or only filled an
    existing one. A stage reused as it is keeps its maker's fields: the
    clean step of a run removes only what that run made. A stage whose run
    ended here is never reused: its clean step may have been cut short
    (the marker goes last, so it still says "complete"); it is emptied and
    staged again, and this run's clean step removes it.
    """

    def __init__(self, folder, token=""):
        self.folder, self.token = folder, token

    def make(self, digest, footprint):
        """Open ``DIR`` safely; mark it as being staged, or as reusable.

        A ``DIR`` this call made is removed again if it ends before the
        marker is written (a refusal, SIGINT): no clean step could tell it
        from a directory of someone else's.
        """
        from mpistage.node.place import target_dir

        root = target_dir(self.folder)
        try:
            return self.claim(root, digest, footprint)
        except BaseException:  # A refusal, or a signal before the marker.
            unmade(root)
            raise

    def claim(self, root, digest, footprint):
        """Reuse ``DIR``'s stage of this bundle, or mark it as being staged.

        *digest* is the bundle's identity, its manifest's SHA-256.
        """
        from mpistage.node.place import room

        reap_beside(root)
        marker = read_marker(root.fd)
        if reusable(marker, digest):
            root.marks = made_fields(marker)  # its maker's, not this run's
            if owner_changed(marker):  # this job's from now on, for the reaper
                write_marker(root.fd, digest, "complete", root.marks)
            root.reused = True
            return root
        made = "dir" if root.made else "contents"
        if _os.listdir(root.fd):
            if not emptied_if_dead(root, marker):
                root.close()
                raise StageError(busy_message(self.folder, marker))
            made = marker.get("made", "contents")  # the dead stage's maker's
        root.marks = {"token": self.token, "path": root.path, "made": made}
        room(root.fd, self.folder, footprint)
        write_marker(root.fd, digest, "incomplete", root.marks)
        return root

    def retry(self, root):
        """``DIR`` is the user's choice: no other candidate is tried."""
        return False

    def done(self, root, digest):
        """Mark the stage complete."""
        write_marker(root.fd, digest, "complete", root.marks)

    def discard(self, root):
        """Undo a failed stage: remove a ``DIR`` it made, else empty it."""
        from mpistage.node.cleanup import empty, remove

        if root.reused:
            root.close()
        elif root.made:
            remove(root)
        else:
            empty(root.fd)
            root.close()


def unmade(root):
    """Remove ``DIR`` if this process made it and it is still empty; close it."""
    if root.made and root.parent_fd is not None:
        try:
            _os.rmdir(root.name, dir_fd=root.parent_fd)
        except OSError:
            pass  # It holds something: the marker, or what another wrote.
    if root.fd is not None:
        root.close()


def reusable(marker, digest):
    """Whether ``DIR``'s stage, with *marker*, is a whole stage of this bundle.

    A stage of a run that ended here may be half removed: never reused.
    """
    if marker.get("sha256") != digest or marker.get("state") != "complete":
        return False
    return not dead(marker)


def made_fields(marker):
    """The fields of a stage marker that say who made the stage, and what."""
    return {k: marker[k] for k in ("token", "path", "made") if k in marker}


def owner_changed(marker):
    """Whether *marker* names another owner than this process's job and run."""
    from mpistage.runtime.envreap import owner_fields

    return any(marker.get(k, "") != v for k, v in owner_fields().items())


def reap_beside(root):
    """Remove the dead default-named stages beside ``DIR`` (crash-only cleanup)."""
    from mpistage.runtime.envreap import reap

    try:
        reap(root.parent_fd, skip={_os.path.basename(root.path)})
    except OSError:
        pass  # A directory that changes under us: `mpistage clean` remains.


def emptied_if_dead(root, marker):
    """Empty ``DIR`` if it holds a stage of a job that ended here; whether it did."""
    from mpistage.node.cleanup import empty

    if not marker or not dead(marker):
        return False
    empty(root.fd)
    return True


def busy_message(folder, marker):
    """Say why a non-empty ``DIR`` is refused."""
    if marker:
        return (
            f"{folder!r} holds an interrupted or different stage; remove it with "
            f"`mpistage clean {folder}` and stage again"
        )
    return (
        f"{folder!r} is not empty and is not a stage of this bundle; choose an "
        "empty or new directory (`mpistage clean DIR` removes an earlier stage)"
    )


def write_marker(fd, digest, state, marks=None):
    """Write the stage marker atomically (a new temporary file, then a rename).

    *marks* are the maker's fields (:func:`made_fields`).
    """
    from mpistage.node.place import write_fields
    from mpistage.runtime.envreap import owner_fields

    tmp = f"{MARKER}.{_os.getpid()}"
    fields = {"sha256": digest, "state": state, **owner_fields(), **(marks or {})}
    write_fields(fd, tmp, fields, _os.O_CREAT | _os.O_EXCL)
    _os.rename(tmp, MARKER, src_dir_fd=fd, dst_dir_fd=fd)


def staged_environ(folder, environ, libraries=True):
    """Return *environ* changed to run the environment staged in *folder*.

    ``PATH`` and (when libraries from outside the environment were
    bundled) ``LD_LIBRARY_PATH`` gain the staged directories first;
    ``PYTHONNOUSERSITE`` keeps Python out of ``~/.local`` on the shared FS;
    ``PYTHONHOME`` and ``PYTHONPATH`` go. This is the one description of it:
    :func:`env_lines` prints it, ``mpistage run`` applies it.
    """
    folder = _os.path.abspath(folder)
    env = {k: v for k, v in environ.items() if k not in UNSET}
    env["PATH"] = join_path(f"{folder}/bin", environ.get("PATH"))
    if libraries:
        env["LD_LIBRARY_PATH"] = join_path(
            f"{folder}/lib", environ.get("LD_LIBRARY_PATH")
        )
    env["PYTHONNOUSERSITE"] = "1"
    return env


def join_path(first, rest):
    """Return the search path *first*, then *rest* (if any)."""
    return f"{first}:{rest}" if rest else first


def env_lines(folder, manifest):
    """Return :func:`staged_environ` as shell lines, for ``eval``."""
    folder = _os.path.abspath(folder)
    lines = [f'export PATH="{folder}/bin:$PATH"']
    if manifest.get("env", {}).get("libraries"):
        keep = "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        lines.append(f'export LD_LIBRARY_PATH="{folder}/lib{keep}"')
    return [*lines, "export PYTHONNOUSERSITE=1", f"unset {' '.join(UNSET)}"]


def stage_env(world, bundle, template, token="", trust=False):
    """Stage the environment *bundle* on every node; return (DIR, manifest, reused).

    Unless *trust*, rank 0 first checks that the environment the bundle was
    packed from has not changed since (:mod:`mpistage.runtime.envfresh`).
    """
    from mpistage.runtime import stage
    from mpistage.runtime.collective import attempt
    from mpistage.runtime.topology import discover

    topo = attempt(world, discover, world)
    folder = node_dir(template, topo.index)
    check = None if trust else lambda manifest: fresh_verdict(bundle, manifest)
    place = TargetPlace(folder, token)
    staged = stage.stage(topo, bundle, place, kind="env", check=check)
    reused = staged.root.reused if staged.root else None
    reused = world.gather(reused, root=0)
    if staged.root is not None:
        staged.root.close()
    return folder, staged.manifest, reused


def fresh_verdict(bundle, manifest):
    """Rank 0: the refusal of a stale environment bundle, or ``None``."""
    from mpistage.runtime.envfresh import verdict

    return verdict(bundle, manifest)


def stage_here(bundle, folder, token=""):
    """Stage the environment in the local file *bundle* into *folder*, without MPI.

    One node alone: the Slurm stage step's extractor, after ``sbcast``
    brought the bundle (:mod:`mpistage.cli.slurmstage`). The checks and the
    place are those of ``mpistage stage``; the bytes go from the file to
    the copy in one pass. Returns whether *folder* held a complete stage of
    the bundle already.
    """
    from mpistage.runtime.read import open_bundle
    from mpistage.runtime.stage import unpack_here

    source = open_bundle(bundle, "env")
    try:
        root = unpack_here(source, TargetPlace(folder, token), bundle)
    finally:
        source.close()
    root.close()
    return root.reused


def main_here(argv):
    """``python STAGE.pyz BUNDLE DIR [TOKEN]``: :func:`stage_here`; the exit status."""
    try:
        bundle, folder, *token = argv
        if len(token) > 1:
            raise ValueError(argv)
        stage_here(bundle, folder, *token)
    except (StageError, ValueError) as exc:
        node = _os.environ.get("SLURMD_NODENAME") or _os.uname().nodename
        reason = exc if isinstance(exc, StageError) else f"give BUNDLE DIR, not {argv}"
        print(f"mpistage: error: on {node}: {reason}", file=_sys.stderr, flush=True)
        return 1
    return 0


def summary(bundle, template, reused, out=1, err=2):
    """Return the line that says what was staged, for stderr.

    It announces the shell lines that follow on stdout only when stdout is
    where stderr goes: ``mpistage run`` discards the stage step's stdout,
    and a line ending in "to use it:" and nothing after would puzzle.
    """
    done = [r for r in reused if r is not None]
    line = f"staged {bundle} into {template} on {len(done)} node(s) "
    line += f"({sum(done)} already staged)"
    try:
        same = _os.path.samestat(_os.fstat(out), _os.fstat(err))
    except OSError:
        same = False
    return line + ("; to use it:" if same else "")


def usage_error(message):
    """A usage error: one line and the usage, exit status 2 (as every command)."""
    from mpistage.node.launch import usage_error as refuse

    refuse(message, USAGE)


def main(world, argv):
    """Run ``mpistage stage``; return the exit status."""
    from mpistage import settings
    from mpistage.node.launch import emulated_nodes
    from mpistage.runtime.collective import attempt

    try:
        bundle, template, print_env, token, trust = parse(argv)
        attempt(world, settings.check, world.size, emulated_nodes)  # every rank
        folder, manifest, reused = stage_env(world, bundle, template, token, trust)
    except StageError as exc:
        if world.rank == 0:
            print(f"mpistage: error: {exc}", file=_sys.stderr, flush=True)
        return 1
    if world.rank == 0:
        if not print_env:
            print(summary(bundle, template, reused), file=_sys.stderr, flush=True)
        print("\n".join(env_lines(folder, manifest)), flush=True)
    return 0
