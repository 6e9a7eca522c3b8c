"""Which launch, which rank, which node: what launchers tell a process before MPI.

The node boot names its meeting place from these facts before MPI exists
(:func:`place_name`); the runner's topology, the node places' names and
``mpistage run`` read the same variables after. This module is their one
home: the launchers' variable names, the launcher processes that start a
node's ranks, and the emulated nodes of ``MPISTAGE_EMULATE_NODES``.
"""

import os as _os

from mpistage import StageError

# What launchers tell a process before MPI starts: its rank, the number of
# ranks, the job. Hydra and PMI-1 launchers, Open MPI, PMIx, Slurm, Flux; the
# first set wins. The one home of these names (the runner, the staging
# roots' names and ``mpistage run`` read them).
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID",
             "FLUX_TASK_RANK")  # fmt: skip
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "FLUX_JOB_SIZE")
JOB_VARS = ("SLURM_JOB_ID", "FLUX_JOB_ID", "PBS_JOBID", "LSB_JOBID")


def launcher_value(names, default=None):
    """Return the first of the environment variables *names* that is set."""
    return next((_os.environ[n] for n in names if _os.environ.get(n)), default)


def launcher_rank():
    """Return this process's rank as the launcher told it (0 if it did not)."""
    value = launcher_value(RANK_VARS, "0")
    return int(value) if value.isdigit() else 0


def job_id():
    """Return the scheduler's job id (its first dot-separated part), or ``None``."""
    value = launcher_value(JOB_VARS)
    return value.split(".")[0] if value else None


def job_var():
    """Return the name of the variable :func:`job_id` comes from, or ``""``."""
    return next((n for n in JOB_VARS if _os.environ.get(n)), "")


PROXIES = ("hydra_pmi_proxy",)  # launcher processes that start the ranks of a node
# The processes that start a launch's ranks on a node, one per launch and
# node: its instance is one of them, named by its pid and start time.
STARTERS = ("slurmstepd", "hydra_pmi_proxy", "orted", "prted", "prterun", "orterun",
            "flux-shell", "palsd", "mpirun", "mpiexec")  # fmt: skip
ANCESTORS = 8  # how far up a rank looks for its launcher's proxy
LETTERS = "abcdefghijklmnopqrstuvwxyz"
NAME_CHARS = frozenset(LETTERS + LETTERS.upper() + "0123456789._-")
NAME_MAX = 96  # characters of a launch's name kept as they are


def fnv1a(data):
    """Return the 64-bit FNV-1a hash of *data* (no import needed for it)."""
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def emulated_nodes(size, value=None):
    """Return N from ``MPISTAGE_EMULATE_NODES`` (``None`` when unset), 1 to *size*."""
    from mpistage.settings import SETTINGS, shown

    setting = SETTINGS["MPISTAGE_EMULATE_NODES"]
    environ = None if value is None else {setting.name: value}
    try:
        count = setting.get(environ)
    except StageError:
        count = 0
    if count is not None and not 1 <= count <= size:
        raise StageError(
            f"{setting.name}={shown(setting.text(environ))} must be a whole number "
            f"from 1 to the number of ranks ({size})"
        )
    return count


def launch():
    """Name this launch as its launcher does, or ``None``: one name per launch."""
    env = _os.environ
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    if env.get("PMIX_NAMESPACE"):
        return "pmix-" + env["PMIX_NAMESPACE"]
    if env.get("FLUX_JOB_ID"):
        return "flux-" + env["FLUX_JOB_ID"]
    proxy = launcher_proxy()
    return f"hydra-{proxy[0]}-{proxy[1]}" if proxy else None


def instance():
    """Name this launch's instance on this node, or ``None``: what starts its ranks.

    Variables name a launch, but a child inherits them (an ``FLUX_JOB_ID``
    passed on to an ``mpiexec`` inside the job): two launches may carry the
    same name. The launcher's process that starts the ranks of this node
    (``slurmstepd``, ``hydra_pmi_proxy``, ``orted``, ``flux-shell``...) is
    made anew for each launch; its pid and start time name it uniquely.
    """
    found = ancestor(lambda comm: comm.startswith(STARTERS))
    return f"{found[0]}-{found[1]}" if found else None


def launcher_proxy():
    """Return (pid, start time) of the launcher proxy this rank runs under, or None.

    Hydra starts the ranks of a node as children of one ``hydra_pmi_proxy``
    (perhaps through a wrapper such as ``sh -c``); its pid and its start
    time, in clock ticks since boot, name it uniquely on the node.
    """
    return ancestor(lambda comm: comm in PROXIES)


def ancestor(wanted):
    """Return (pid, start time) of the nearest ancestor whose name is *wanted*."""
    pid = _os.getppid()
    for _level in range(ANCESTORS):
        found = proc_stat(pid)
        if found is None:
            return None
        comm, ppid, started = found
        if wanted(comm):
            return pid, started
        if ppid <= 1:
            return None
        pid = ppid
    return None


def proc_stat(pid):
    """Return (command name, parent pid, start time) of process *pid*, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    comm = text[text.find("(") + 1 : text.rfind(")")]
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return comm, int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def node_word():
    """Name this rank's node within the launch: host, Slurm node, emulated node."""
    word = _os.uname().nodename.split(".")[0]
    if _os.environ.get("SLURM_NODEID", "").isdigit():
        word += ".s" + _os.environ["SLURM_NODEID"]
    size = launcher_value(SIZE_VARS, "1")
    size = int(size) if size.isdigit() and int(size) > 0 else 1
    count = emulated_nodes(size)
    if count:
        word += f".e{launcher_rank() * count // size}"
    return word


def place_name(name=None):
    """Return the name of this rank's meeting place (for the launch *name*)."""
    name = launch() if name is None else name
    return f"boot-{safe_name(name)}.{safe_name(node_word())}"


def safe_name(text):
    """Return *text* as a file name: odd characters and excess length hashed."""
    kept = "".join(c if c in NAME_CHARS else "_" for c in text)
    if kept == text and len(text) <= NAME_MAX:
        return text
    return f"{kept[:NAME_MAX]}-{fnv1a(text.encode()):016x}"


def usage_error(message, usage):
    """Print *message* and *usage* once (the launch's first rank); exit 2 everywhere.

    Every rank of a launch parses the same command line: one says it, all
    end. Status 2 is every mpistage command's for a usage error
    (docs/api.md).
    """
    import sys

    if launcher_rank() == 0:
        print(f"mpistage: error: {message}\n{usage}", file=sys.stderr)
    sys.exit(2)
