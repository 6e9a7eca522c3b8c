"""``mpistage data DIR... --to FOLDER``: directories once per node, for a later step.

Run under the launcher with any number of ranks per node, as ``mpistage
stage`` is: ``srun --ntasks-per-node=1 mpistage data /ckpt --to
/dev/shm/ckpt``. Rank 0 reads each ``DIR`` once, the files travel as one
stream per ``DIR`` to one leader per node (:func:`mpistage.data.dirs.
stage_agreed`), and each leader writes them into ``FOLDER/<name of DIR>``
(``{node}`` in ``FOLDER`` becomes the node's index, for emulated nodes).
The copies outlive this step: ``mpistage run --data`` runs it as its stage
step, and its clean step removes ``FOLDER``.

``FOLDER`` follows the safe-directory rule of :mod:`mpistage.node.place`
and must be new or empty. Its stage marker (``.mpistage-stage``, as
``mpistage stage`` writes it) says who made it: the token of the
``mpistage run`` whose step this is, for its clean step, and the owner
fields by which a later job, or ``mpistage clean``, removes it when its
job died (:mod:`mpistage.runtime.envreap`).
"""

import os as _os
import sys as _sys

from mpistage import StageError

USAGE = """\
usage: mpistage data DIR [DIR ...] --to FOLDER [--include GLOB ...] [--token TOKEN]

Copy each directory DIR (a model checkpoint) once per node into node-local
FOLDER/<name of DIR>, read once per job; run it under mpiexec, srun or flux
run. It prints the line that sets MPISTAGE_DATA_DIR, for eval.

  --to FOLDER     node-local directory, new or empty ({node} becomes the
                  node index)
  --include GLOB  copy only the files that match (repeat for several)
  --token TOKEN   the token of the `mpistage run` this step is part of"""


def parse(argv):
    """Return (dirs, FOLDER, include, token) from *argv*."""
    from mpistage.node.launch import usage_error

    args, dirs, folder, include, token = list(argv), [], None, [], ""
    while args:
        arg = args.pop(0)
        opt, eq, value = arg.partition("=")
        if arg in ("-h", "--help"):
            print(USAGE)
            _sys.exit(0)
        elif opt in ("--to", "--include", "--token"):
            value = value if eq else (args.pop(0) if args else "")
            if not value:
                usage_error(f"data: {opt} needs a value", USAGE)
            if opt == "--to":
                folder = value
            elif opt == "--include":
                include.append(value)
            else:
                token = value
        elif arg.startswith("-"):
            usage_error(f"data: unexpected argument {arg!r}", USAGE)
        else:
            dirs.append(arg)
    if not dirs or not folder:
        usage_error("data: give DIR and --to FOLDER", USAGE)
    return dirs, folder, include or None, token


def local_paths(folder, dirs):
    """The node-local path of each of *dirs* in *folder*; refuse a name twice."""
    from mpistage.data.trees import base_name

    names = [base_name(d) for d in dirs]
    for name in names:
        if names.count(name) > 1:
            raise StageError(
                f"two directories named {name!r}: their copies would be the "
                "same FOLDER/{name}; stage them in two steps"
            )
    return [f"{folder.rstrip('/')}/{name}" for name in names]


def joined(paths):
    """The value of ``MPISTAGE_DATA_DIR`` for *paths*: ``:``-separated."""
    return _os.pathsep.join(paths)


class TargetPlace:
    """``FOLDER`` as the place of every node's copies: new or empty, marked.

    The first tree of a step claims it (creates it 0700 if needed, refuses
    one that holds anything, writes the stage marker "incomplete"); the
    next trees go beside the first. :meth:`finish` marks it complete. A
    failure removes a ``FOLDER`` this step made, or empties one it found.
    """

    def __init__(self, template, token=""):
        self.template, self.token, self.root = template, token, None

    def make(self, tree, node, room):
        """Return ``FOLDER`` (claimed by the first tree), with room for *tree*."""
        from mpistage.node.place import room as check_room

        if self.root is None:
            self.root = self.claim(node)
        check_room(self.root.fd, self.root.path, room)
        return self.root

    def claim(self, node):
        """Open or create this node's ``FOLDER``, empty; mark it as being made."""
        from mpistage.node.place import target_dir
        from mpistage.runtime.stager import node_dir, unmade, write_marker

        folder = node_dir(self.template, node)
        root = target_dir(folder)
        try:
            if _os.listdir(root.fd):
                raise StageError(
                    f"{folder!r} is not empty; choose a new or empty directory "
                    "(`mpistage clean DIR` removes an earlier stage)"
                )
            made = "dir" if root.made else "contents"
            root.marks = {"token": self.token, "path": root.path, "made": made}
            write_marker(root.fd, "data", "incomplete", root.marks)
        except BaseException:
            unmade(root)
            raise
        return root

    def done(self, root, tree):
        """One tree is in ``FOLDER``."""

    def discard(self, root):
        """Undo the step: remove a ``FOLDER`` it made, else empty it."""
        from mpistage.node.cleanup import empty, remove

        if root.made:
            remove(root)
        else:
            empty(root.fd)
            root.close()
        self.root = None

    def release(self, root):
        """The copies stay for the next step: nothing to remove here."""

    def finish(self):
        """Mark ``FOLDER`` complete and let go of it (leaders)."""
        from mpistage.runtime.stager import write_marker

        if self.root is not None:
            write_marker(self.root.fd, "data", "complete", self.root.marks)
            self.root.close()


def stage_all(world, dirs, template, include, token):
    """Stage each of *dirs* into this node's ``FOLDER``; return the node's paths."""
    from mpistage.data.dirs import fspath, stage_agreed
    from mpistage.data.steps import same_everywhere
    from mpistage.data.trees import check_include
    from mpistage.runtime.collective import attempt

    dirs = [attempt(world, fspath, d) for d in dirs]
    include = attempt(world, check_include, include)
    given = (("dirs", repr(dirs)), ("to", repr(template)), ("include", repr(include)))
    attempt(world, same_everywhere, world, given)
    attempt(world, local_paths, template, dirs)
    place, copies = TargetPlace(template, token), []
    try:
        for folder in dirs:
            copies.append(stage_agreed(world, folder, include, place=place))
    except StageError:
        if place.root is not None:
            place.discard(place.root)
        raise
    finally:
        for copy in copies:
            copy.close()
    place.finish()
    return [copy.path for copy in copies]


def summary(dirs, template):
    """The line that says what was staged, for stderr.

    It announces the shell line that follows on stdout only when stdout is
    where stderr goes (``mpistage run`` discards the step's stdout), as
    ``mpistage stage`` says it.
    """
    line = f"staged {', '.join(dirs)} into {template}"
    try:
        same = _os.path.samestat(_os.fstat(1), _os.fstat(2))
    except OSError:
        same = False
    return line + ("; to use it:" if same else "")


def main(world, argv):
    """Run ``mpistage data``; return the exit status."""
    from mpistage import settings
    from mpistage.node.launch import emulated_nodes
    from mpistage.runtime.collective import attempt

    try:
        dirs, template, include, token = parse(argv)
        attempt(world, settings.check, world.size, emulated_nodes)
        stage_all(world, dirs, template, include, token)
    except StageError as exc:
        if world.rank == 0:
            print(f"mpistage: error: {exc}", file=_sys.stderr, flush=True)
        return 1
    if world.rank == 0:
        print(summary(dirs, template), file=_sys.stderr, flush=True)
        paths = joined(local_paths(template, dirs))
        print(f'export MPISTAGE_DATA_DIR="{paths}"', flush=True)
    return 0
