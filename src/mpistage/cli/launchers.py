"""Launch lines as users write them: which nodes they run on, one task per node.

``mpistage run`` is given a launch line (``srun -n 4 python app.py``) and
needs two more launches on the same nodes: the stage and the clean step,
each with exactly one task on every node. :func:`understand` reads the
launcher's options with a table per launcher, and each option has a role:

- ``layout``: how many tasks and where (``-n``, ``--map-by``, ``-ppn``):
  replaced by one task per node;
- ``hosts``: which nodes (``-x``, ``-H``, ``-f``): kept;
- ``keep``: what the tasks need to start at all, such as the MPI plugin
  (``--mpi=pmix``), MCA parameters or exported variables: kept;
- ``alloc``: what a Slurm allocation is made of (``-w``, ``-p``, ``-t``):
  given to ``salloc`` when ``srun`` runs outside an allocation, left out of
  the steps inside one (they run in it);
- ``step``: how ``srun`` fits a step into its allocation (``--exact``): left
  out;
- ``io``: where output goes: left out (the stage step's output is ours).

The node set comes from the launcher's own facts where it has them
(``SLURM_JOB_NODELIST``, ``SLURM_NNODES``, the host list, the host file,
``PBS_NODEFILE``). An option not in the table, several programs (``:``),
or a launcher not known here is refused with one line that names
``--stage-launcher``: a wrong guess would stage the wrong nodes. Words
between the options and python (``env A=1``, a wrapper script) are kept.
"""

import os as _os
import re as _re

from mpistage import StageError

HINT = "give --stage-launcher 'CMD ...', a command that starts one task per node"


def table(**roles):
    """Return {option: (role, arity)} from space-separated specs per role.

    A spec is the option's name, ending in ``=`` if it takes a value, ``==``
    if it takes two, ``?`` if a value may follow only as ``--opt=value``.
    """
    found = {}
    for role, specs in roles.items():
        for spec in specs.split():
            name = spec.rstrip("=?")
            arity = {"==": 2, "=": 1, "?": 0}.get(spec[len(name) :], 0)
            found[name] = (role, arity)
    return found


SRUN = table(
    layout="-n= --ntasks= -N= --nodes= --ntasks-per-node= --tasks-per-node= "
    "-c= --cpus-per-task= --ntasks-per-socket= --ntasks-per-core= "
    "--ntasks-per-gpu= --threads-per-core= --hint= -m= --distribution= "
    "--cpu-bind= --mem-bind= --mem-per-cpu= --mem-per-gpu= --cpus-per-gpu= "
    "--gpus-per-task= --gpus-per-node= --sockets-per-node= --cores-per-socket= "
    "--spread-job -O --overcommit",
    step="--exact",
    hosts="-x= --exclude=",
    alloc="-w= --nodelist= -p= --partition= -A= --account= -q= --qos= -t= "
    "--time= --time-min= -C= --constraint= --reservation= --mem= --exclusive? "
    "-G= --gpus= --gres= "
    "-J= --job-name= -L= --licenses= --begin= --comment= --contiguous "
    "--wckey= --switches= -s --oversubscribe --signal= --deadline= --nice?",
    keep="--mpi= --overlap --export= --propagate? -D= --chdir= --container= -l --label "
    "-u --unbuffered -K? --kill-on-bad-exit? -W= --wait= -v --verbose -Q "
    "--quiet -X --disable-status --cpu-freq= --network= --prolog= --epilog= "
    "--task-prolog= --task-epilog=",
    io="-o= --output= -e= --error= -i= --input= --open-mode=",
)

# Open MPI and Hydra take their long options with one dash or two: the
# tables name them without dashes.
OPENMPI = table(
    layout="n= np= c= N= npernode= pernode npersocket= map-by= rank-by= "
    "bind-to= ppr= cpus-per-proc= cpus-per-rank= use-hwthread-cpus "
    "report-bindings display-map display-allocation",
    hosts="H= host= hostfile= machinefile= default-hostfile=",
    keep="mca== gmca== am= tune= x= prefix= noprefix oversubscribe "
    "allow-run-as-root q quiet tag-output timestamp-output wdir= wd= path= "
    "v verbose merge-stderr-to-stdout launch-agent= leave-session-attached",
    io="output-filename= stdin= xml",
)
HYDRA = table(
    layout="n= np= ppn= bind-to= binding= map-by= membind=",
    hosts="hosts= host= f= hostfile= machinefile=",
    keep="genv== genvlist= genvnone genvall env== envlist= envnone envall "
    "launcher= bootstrap= launcher-exec= bootstrap-exec= rmk= iface= "
    "prepend-rank l wdir= verbose v nameserver= disable-auto-cleanup "
    "print-all-exitcodes",
    io="outfile-pattern= errfile-pattern=",
)
FLUX = table(
    layout="-n= --ntasks= -N= --nodes= -c= --cores-per-task= -g= "
    "--gpus-per-task= --tasks-per-node= --exclusive",
    keep="-o= --setopt= -S= --setattr= --env= --env-remove= --env-file= "
    "-q= --queue= -t= --time-limit= -v --verbose -l --label-io",
    io="--output= --error= --input=",
)


def understand(command, stage_launcher=None):
    """Return the :class:`Launch` of *command*, a launch line ending in python."""
    at = find_python(command)
    if stage_launcher:
        import shlex

        return Custom(command, at, shlex.split(stage_launcher))
    kind = launcher_kind(command[0])
    return kind(command, at)


def find_python(command):
    """Return the index of the Python interpreter word in *command*."""
    for index, word in enumerate(command[1:], 1):
        if _re.fullmatch(r"python(\d+(\.\d+)?)?", _os.path.basename(word)):
            return index
    raise StageError(
        "no python in the command: write it as `-- LAUNCHER ... python app.py`"
    )


def emulated():
    """The number of emulated nodes (``MPISTAGE_EMULATE_NODES``), else 0."""
    from mpistage.settings import get

    return get("MPISTAGE_EMULATE_NODES") or 0


class Launch:
    """A launch line understood: its launcher, options and wrappers, and python.

    Subclasses give the launcher's option table and how it starts one task
    per node.
    """

    family = "?"
    options = {}
    dashes = False  # options may have one dash or two (Open MPI, Hydra)

    def __init__(self, command, python_at):
        self.command, self.python_at = list(command), python_at
        options = self.command[self.first_option() : python_at]
        self.parsed, self.wrapper = self.parse(options)

    def first_option(self):
        """The index of the launcher's first option (``flux run``: 2)."""
        return 1

    @property
    def python(self):
        """The command's python word."""
        return self.command[self.python_at]

    def parse(self, words):
        """Return ([(role, [words])], wrapper words) of the launcher's options."""
        parsed, words = [], list(words)
        while words and words[0].startswith("-") and words[0] != "-":
            parsed.append(self.take(words))
        if ":" in self.command[self.python_at :]:
            raise StageError(f"{self.name} with several programs (':'): {HINT}")
        return parsed, words

    def take(self, words):
        """Take one option and its values off *words*; return (role, words)."""
        word = words.pop(0)
        name, eq, _value = word.partition("=")
        if self.key(name) not in self.options and self.attached(word):
            words.insert(0, word[2:])  # -n4: the option -n and its value 4
            word, name, eq = word[:2], word[:2], ""
        if self.key(name) not in self.options:
            raise StageError(f"{self.name} option {word!r} is not known here: {HINT}")
        role, arity = self.options[self.key(name)]
        if eq and (arity == 2 or (arity == 0 and not word.startswith("--"))):
            raise StageError(f"{self.name} option {word!r}: {HINT}")
        need = max(arity - (1 if eq else 0), 0)
        if len(words) < need:
            raise StageError(f"{self.name} option {word!r} needs a value")
        return role, [word] + [words.pop(0) for _ in range(need)]

    def key(self, name):
        """The table's name for the option *name*."""
        return name.lstrip("-") if self.dashes else name

    def attached(self, word):
        """Whether *word* is a short option with its value attached (``-n4``).

        Where long options take one dash (Open MPI, Hydra), ``-nolocal`` is
        an option of its own, not ``-n olocal``: only a number is read as
        attached there (``-n4``). ``srun`` reads options as ``getopt`` does.
        """
        key = self.key(word[:2])
        return (
            len(word) > 2
            and not word.startswith("--")
            and self.options.get(key, ("", 0))[1] == 1
            and (not self.dashes or word[2:].isdigit())
        )

    @property
    def name(self):
        """The launcher's name (and which one it is taken for), for messages."""
        name = _os.path.basename(self.command[0])
        return name if name == self.family else f"{name} ({self.family})"

    def words(self, *roles):
        """The launcher's option words of the given *roles*, in order."""
        return [w for role, taken in self.parsed if role in roles for w in taken]

    def values(self, *names):
        """Every value given to the options *names*."""
        found = []
        for _role, taken in self.parsed:
            name, eq, value = taken[0].partition("=")
            if self.key(name) in names:
                found.append(value if eq else taken[1] if len(taken) > 1 else "")
        return found

    # -- what mpistage run asks ------------------------------------------------

    def per_node(self):
        """The command prefix that starts exactly one task on each node."""
        raise NotImplementedError

    def nodes(self):
        """How many nodes the job runs on."""
        return emulated() or self.real_nodes()

    def listed_hosts(self, lists, files):
        """The number of hosts the options *lists* name, else those of *files*.

        A host list is comma-separated, ``host:slots`` counted once; 0 when
        the command names no hosts.
        """
        hosts = [h for v in self.values(*lists) for h in v.split(",")]
        if hosts:
            return len({h.split(":")[0] for h in hosts if h})
        for path in self.values(*files):
            return len(hostfile(path))
        return 0

    def real_nodes(self):
        """The number of (real) nodes, from the launcher's facts."""
        return slurm_nodes() or pbs_nodes() or 1

    def allocation(self):
        """The command that makes an allocation to run in first, or ``None``."""
        return None

    def step_environ(self):
        """The environment of the stage and clean steps (``None``: this one)."""
        return None

    def run_prefix(self, exported=()):
        """The command's words before python, as the run step starts them.

        *exported* names the variables the run step sets for the ranks.
        """
        return self.command[: self.python_at]

    def stage_prefix(self):
        """The stage step's prefix: one task per node, then the wrapper, if any."""
        return [*self.per_node(), *self.wrapper]


class Srun(Launch):
    """Slurm's ``srun``, inside an allocation (salloc, sbatch) or outside one."""

    family = "srun"
    options = SRUN

    def allocation(self):
        """Outside an allocation: ``salloc`` with the command's allocation options.

        All three steps must run on the same nodes, so ``mpistage run`` runs
        itself in one allocation; its steps are then ``srun`` inside it.
        """
        if _os.environ.get("SLURM_JOB_ID"):
            return None
        salloc = _os.path.join(_os.path.dirname(self.command[0]), "salloc")
        if not self.arbitrary():
            return [salloc, "--quiet", *self.words("layout", "hosts", "alloc")]
        return [salloc, "--quiet", *self.arbitrary_allocation()]

    def arbitrary(self):
        """The host file of ``-m arbitrary`` (``SLURM_HOSTFILE``), or ``None``.

        ``srun`` places task *i* on the file's line *i*; ``salloc`` and
        ``sbcast`` read the same variable as a node list and refuse it.
        """
        distribution = self.values("-m", "--distribution")
        distribution = distribution[-1] if distribution else None
        distribution = distribution or _os.environ.get("SLURM_DISTRIBUTION", "")
        if not distribution.startswith("arbitrary"):
            return None
        return _os.environ.get("SLURM_HOSTFILE") or None

    def arbitrary_allocation(self):
        """``salloc`` words for ``-m arbitrary``: the host file's distinct nodes.

        The file stays for the run step only: ``env`` gives it back to the
        ``mpistage run`` that ``salloc`` starts (:meth:`step_environ` keeps
        it from ``salloc`` itself).
        """
        path = self.arbitrary()
        hosts = hostfile(path)
        kept = [w for role, taken in self.parsed
                if role in ("layout", "hosts", "alloc")
                and self.key(taken[0].partition("=")[0]) not in ("-m", "--distribution")
                for w in taken]  # fmt: skip
        return [*kept, "-N", str(len(hosts)), "-w", ",".join(hosts),
                "env", f"SLURM_HOSTFILE={path}"]  # fmt: skip

    def step_environ(self):
        """This environment without ``-m arbitrary``'s variables.

        One task per node is a block placement: the host file (one line per
        task of the run step) would make ``srun`` refuse the stage step and
        ``sbcast`` fail.
        """
        hidden = ("SLURM_HOSTFILE", "SLURM_DISTRIBUTION")
        return {k: v for k, v in _os.environ.items() if k not in hidden}

    def per_node(self):
        """``srun --overlap -N K -n K --ntasks-per-node=1``, hosts and plugin kept.

        ``--overlap``: the stage and clean steps share their CPUs with the
        allocation's other steps, so a second ``mpistage run`` of the job
        never waits for the first one's run step to end.
        """
        kept = self.words("hosts", "keep")
        kept = kept if "--overlap" in kept else ["--overlap", *kept]
        count = emulated()
        if count:
            return [self.command[0], "-n", str(count), *kept]
        count = str(self.real_nodes())
        return [self.command[0], "-N", count, "-n", count, "--ntasks-per-node=1", *kept]

    def real_nodes(self):
        """Every node of the allocation, less those ``-x`` excludes.

        ``srun`` in an allocation runs on all its nodes unless ``-N`` says
        fewer, and ``-w`` only names nodes that must be among them: the
        stage step covers them all.
        """
        everything = _os.environ.get("SLURM_JOB_NODELIST", "")
        excluded = self.values("-x", "--exclude")
        if everything and excluded:
            return len(set(hostnames(everything)) - set(hostnames(excluded[-1])))
        return slurm_nodes() or 1


class OpenMPI(Launch):
    """Open MPI's ``mpirun``/``mpiexec`` (ORTE): ``--map-by ppr:1:node``."""

    family = "Open MPI"
    options = OPENMPI
    dashes = True

    def per_node(self):
        """``mpirun --map-by ppr:1:node`` with the hosts and MCA settings kept."""
        kept = self.words("hosts", "keep")
        count = emulated()
        if count:
            return [self.command[0], "-np", str(count), *kept]
        return [self.command[0], "--map-by", "ppr:1:node", *kept]

    def real_nodes(self):
        """Hosts of ``-H``/``--host``, else of the host file, else the allocation's."""
        files = ("hostfile", "machinefile", "default-hostfile")
        return self.listed_hosts(("H", "host"), files) or super().real_nodes()

    def run_prefix(self, exported=()):
        """Remote ranks get only what ``-x`` exports: export the staged paths."""
        exports = [w for name in exported for w in ("-x", name)]
        return [self.command[0], *exports, *self.command[1 : self.python_at]]


class Hydra(Launch):
    """MPICH's (and Intel MPI's) Hydra ``mpiexec``: ``-n K -ppn 1``."""

    family = "Hydra"
    options = HYDRA
    dashes = True

    def per_node(self):
        """``mpiexec -n K -ppn 1`` with the hosts kept; K hosts from the launcher."""
        count = str(self.nodes())
        return [self.command[0], "-n", count, "-ppn", "1", *self.words("hosts", "keep")]

    def real_nodes(self):
        """Hosts of ``-hosts``, else of the host file, else the allocation's."""
        files = ("f", "hostfile", "machinefile")
        return self.listed_hosts(("hosts", "host"), files) or super().real_nodes()


class Flux(Launch):
    """``flux run`` (documented; not part of the test suite)."""

    family = "flux"
    options = FLUX

    def first_option(self):
        """Options follow ``flux run``."""
        if self.command[1:2] != ["run"]:
            raise StageError(f"flux {self.command[1:2]!r}: use `flux run`, or {HINT}")
        return 2

    def per_node(self):
        """``flux run -N K --tasks-per-node=1`` with the settings kept."""
        count = str(self.nodes())
        keep = self.words("keep")
        return [self.command[0], "run", "-N", count, "--tasks-per-node=1", *keep]

    def real_nodes(self):
        """``-N`` of the command, else the instance's size."""
        for value in self.values("-N", "--nodes"):
            if value.isdigit():
                return int(value)
        nodes = _os.environ.get("FLUX_JOB_NNODES", "")
        return int(nodes) if nodes.isdigit() else 1


class Custom(Launch):
    """``--stage-launcher CMD``: the user's own one-task-per-node command."""

    def __init__(self, command, python_at, prefix):
        self.command, self.python_at, self.prefix = list(command), python_at, prefix
        self.parsed, self.wrapper = [], []

    def per_node(self):
        """The prefix as given."""
        return list(self.prefix)


def launcher_kind(word):
    """Return the :class:`Launch` class of the launcher *word*."""
    name = _os.path.basename(word)
    if name == "srun":
        return Srun
    if name == "flux":
        return Flux
    if name.startswith(("mpiexec", "mpirun")) or name in ("orterun", "prterun"):
        return mpi_family(word)
    raise StageError(f"unknown launcher {word!r}: {HINT}")


def mpi_family(word):
    """Tell Open MPI's ``mpirun`` from Hydra's, by name, else by ``--version``."""
    import shutil

    path = shutil.which(word)
    names = [word] + ([_os.path.realpath(path)] if path else [])
    for name in map(_os.path.basename, names):
        if name.endswith(".openmpi") or name in ("orterun", "prterun"):
            return OpenMPI
        if name.endswith((".hydra", ".mpich")):
            return Hydra
    if path is None:
        raise StageError(f"launcher {word!r} not found")
    said = version(path)
    if "Open MPI" in said or "OpenRTE" in said:
        return OpenMPI
    if "HYDRA" in said or "Intel(R) MPI" in said:
        return Hydra
    raise StageError(f"{word!r} is neither Open MPI's nor Hydra's mpiexec: {HINT}")


def version(path):
    """What the launcher at *path* says to ``--version`` (empty if nothing)."""
    import subprocess

    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


# -- the launchers' facts ----------------------------------------------------------


def slurm_nodes():
    """The nodes of the Slurm allocation this runs in (0 outside one)."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if _os.environ.get(name, "").isdigit():
            return int(_os.environ[name])
    nodelist = _os.environ.get("SLURM_JOB_NODELIST")
    return len(set(hostnames(nodelist))) if nodelist else 0


def pbs_nodes():
    """The distinct hosts of ``PBS_NODEFILE`` (0 without one)."""
    path = _os.environ.get("PBS_NODEFILE")
    return len(hostfile(path)) if path else 0


def hostfile(path):
    """The distinct hosts of a host file (``host``, ``host:4``, ``host slots=4``)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise StageError(f"cannot read host file {path!r}: {exc.strerror}") from None
    hosts = []
    for line in lines:
        word = line.split("#", 1)[0].split()
        if word:
            hosts.append(word[0].split(":")[0])
    if not hosts:
        raise StageError(f"the host file {path!r} names no host")
    return list(dict.fromkeys(hosts))


def hostnames(expression):
    """Expand a Slurm host list (``n[1-3,7],gpu01``); a path is read as a host file."""
    if "/" in expression:
        return hostfile(expression)
    names = []
    for part in _re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", expression):
        names += expand(part)
    return names


def expand(part):
    """Expand one host name with bracketed ranges: ``n[01-02]x`` → n01x, n02x."""
    match = _re.search(r"\[([^\]]*)\]", part)
    if not match:
        return [part]
    head, tail, found = part[: match.start()], part[match.end() :], []
    for piece in match.group(1).split(","):
        low, _, high = piece.partition("-")
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            found += expand(f"{head}{number:0{width}d}{tail}")
    return found
