"""Crash-only cleanup of environment stages (``mpistage stage``, ``mpistage run``).

A job that reaches its time limit, or whose ``mpistage run`` is killed,
ends before its clean step: its ``DIR`` stays on every node. The stage
marker (``.mpistage-stage``) is its owner record: the host it was made on,
the scheduler's job, and the ``mpistage run`` (host and pid) that started
the stage step. A stage is dead when, on the host that holds it:

- its ``mpistage run`` ran on this host and is gone, or
- its Slurm job has no step on this node and Slurm says it has ended
  (``squeue``: unknown, or in a final state);
- its job of another scheduler (PBS, LSF, Flux: the marker's ``jobvar``)
  has no process left on this node: none carries the job's variable in
  its environment (a job's batch script and steps all do);

and nothing says otherwise. A stage kept with ``--keep``, one of another
host, or one with nothing to judge it by (``mpistage stage`` by hand, with
no scheduler) is never dead here: ``mpistage clean DIR`` removes it.

The next stage step on the node (:func:`reap`, from the stager's place)
and ``mpistage clean`` remove dead stages whose name is the default one,
``mpistage-env-UID-...`` in the same directory (with their ``.in``
inputs), and a dead stage found at the very ``DIR`` being staged.
"""

import os as _os

MARKER = ".mpistage-stage"  # a stage's marker and owner record
FINAL = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
         "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT")  # fmt: skip


def read_marker(fd):
    """Return the stage marker of the directory open as *fd* (``{}`` if none)."""
    from mpistage.node.place import read_fields

    return read_fields(fd, MARKER)


def owner_fields():
    """The owner fields of a stage marker made by this process."""
    from mpistage.node.launch import job_id, job_var
    from mpistage.settings import get

    return {
        "host": _os.uname().nodename,
        "job": job_id() or "",
        "jobvar": job_var(),
        "run": get("MPISTAGE_RUN_OWNER"),
        "keep": get("MPISTAGE_RUN_KEEP"),
    }


def dead(marker, kept_too=False):
    """Whether the stage with *marker* belongs to nothing that still runs here."""
    from mpistage.node.cleanup import alive

    if marker.get("host") != _os.uname().nodename:
        return False
    if marker.get("keep") == "yes" and not kept_too:
        return False
    host, _, pid = marker.get("run", "").rpartition(":")
    if host == _os.uname().nodename and alive(pid if pid.isdigit() else None):
        return False
    if marker.get("job"):
        return job_ended_here(marker["job"], marker.get("jobvar") or "SLURM_JOB_ID")
    return host == _os.uname().nodename  # its mpistage run, here, is gone


def job_ended_here(job, var):
    """Whether the scheduler's job *job* (named by *var*) has ended on this node."""
    if var != "SLURM_JOB_ID":
        return not job_in_environ(var, job)
    return not slurm_job_here(job) and slurm_job_ended(job)


def job_in_environ(var, job):
    """Whether a process on this host carries ``VAR=JOB`` (or ``JOB.…``) in its
    environment: only a scheduler's job of that id has one. Another user's
    processes cannot be read, and need not be: the stage is this user's.
    """
    want = f"{var}={job}".encode()
    for pid in _os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if any(e == want or e.startswith(want + b".") for e in entries):
            return True
    return False


def slurm_job_here(job):
    """Whether a step of Slurm job *job* runs on this node (its ``slurmstepd``)."""
    prefix = f"slurmstepd: [{job}.".encode()
    for pid in _os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read(len(prefix)) == prefix:
                    return True
        except OSError:
            continue
    return False


def slurm_job_ended(job):
    """Whether Slurm says *job* has ended (unknown to it, or in a final state).

    Without ``squeue``, or when it fails, nobody can tell: not ended.
    """
    import shutil
    import subprocess

    squeue = shutil.which("squeue")
    if squeue is None:
        return False
    try:
        done = subprocess.run(
            [squeue, "-h", "-j", job, "-o", "%T"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    states = done.stdout.split()
    if done.returncode != 0:
        return "Invalid job id" in done.stderr
    return all(state in FINAL for state in states)


def default_names(fd):
    """The default-named stages (``mpistage-env-UID-...``) in the directory *fd*."""
    prefix = f"mpistage-env-{_os.getuid()}-"
    return sorted(
        name for name in _os.listdir(fd)
        if name.startswith(prefix) and not name.endswith(".in")
    )  # fmt: skip


def stale(fd, name, kept_too=False):
    """Return the inode of the stage *name* below *fd* if it is dead, else ``None``."""
    from mpistage.node.place import DIR_FLAGS, check_own

    try:
        stage_fd = _os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return None
    try:
        st = _os.fstat(stage_fd)
        check_own(st, name, True)
        marker = read_marker(stage_fd)
    except Exception:
        return None  # not ours, or changing under us
    finally:
        _os.close(stage_fd)
    return st.st_ino if marker and dead(marker, kept_too) else None


def reap(fd, skip=(), kept_too=False, dry_run=False):
    """Remove the dead default-named stages in the directory *fd*; return them."""
    from mpistage.node.cleanup import remove_entry

    found = []
    names = default_names(fd)
    for name in names:
        if name in skip:
            continue
        ino = stale(fd, name, kept_too)
        if ino is None:
            continue
        found.append(name)
        if not dry_run:
            remove_if_same(fd, name, ino)
            remove_inputs(fd, name, remove_entry)
    for claim in orphan_claims(fd, names, skip):
        ino = stale(fd, claim, kept_too)
        if ino is not None:
            found.append(claim)
            if not dry_run:
                remove_if_same(fd, claim, ino)
    return found


def orphan_claims(fd, names, skip):
    """The default-named ``NAME.in`` claims below *fd* with no ``NAME`` beside.

    A launch killed before its copy existed leaves only its claim, whose
    owner record says whose it was.
    """
    prefix = f"mpistage-env-{_os.getuid()}-"
    return sorted(
        entry for entry in _os.listdir(fd)
        if entry.startswith(prefix) and entry.endswith(".in")
        and entry[:-3] not in names and entry[:-3] not in skip
    )  # fmt: skip


def remove_if_same(fd, name, ino):
    """Remove *name* below *fd* if it is still the directory judged (inode *ino*)."""
    from mpistage.node.cleanup import remove_entry

    try:
        same = _os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino == ino
    except OSError:
        return
    if same:
        remove_entry(fd, name)


def remove_inputs(fd, name, remove_entry):
    """Remove the Slurm stage step's inputs ``NAME.in``, if a stage step made them.

    That is a directory of ours, no symlink, with a stage marker of ours.
    """
    from mpistage.node.place import DIR_FLAGS, check_own

    try:
        inputs_fd = _os.open(name + ".in", DIR_FLAGS, dir_fd=fd)
    except OSError:
        return
    try:
        check_own(_os.fstat(inputs_fd), name + ".in", True)
        marked = bool(read_marker(inputs_fd))
    except Exception:
        marked = False  # not ours, or changing under us
    finally:
        _os.close(inputs_fd)
    if marked:
        remove_entry(fd, name + ".in")
