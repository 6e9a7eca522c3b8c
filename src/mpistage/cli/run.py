"""``mpistage run --env BUNDLE -- LAUNCHER ... python APP ...``: two launches as one.

Users write their launch line as always; ``mpistage run`` turns it into
the two launches of the environment path (docs/stage.md):

1. the stage step, one rank per node: ``LAUNCHER (one task per node)
   python -m mpistage stage BUNDLE --to DIR``, started with the ``python``
   of the command (the shared environment, where mpistage is installed);
2. the run step: the command itself, with its ``python`` replaced by
   ``DIR/bin/python`` and the environment ``mpistage stage`` prints
   (``PATH``, ``LD_LIBRARY_PATH``, no ``PYTHONPATH``);
3. then, unless ``--keep``, ``mpistage clean DIR`` on every node, from the
   staged interpreter. SIGINT and SIGTERM are passed on to the running step;
   the clean step runs all the same.

How a launcher starts one task per node, for the stage and clean steps:

- ``srun``: ``srun --ntasks-per-node=1`` plus the command's ``-N``/``--nodes``;
- ``flux run``: ``flux run --tasks-per-node=1 -N NODES``;
- ``mpiexec``, ``mpirun`` (MPICH): ``mpiexec -n NODES -ppn 1`` plus the
  command's ``-hosts``/``-f``.

``NODES`` comes from the command, else ``SLURM_NNODES``, ``PBS_NUM_NODES``
or ``MPISTAGE_EMULATE_NODES``; ``--stage-launcher "CMD ..."`` replaces the
whole prefix for any other launcher (Open MPI: ``mpirun --map-by
ppr:1:node``).
"""

import os as _os
import shlex as _shlex
import signal as _signal
import subprocess as _subprocess

from mpistage import StageError

NODE_OPTIONS = {
    "srun": ("-N", "--nodes"),
    "flux": ("-N", "--nodes"),
    "mpiexec": ("-hosts", "--hosts", "-f", "-hostfile", "--hostfile", "-machinefile"),
}


def parser():
    """Return the argument parser of ``mpistage run``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="mpistage run",
        usage="mpistage run --env BUNDLE [--to DIR] [--keep] "
        "-- LAUNCHER [ARG ...] python [APP ARG ...]",
        description="Stage an environment bundle once per node, run the "
        "command from it, and clean up: the two launches as one command.",
    )
    p.add_argument("--env", required=True, metavar="BUNDLE", help="pack --env bundle")
    p.add_argument(
        "--to",
        metavar="DIR",
        help="node-local directory (default: /dev/shm/mpistage-env-UID-JOB; "
        "{node} becomes the node index)",
    )
    p.add_argument("--keep", action="store_true", help="keep DIR after the run")
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
    args = parser().parse_args(argv)
    plan = Plan(args)
    status = plan.step(plan.stage_command(), "stage")
    if status:
        raise StageError(f"the stage step failed (exit status {status})")
    try:
        return plan.step(plan.run_command(), "run", plan.run_environ())
    finally:
        if not args.keep:
            plan.step(plan.clean_command(), "clean")


class Plan:
    """The three launches of one ``mpistage run``."""

    def __init__(self, args):
        self.args, self.command = args, list(args.command)
        self.python_at = find_python(self.command)
        self.kind = launcher_kind(self.command[0])
        self.folder = args.to or default_dir()
        self.bundle = _os.path.abspath(args.env)

    def per_node(self):
        """The prefix that starts one task per node."""
        if self.args.stage_launcher:
            return _shlex.split(self.args.stage_launcher)
        launch = self.command[: self.python_at]
        return one_per_node(self.kind, launch)

    def stage_command(self):
        """``(per node) python -m mpistage stage BUNDLE --to DIR --print-env``."""
        python = self.command[self.python_at]
        stage = ["-m", "mpistage", "stage", self.bundle, "--to", self.folder]
        return [*self.per_node(), python, *stage, "--print-env"]

    def staged_python(self):
        """The command words that start this node's staged interpreter."""
        if "{node}" not in self.folder:
            return [self.folder + "/bin/python"]
        nodes = count_nodes(self.kind, self.command[: self.python_at])
        rank = "${PMI_RANK:-${SLURM_PROCID:-${FLUX_TASK_RANK:-0}}}"
        size = "${PMI_SIZE:-${SLURM_NTASKS:-${FLUX_JOB_SIZE:-1}}}"
        node = f"$(({rank} * {nodes} / {size}))"
        path = self.folder.replace("{node}", node)
        libs = f'LD_LIBRARY_PATH="{path}/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"'
        return ["sh", "-c", f'{libs} exec "{path}/bin/python" "$@"', "python"]

    def run_command(self):
        """The command, its ``python`` replaced by the staged one."""
        head, tail = self.command[: self.python_at], self.command[self.python_at + 1 :]
        return [*head, *self.staged_python(), *tail]

    def run_environ(self):
        """The environment ``mpistage stage --print-env`` describes."""
        env = {
            k: v
            for k, v in _os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME")
        }
        env["PYTHONNOUSERSITE"] = "1"
        if "{node}" not in self.folder:
            env["PATH"] = f"{self.folder}/bin:{env.get('PATH', '')}"
            lib = env.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = f"{self.folder}/lib" + (f":{lib}" if lib else "")
        return env

    def clean_command(self):
        """``(per node) python -m mpistage clean DIR`` from the shared interpreter.

        Emulated nodes (``{node}`` in ``DIR``) share this machine: one clean
        removes them all.
        """
        python = self.command[self.python_at]
        clean = [python, "-m", "mpistage", "clean", self.folder]
        return clean if "{node}" in self.folder else [*self.per_node(), *clean]

    def step(self, command, name, env=None):
        """Run one launch, passing SIGINT and SIGTERM on; return its status."""
        try:
            child = _subprocess.Popen(command, env=env, stdout=self.stdout(name))
        except OSError as exc:
            raise StageError(
                f"cannot start the {name} step {command[0]!r}: {exc.strerror}"
            ) from None
        with forwarded(child):
            return child.wait()

    def stdout(self, name):
        """The stage step's shell lines are ours; the run step's output, the user's."""
        return _subprocess.DEVNULL if name in ("stage", "clean") else None


class forwarded:
    """Pass SIGINT and SIGTERM on to *child* while it runs."""

    SIGNALS = (_signal.SIGINT, _signal.SIGTERM)

    def __init__(self, child):
        self.child, self.saved = child, {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self.saved[sig] = _signal.signal(sig, self.forward)
        return self

    def forward(self, signum, frame):
        """Send *signum* to the child."""
        self.child.send_signal(signum)

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            _signal.signal(sig, handler)


def find_python(command):
    """Return the index of the Python interpreter word in *command*."""
    import re

    for index, word in enumerate(command[1:], 1):
        if re.fullmatch(r"python(\d+(\.\d+)?)?", _os.path.basename(word)):
            return index
    raise StageError(
        "no python in the command: write it as `-- LAUNCHER ... python app.py`"
    )


def launcher_kind(word):
    """Return ``srun``, ``flux`` or ``mpiexec`` for the launcher *word*."""
    name = _os.path.basename(word)
    if name == "srun":
        return "srun"
    if name == "flux":
        return "flux"
    if name.startswith(("mpiexec", "mpirun")):
        return "mpiexec"
    raise StageError(
        f"unknown launcher {word!r}: give --stage-launcher 'CMD' that starts one "
        "task per node"
    )


def node_options(kind, launch):
    """Return the launcher options of *launch* that choose nodes."""
    names, kept = NODE_OPTIONS[kind], []
    for index, word in enumerate(launch):
        opt = word.split("=", 1)[0]
        if opt in names:
            kept.append(word)
            if "=" not in word and index + 1 < len(launch):
                kept.append(launch[index + 1])
    return kept


def count_nodes(kind, launch):
    """Return the number of nodes the launch runs on."""
    chosen = node_options(kind, launch)
    if kind in ("srun", "flux") and chosen:
        return int((chosen[0].split("=", 1) + chosen[1:])[1])
    if kind == "mpiexec" and chosen[:1] in (["-hosts"], ["--hosts"]):
        return len(chosen[1].split(","))
    for name in (
        "SLURM_NNODES",
        "FLUX_JOB_NNODES",
        "PBS_NUM_NODES",
        "MPISTAGE_EMULATE_NODES",
    ):
        if _os.environ.get(name, "").isdigit():
            return int(_os.environ[name])
    return 1


def one_per_node(kind, launch):
    """Return the command prefix that starts one task on each node."""
    chosen = node_options(kind, launch)
    if kind == "srun":
        return ["srun", "--ntasks-per-node=1", *chosen]
    nodes = str(count_nodes(kind, launch))
    if kind == "flux":
        return ["flux", "run", "--tasks-per-node=1", "-N", nodes]
    return [launch[0], "-n", nodes, "-ppn", "1", *chosen]


def default_dir():
    """``/dev/shm/mpistage-env-UID-JOB`` (``{node}`` added for emulated nodes)."""
    job = next(
        (
            _os.environ[n]
            for n in ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID")
            if _os.environ.get(n)
        ),
        str(_os.getpid()),
    )
    base = (
        "/dev/shm" if _os.path.isdir("/dev/shm") else _os.environ.get("TMPDIR", "/tmp")
    )
    folder = f"{base}/mpistage-env-{_os.getuid()}-{job.split('.')[0]}"
    return folder + "/n{node}" if _os.environ.get("MPISTAGE_EMULATE_NODES") else folder
