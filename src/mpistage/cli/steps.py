"""The steps of ``mpistage run``: stage, run, clean, each a launch of its own.

A step is a child process (the launcher); SIGINT and SIGTERM that reach
``mpistage run`` are passed on to it (:class:`Signals`), and whatever ends
the run, the clean step runs. A stage step's failure is said once, in the
step's own words when it has them (:func:`copy_errors`).
"""

import os as _os
import signal as _signal
import subprocess as _subprocess
import sys as _sys

from mpistage import StageError


def describe(command):
    """A launch as a shell line, for messages (scripts and arguments cut short)."""
    import shlex

    if "stage" in command:
        command = [*command[: command.index("stage") + 1], "..."]
    return shlex.join(["..." if "\n" in w else w for w in command])


class Steps:
    """The stage, run and clean steps of one ``mpistage run``, on every exit path."""

    def __init__(self, plan, signals):
        self.plan, self.signals = plan, signals

    def run(self):
        """Stage, run, clean; return the exit status."""
        try:
            status = self.stage_then_run()
        finally:
            cleaned = self.plan.args.keep or self.clean()
        return status if cleaned else status or 1

    def stage_then_run(self):
        """The stage step, then (unless it failed or a signal came) the run step."""
        plan = self.plan
        status = self.stage()
        if self.signals.received:
            return self.interrupted("stage")
        if status:
            return 1
        env = plan.run_environ()
        status = self.step(plan.run_command(env), "run", env)
        return self.interrupted("run") if self.signals.received else status

    def stage(self):
        """Run the stage step's launches in turn; return the first failure's status."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mpistage-run-") as scratch:
            env = owned(self.plan.launch.step_environ(), self.plan.args.keep)
            for command in self.plan.stage_commands(scratch):
                said = []
                status = self.step(command, "stage", env, said=said)
                if status or self.signals.received:
                    if status and not self.signals.received:
                        error(said[0] if said else (
                            f"the stage step failed (exit status {status}): "
                            f"{describe(command)}"
                        ))  # fmt: skip
                    return status
        return 0

    def interrupted(self, name):
        """Say which signal ended the *name* step; return 128 + its number."""
        signum = self.signals.received
        error(f"{_signal.Signals(signum).name} during the {name} step; cleaning up")
        return 128 + signum

    def clean(self):
        """The clean step; whether it succeeded (it says why not)."""
        try:
            command, env = self.plan.clean_command(), self.plan.launch.step_environ()
            status = self.step(command, "clean", env, forward=False)
        except StageError as exc:
            error(exc)
            return False
        self.plan.clean_parent()
        if status:
            error(
                f"the clean step failed (exit status {status}): {self.plan.folder!r} "
                "may remain on some nodes (`mpistage clean DIR` on each removes it)"
            )
        return not status

    def step(self, command, name, env=None, forward=True, said=None):
        """Run one launch, passing SIGINT and SIGTERM on; return its status.

        The run step gets SIGTERM for either: launchers pass it to the ranks,
        which then end without a Python traceback (SIGINT would make each
        rank print its ``KeyboardInterrupt``, and Hydra its own banner).
        With *said*, the step's ``mpistage: error:`` lines are kept there, not
        printed, so that a failure is said once, in one line.
        """
        if name != "clean" and self.signals.received:
            return 128 + self.signals.received
        pipe = None if said is None else _subprocess.PIPE
        try:
            child = _subprocess.Popen(
                command, env=env, stdout=stdout(name), stderr=pipe
            )
        except OSError as exc:
            raise StageError(
                f"cannot start the {name} step {command[0]!r}: {exc.strerror}"
            ) from None
        copier = None if said is None else copy_errors(child.stderr, said)
        send = _signal.SIGTERM if name == "run" else None
        with self.signals.passing_to(child if forward else None, send=send):
            status = exit_status(child.wait())
        if copier is not None:
            copier.join()
        return status


def copy_errors(stream, said):
    """Copy *stream* to stderr as it comes, keeping back its error lines.

    A step's ``mpistage: error:`` line is the same on every rank: each is
    kept in *said* once, for the run to say once. Returns the thread.
    """
    import threading

    prefix = "mpistage: error: "

    def copy():
        with stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\n")
                if not line.startswith(prefix):
                    print(line, file=_sys.stderr, flush=True)
                elif line[len(prefix) :] not in said:
                    said.append(line[len(prefix) :])

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def owned(env, keep):
    """*env* (or this environment) with the stage's owner: this ``mpistage run``.

    The stage marker records it, so that the next stage step on a node, or
    ``mpistage clean``, can tell a stage whose job ended without its clean
    step (:mod:`mpistage.runtime.envreap`).
    """
    from mpistage.node.cleanup import started

    env = dict(_os.environ if env is None else env)
    owner = f"{_os.uname().nodename}:{_os.getpid()}:{started()}"
    env["MPISTAGE_RUN_OWNER"] = owner
    env["MPISTAGE_RUN_KEEP"] = "yes" if keep else ""
    return env


def children(pid):
    """The pids of the children of *pid* (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class Signals:
    """SIGINT and SIGTERM while ``mpistage run`` runs: noted, passed on to a step."""

    SIGNALS = (_signal.SIGINT, _signal.SIGTERM)

    def __init__(self):
        self.received, self.saved, self.targets, self.send = None, {}, None, None

    def __enter__(self):
        for sig in self.SIGNALS:
            self.saved[sig] = _signal.signal(sig, self.note)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            _signal.signal(sig, handler)

    def note(self, signum, frame):
        """Remember the first signal; pass it on to the running step."""
        self.received = self.received or signum
        self.forward(signum)

    def forward(self, signum):
        """Send *signum* (or the step's own choice) to the running step, if any."""
        for pid in self.targets() if self.targets else ():
            try:
                _os.kill(pid, self.send or signum)
            except ProcessLookupError:
                pass

    def passing_to(self, child, targets=None, send=None):
        """A context in which signals go to *child* (or to ``targets()``).

        *send*, if given, is the signal passed on instead of the one received.
        """
        return Passing(self, child, targets, send)


class Passing:
    """Signals pass to one child for the time of a ``with`` block."""

    def __init__(self, signals, child, targets, send=None):
        self.signals, self.send = signals, send
        if child is not None:
            self.targets = targets or (lambda: [child.pid])
        else:
            self.targets = None

    def __enter__(self):
        self.signals.targets, self.signals.send = self.targets, self.send
        if self.targets and self.signals.received:
            self.signals.forward(self.signals.received)  # came while starting it
        return self

    def __exit__(self, *exc):
        self.signals.targets = self.signals.send = None


def exit_status(returncode):
    """A shell's exit status for a child's return code (killed by N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def stdout(name):
    """The stage and clean steps' stdout is ours; the run step's, the user's."""
    return _subprocess.DEVNULL if name in ("stage", "clean") else None


def error(message):
    """Print one ``mpistage: error:`` line."""
    print(f"mpistage: error: {message}", file=_sys.stderr, flush=True)
