"""``mpistage run --env BUNDLE --data DIR -- LAUNCHER ... python APP``: one command.

Users write their launch line as always; ``mpistage run`` turns it into
the launches of the environment path (docs/stage.md), and with ``--data``
(docs/data.md) it copies directories (a model checkpoint) once per node for
the program, which finds them in ``MPISTAGE_DATA_DIR``:

1. the stage step, exactly one task on each node of the job:
   ``(one per node) python ENV/bin/mpistage stage BUNDLE --to DIR``, started
   with the ``python`` of the command (the shared environment, where
   mpistage is installed) and the ``mpistage`` command beside it (``python
   -m mpistage`` when there is none: it costs ``runpy``'s imports); in a
   Slurm allocation, ``sbcast`` and a node-local extractor instead, which
   start no Python from the shared file system
   (:mod:`mpistage.cli.slurmstage`); with ``--data``, one more launch,
   ``(one per node) python ENV/bin/mpistage data DIR... --to DIR.data``
   (:mod:`mpistage.data.command`): rank 0 reads each directory once;
2. the run step: the command itself, with its ``python`` replaced by
   ``DIR/bin/python`` and the environment ``mpistage stage`` prints
   (``PATH``, ``LD_LIBRARY_PATH``, no ``PYTHONPATH``), and
   ``MPISTAGE_DATA_DIR`` naming the copies of ``--data``;
3. the clean step, unless ``--keep``: ``(one per node) /bin/sh`` removing
   ``DIR`` (:data:`mpistage.cli.clean.REMOVE_STAGE`), which starts nothing
   from the shared file system. It removes only what this run made: the
   stage step writes this run's token (:attr:`Plan.token`, random) into
   the stage marker of a ``DIR`` it makes, and the clean step checks it.
   It runs on every exit path: after the run step, after a failed or
   interrupted stage step, after SIGINT or SIGTERM (passed on to the step
   that runs, then the next steps are skipped). Its own failure makes the
   exit status nonzero.

How a launcher starts one task per node is :mod:`mpistage.cli.launchers`.
``srun`` outside an allocation first makes one, with ``salloc`` and the
command's allocation options, and runs ``mpistage run`` inside it, so that
the three steps share their nodes.
"""

import os as _os
import subprocess as _subprocess
import sys as _sys

from mpistage import StageError
from mpistage.cli import slurmstage
from mpistage.cli.launchers import emulated
from mpistage.cli.steps import Signals, Steps, children, exit_status
from mpistage.runtime.stager import NODE, node_dir, per_node


def parser():
    """Return the argument parser of ``mpistage run``."""
    from mpistage.cli import argument_parser

    p = argument_parser(
        prog="mpistage run",
        usage="mpistage run (--env BUNDLE | --data DIR ...) [--to DIR] [--keep] "
        "[--trust] -- LAUNCHER [ARG ...] python [APP ARG ...]",
        description="Stage an environment bundle and/or data directories once "
        "per node, run the command from them, and clean up: the launches as "
        "one command.",
    )
    p.add_argument("--env", metavar="BUNDLE", help="pack --env bundle")
    p.add_argument(
        "--data",
        action="append",
        metavar="DIR",
        help="copy DIR (a model checkpoint) once per node, read once per job; "
        "the run step finds it in $MPISTAGE_DATA_DIR (repeat for several: "
        "':'-separated paths; the copies go in DIR.data beside --to's DIR)",
    )
    p.add_argument(
        "--to",
        metavar="DIR",
        help="node-local directory (default: /dev/shm/mpistage-env-UID-JOB.PID.RANDOM; "
        "{node} becomes the node index)",
    )
    p.add_argument("--keep", action="store_true", help="keep DIR after the run")
    p.add_argument(
        "--trust",
        action="store_true",
        help="run the bundle even if its environment changed since pack --env "
        "(refused by default: the bundle is a snapshot)",
    )
    p.add_argument(
        "--stage-launcher",
        metavar="CMD",
        help="the command that starts one task per node, for the stage and "
        "clean steps (default: derived from the launcher)",
    )
    p.add_argument("command", nargs="+", help="the launch line, after --")
    return p


def main(argv):
    """Run ``mpistage run``; return the run step's exit status."""
    p = parser()
    args = p.parse_args(argv)
    if not args.env and not args.data:
        p.error("give --env BUNDLE, --data DIR, or both")
    plan = Plan(args)
    outer = plan.launch.allocation()
    if outer is None and args.env and not args.trust:
        check_fresh(plan.bundle, args.env)  # else the run inside salloc checks
    with Signals() as signals:
        if outer is not None:
            return in_allocation(outer, argv, signals, plan.launch.step_environ())
        return Steps(plan, signals).run()


def check_fresh(bundle, name):
    """Refuse an environment bundle whose environment changed since it was packed.

    Here, once, in the process that launches the job: the manifest, a stat
    per watched directory (:mod:`mpistage.runtime.envfresh`). The stage
    step then skips the check (``--trust``).
    """
    from mpistage.runtime.envfresh import verdict
    from mpistage.runtime.read import read_manifest

    found = verdict(name, read_manifest(bundle))
    if found:
        raise StageError(found)


class Plan:
    """The commands of one ``mpistage run``."""

    def __init__(self, args):
        from mpistage.cli.launchers import understand

        self.args = args
        self.launch = understand(args.command, args.stage_launcher)
        self.token = _os.urandom(16).hex()  # this run's: in what its stage step makes
        self.folder = args.to or default_dir()
        self.bundle = _os.path.abspath(args.env) if args.env else None
        self.slurm = bool(self.bundle) and not args.stage_launcher
        self.slurm = self.slurm and slurmstage.usable(self.launch, self.folder)
        self.data = [_os.path.abspath(d) for d in args.data or ()]
        self.data_folder = data_dir(self.folder) if self.data else None
        if self.data:
            from mpistage.data.command import local_paths

            local_paths(self.data_folder, self.data)  # refuses a name twice
        if per_node(self.folder) and not emulated():
            raise StageError(
                f"--to {self.folder!r}: {{node}} is for emulated nodes on one "
                "machine (MPISTAGE_EMULATE_NODES); real nodes each have their "
                "own DIR: give a plain one"
            )

    def stage_command(self):
        """``(one per node) python ENV/bin/mpistage stage BUNDLE --to DIR``."""
        stage = ["stage", self.bundle, "--to", self.folder, "--token", self.token]
        stage.append("--trust")  # checked once, by mpistage run (check_fresh)
        entry = command_beside(self.launch.python)
        return [*self.launch.stage_prefix(), self.launch.python, *entry, *stage]

    def data_command(self):
        """``(one per node) python ENV/bin/mpistage data DIR... --to DIR.data``."""
        data = ["data", *self.data, "--to", self.data_folder, "--token", self.token]
        entry = command_beside(self.launch.python)
        return [*self.launch.stage_prefix(), self.launch.python, *entry, *data]

    def stage_commands(self, scratch):
        """The launches of the stage step (Slurm: files for them go to *scratch*)."""
        data = [self.data_command()] if self.data else []
        if not self.bundle:
            return data
        if not self.slurm:
            return [self.stage_command(), *data]
        extractor = slurmstage.write_extractor(_os.path.join(scratch, "stage.pyz"))
        env = slurmstage.commands(
            self.launch, self.bundle, self.folder, extractor, self.token
        )
        return [*env, *data]

    def staged_python(self):
        """The command words that start this node's staged interpreter."""
        if not self.bundle:
            return [self.launch.python]
        if not per_node(self.folder):
            return [self.folder + "/bin/python"]
        path = self.folder.replace(NODE, node_index(self.launch.nodes()))
        libs = f'LD_LIBRARY_PATH="{path}/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"'
        return ["sh", "-c", f'{libs} exec "{path}/bin/python" "$@"', "python"]

    def run_command(self, env):
        """The command, its ``python`` replaced by the staged one."""
        names = ("PATH", "LD_LIBRARY_PATH", "PYTHONNOUSERSITE", "MPISTAGE_DATA_DIR")
        exported = [name for name in names if name in env]
        tail = self.launch.command[self.launch.python_at + 1 :]
        python = [*self.data_words(), *self.staged_python()]
        return [*self.launch.run_prefix(exported), *python, *tail]

    def data_paths(self, node=None):
        """``MPISTAGE_DATA_DIR``: the copies of ``--data`` (on emulated *node*)."""
        from mpistage.data.command import joined, local_paths

        folder = self.data_folder
        if node is not None:
            folder = folder.replace(NODE, node)
        return joined(local_paths(folder, self.data))

    def data_words(self):
        """With one ``DIR.data`` per emulated node: each rank's, set in its shell."""
        if not self.data or not per_node(self.data_folder):
            return []
        paths = self.data_paths(node_index(self.launch.nodes()))
        return ["sh", "-c", f'MPISTAGE_DATA_DIR="{paths}" exec "$@"', "python"]

    def run_environ(self):
        """The environment of the run step: the staged one (``stager.staged_environ``).

        With one directory per emulated node, each rank's own directory is
        put in place by :meth:`staged_python` instead.
        """
        from mpistage.runtime.stager import UNSET, staged_environ

        if not self.bundle:
            env = dict(_os.environ)
        elif not per_node(self.folder):
            env = staged_environ(self.folder, _os.environ)
        else:
            env = {k: v for k, v in _os.environ.items() if k not in UNSET}
            env["PYTHONNOUSERSITE"] = "1"
        if self.data and not per_node(self.data_folder):
            env["MPISTAGE_DATA_DIR"] = self.data_paths()
        return env

    def clean_command(self):
        """``(one per node) /bin/sh -c REMOVE_STAGE mpistage-clean TOKEN DIR``.

        Emulated nodes (``{node}`` in ``DIR``) share this machine: one
        shell, here, removes every node's directory.
        """
        from mpistage.cli.clean import REMOVE_STAGE

        shell = ["/bin/sh", "-c", REMOVE_STAGE, "mpistage-clean", self.token]
        folders = self.folders()
        if self.slurm:
            folders.append(slurmstage.inputs(self.folder))
        if not per_node(self.folder):
            return [*self.launch.per_node(), *shell, *folders]
        nodes = range(self.launch.nodes())
        return [*shell, *(node_dir(f, n) for f in folders for n in nodes)]

    def folders(self):
        """The node-local directories the stage step makes: ``DIR``, ``DIR.data``."""
        made = [self.folder] if self.bundle else []
        return made + ([self.data_folder] if self.data else [])

    def clean_parent(self):
        """Remove the parent of ``.../n{node}`` that the stage step made, if empty."""
        for folder in self.folders():
            parent = _os.path.dirname(folder)
            if per_node(folder) and not per_node(parent):
                try:
                    _os.rmdir(parent)
                except OSError:
                    pass  # Not empty, or never made: not ours to remove.


# python -c SAFE_START ARGS: mpistage ARGS with nothing from the start
# directory: -c (like -m) puts it first on sys.path, where others may write.
SAFE_START = "import sys; del sys.path[0]; from mpistage.__main__ import main; main()"


def command_beside(python):
    """How *python* starts mpistage: the ``mpistage`` command beside it, if any.

    The command finds the package with one look per ``sys.path`` entry;
    without it, :data:`SAFE_START` first pays ``runpy``'s and the package's
    imports from the shared file system, once per node of the stage step.
    Neither searches the start directory for mpistage's own modules
    (``python -m mpistage`` would: an ``mpistage.py`` planted there runs).
    """
    import shutil

    found = python if _os.sep in python else shutil.which(python)
    if found:
        command = _os.path.join(_os.path.dirname(_os.path.abspath(found)), "mpistage")
        if _os.path.isfile(command):
            return [command]
    return ["-c", SAFE_START]


def node_index(nodes):
    """A shell expression for a rank's emulated node, from its launcher's rank.

    Emulated nodes are contiguous rank blocks, as in
    :mod:`mpistage.runtime.topology`.
    """
    from mpistage.node.launch import RANK_VARS, SIZE_VARS

    rank, size = first_set(RANK_VARS, "0"), first_set(SIZE_VARS, "1")
    return f"$(({rank} * {nodes} / {size}))"


def first_set(names, default):
    """A shell expression: the first of the variables *names* that is set."""
    expression = default
    for name in reversed(names):
        expression = f"${{{name}:-{expression}}}"
    return expression


def in_allocation(salloc, argv, signals, env=None):
    """Run this ``mpistage run`` again inside an allocation ``salloc`` makes.

    ``salloc`` gives up the allocation when it gets SIGINT or SIGTERM, so
    they go to the ``mpistage run`` it started, which then cleans up.
    """
    python = _sys.executable
    command = [*salloc, python, *command_beside(python), "run", *argv]
    try:
        child = _subprocess.Popen(command, env=env)
    except OSError as exc:
        raise StageError(f"cannot start {salloc[0]!r}: {exc.strerror}") from None
    with signals.passing_to(child, lambda: children(child.pid) or [child.pid]):
        return exit_status(child.wait())


def data_dir(folder):
    """Where ``--data`` copies go: ``DIR.data`` beside the environment's ``DIR``.

    With ``DIR/n{node}`` (emulated nodes), ``DIR.data/n{node}``. The default
    name starts as the environment's does (``mpistage-env-UID-``), so a job
    that died before its clean step leaves nothing a later job's stage step
    or ``mpistage clean`` would not find (:mod:`mpistage.runtime.envreap`).
    """
    parent, name = _os.path.split(folder.rstrip("/"))
    if name == f"n{NODE}":
        return f"{parent}.data/{name}"
    return f"{folder.rstrip('/')}.data"


def default_dir():
    """``/dev/shm/mpistage-env-UID-JOB.PID.RANDOM`` (``{node}`` for emulated nodes).

    The pid of this ``mpistage run`` tells two runs of one job apart: each
    stages and removes its own copy, and neither waits for the other. The
    random part makes the name private, as the fallback of a node's place is
    (:func:`mpistage.node.place.private_dir`): another user cannot make
    it first and so stop the job.
    """
    from mpistage.node.launch import job_id
    from mpistage.node.place import RAM_DISK

    job = f"{job_id()}.{_os.getpid()}" if job_id() else str(_os.getpid())
    job += "." + _os.urandom(6).hex()
    base = RAM_DISK if _os.path.isdir(RAM_DISK) else _os.environ.get("TMPDIR", "/tmp")
    folder = f"{base}/mpistage-env-{_os.getuid()}-{job}"
    return f"{folder}/n{NODE}" if emulated() else folder
