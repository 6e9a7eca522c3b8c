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
BCAST = ".bcast"  # mpistage-env-UID-JOB.bcast: a job's broadcast directory
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
    from mpistage.node.cleanup import owner_alive

    here = _os.uname().nodename
    if marker.get("host") != here:
        return False
    if marker.get("keep") == "yes" and not kept_too:
        return False
    run = marker.get("run", "")
    if owner_alive(run):
        return False
    if marker.get("job"):
        return job_ended_here(marker["job"], marker.get("jobvar") or "SLURM_JOB_ID")
    return run.partition(":")[0] == here  # its mpistage run, here, is gone


def job_ended_here(job, var):
    """Whether the scheduler's job *job* (named by *var*) has ended on this node.

    Not while a step of it runs here (a Slurm ``slurmstepd`` of the job, a
    process of this user carrying its variable), and then only when the
    scheduler, asked, says it has ended: between two steps on a node where
    the job's script does not run, nothing there carries the job.
    """
    if var == "SLURM_JOB_ID":
        if slurm_job_here(job):
            return False
    elif job_in_environ(var, job):
        return False
    return scheduler_says_ended(var, job)


def job_in_environ(var, job):
    """Whether a process of this user on this host carries ``VAR=JOB`` (or
    ``JOB.…``) in its environment, as a scheduler's job's processes do.
    Only this user's processes count: the copy is theirs, and nobody else
    can start a process as them.
    """
    want = f"{var}={job}".encode()
    for pid in processes(_os.getuid()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if any(e == want or e.startswith(want + b".") for e in entries):
            return True
    return False


def slurm_job_here(job):
    """Whether a step of Slurm job *job* runs on this node: a ``slurmstepd``
    of the job, which is root's (another user's process may take its name).
    """
    prefix = f"slurmstepd: [{job}.".encode()
    for pid in processes(0):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read(len(prefix)) == prefix:
                    return True
        except OSError:
            continue
    return False


def processes(uid):
    """The pids of the processes of user *uid* on this host."""
    for pid in _os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if _os.stat(f"/proc/{pid}").st_uid == uid:
                yield pid
        except OSError:
            continue


# How each scheduler says a job has ended: the command that asks it (JOB is
# the job), the states it answers for an ended job, and the words of its
# answer for a job it no longer knows.
ASK = {
    "SLURM_JOB_ID": (("squeue", "-h", "-j", "JOB", "-o", "%T"), FINAL,
                     ("Invalid job id",)),
    "PBS_JOBID": (("qstat", "-f", "JOB"), ("F", "C", "X"),
                  ("Unknown Job Id", "has finished")),
    "LSB_JOBID": (("bjobs", "-noheader", "-o", "stat", "JOB"), ("DONE", "EXIT"),
                  ("not found",)),
    "FLUX_JOB_ID": (("flux", "jobs", "-n", "-o", "{state}", "JOB"), ("INACTIVE",),
                    ("unknown", "not found")),
}  # fmt: skip


def scheduler_says_ended(var, job):
    """Whether the scheduler of *var* says *job* has ended (unknown to it, or
    in a final state). Without its command, or when it fails, nobody can
    tell: not ended (the site's epilog line removes the copy then).
    """
    import shutil
    import subprocess

    if var not in ASK:
        return False
    command, final, gone = ASK[var]
    program = shutil.which(command[0])
    if program is None:
        return False
    args = [program, *(job if a == "JOB" else a for a in command[1:])]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    if done.returncode != 0:
        return any(words in done.stderr + done.stdout for words in gone)
    # No state at all: the scheduler lists the job no more (squeue forgets
    # a job MinJobAge seconds after its end).
    return all(state in final for state in job_states(var, done.stdout))


def job_states(var, text):
    """The states in a scheduler's answer (``qstat -f``: its ``job_state``)."""
    if var != "PBS_JOBID":
        return text.split()
    lines = [line.partition("=") for line in text.splitlines()]
    return [value.strip() for key, _, value in lines if key.strip() == "job_state"]


def default_names(fd):
    """The default-named stages (``mpistage-env-UID-...``) in the directory *fd*."""
    prefix = f"mpistage-env-{_os.getuid()}-"
    return sorted(
        name for name in _os.listdir(fd)
        if name.startswith(prefix) and not name.endswith(".in")
    )  # fmt: skip


def stale(fd, name, kept_too=False):
    """Return the inode of the stage *name* below *fd* if it is dead, else ``None``.

    Judged by its own marker; a stage whose marker is gone (a removal cut
    short by an older mpistage) by its claim's owner record; a broadcast
    directory by the job its name gives; a name that says it is being
    removed is removed, whoever began it.
    """
    from mpistage.node.cleanup import REMOVING
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
    if REMOVING in name:
        return st.st_ino
    marker = marker or implied_marker(fd, name)
    return st.st_ino if marker and dead(marker, kept_too) else None


def implied_marker(fd, name):
    """The owner record of a stage without a marker: its claim's, or its name's.

    A broadcast directory ``mpistage-env-UID-JOB.bcast`` (docs/stage.md),
    private and this user's, is of the Slurm job its name gives.
    """
    if name.endswith(BCAST):
        job = name[len(f"mpistage-env-{_os.getuid()}-") : -len(BCAST)]
        return {"host": _os.uname().nodename, "job": job, "jobvar": "SLURM_JOB_ID"}
    return claim_record(fd, name + ".in")


def claim_record(fd, claim):
    """The owner record of the claim *claim* below *fd*, if it is ours (else ``{}``)."""
    from mpistage.node.place import DIR_FLAGS, check_own

    try:
        claim_fd = _os.open(claim, DIR_FLAGS, dir_fd=fd)
    except OSError:
        return {}
    try:
        check_own(_os.fstat(claim_fd), claim, True)
        return read_marker(claim_fd)
    except Exception:
        return {}  # not ours, or changing under us
    finally:
        _os.close(claim_fd)


def reap(fd, skip=(), kept_too=False, dry_run=False):
    """Remove the dead default-named stages in the directory *fd*; return them.

    Crash-only: each removal renames first (:func:`mpistage.node.cleanup.doom`),
    and a claim goes after its copy, so a reaper cut short at any point
    leaves what the next one judges again.
    """
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
            remove_claim(fd, name + ".in")
    for claim in orphan_claims(fd, names, skip):
        ino = stale(fd, claim, kept_too)
        if ino is not None:
            found.append(claim)
            if not dry_run:
                remove_claim(fd, claim, ino)
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
    from mpistage.node.cleanup import doom, inode

    if inode(fd, name) == ino:
        doom(fd, name, lambda doomed: inode(fd, doomed) != ino)


def remove_claim(fd, claim, ino=None):
    """Remove the claim or inputs ``NAME.in`` and the launcher's copy it names.

    Only a directory of ours with an owner record of ours (a claim, or a
    Slurm stage step's inputs) is removed; with *ino*, only if it is still
    the one judged. The launcher's copy of a self-extracting bundle
    (``spread``) goes first: the record that names it goes with the claim.
    """
    record = claim_record(fd, claim)
    if not record:
        return
    remove_spread(record)
    if ino is None:
        try:
            ino = _os.stat(claim, dir_fd=fd, follow_symlinks=False).st_ino
        except OSError:
            return
    remove_if_same(fd, claim, ino)


def remove_spread(record):
    """Remove the launcher's copy a claim's record names, if it is still that file.

    That is a regular file of this user, not a link, with the recorded
    inode, in a safe place (nobody else can rename or replace it there).
    """
    import stat

    from mpistage.node.place import open_safe

    path, ino = record.get("spread", ""), record.get("spread_ino", "")
    if not path.startswith("/") or not ino.isdigit():
        return
    parent, name = _os.path.split(path)
    try:
        _real, parent_fd = open_safe(parent)
    except Exception:
        return
    try:
        st = _os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if (stat.S_ISREG(st.st_mode) and st.st_uid == _os.getuid()
                and str(st.st_ino) == ino):  # fmt: skip
            _os.unlink(name, dir_fd=parent_fd)
    except OSError:
        pass  # Gone already.
    finally:
        _os.close(parent_fd)
