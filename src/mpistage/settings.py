"""Every ``MPISTAGE_*`` environment variable: its name, parser, default and meaning.

Why one home: the variables are read by the runner, the node boot (before
MPI), the live imports, the command-line tools and the bench. Each used to
parse its own, so one value could mean two things in two places. Now each
place asks :func:`get`, which parses the one way and rejects anything else
with one line naming the variable. The runner's ``--help`` lists the
settings from here and docs/usage.md's table is checked against
:data:`SETTINGS` (tests/test_docs.py), so neither can drift.

Settings marked *internal* pass facts from one mpistage process to another
(``mpistage run`` to its steps, the recorder to Python children); users do
not set them. ``bin/mpistage-env`` is a shell script and reads its three
settings itself; the suite checks it uses the names and defaults below.

It imports nothing but ``os`` and the package itself: the node boot reads
it before MPI exists.
"""

import os as _os

from mpistage import StageError

_TRUE = ("1", "yes", "on", "true")
_FALSE = ("0", "no", "off", "false")
_DIGITS = frozenset("0123456789")
WAIT_MAX = 86400  # seconds: no wait of mpistage's is longer than a day
LONGEST = 64  # bytes of a number or a boolean at most: longer is refused at once
SHOWN_HEAD = 20  # bytes of a refused over-long value that its line shows


def _digits(value):
    """Whether *value* is ASCII decimal digits only (no sign, space or ``_``)."""
    return bool(value) and _DIGITS.issuperset(value)


def _whole(value, high):
    """*value* (digits) as an int, or ``None`` when it is above *high*.

    Leading zeros mean nothing (``010`` is ten); a long string of digits is
    refused by its length before ``int`` could be asked to read it.
    """
    value = value.lstrip("0") or "0"
    return None if len(value) > len(str(high)) or int(value) > high else int(value)


def shown(value):
    """*value* as a refusal shows it, in one line, the same in ``bin/mpistage-env``.

    Quoted; a backslash, a quote and the bytes that are not printable ASCII
    are escaped (``\\n``, ``\\xd9``), so a value with a newline is still one
    line; a value over :data:`LONGEST` bytes shows its first
    :data:`SHOWN_HEAD` and its length.
    """
    data, tail = _os.fsencode(value), "'"
    if len(data) > LONGEST:
        data, tail = data[:SHOWN_HEAD], f"...' ({len(data)} bytes)"
    return "'" + "".join(_ESCAPES.get(b) or _escape(b) for b in data) + tail


_ESCAPES = {92: "\\\\", 39: "\\'", 10: "\\n", 9: "\\t", 13: "\\r"}


def _escape(byte):
    """One byte of a shown value: itself if printable ASCII, else ``\\xHH``."""
    return chr(byte) if 32 <= byte < 127 else f"\\x{byte:02x}"


class Kind:
    """How one kind of value is read: :meth:`parse`, and :attr:`says` what it takes.

    The one rule for every ``MPISTAGE_*`` value, shared with the shell
    script ``bin/mpistage-env``: unset or empty means the default, anything
    else must be exactly what :attr:`says` allows, or it is refused with
    one line (``NAME='VALUE' must be ...``), never replaced by a default.
    """

    says = ""

    def __call__(self, name, value):
        """The value of *name* set to *value*, or one line that refuses it.

        A value longer than :data:`LONGEST` bytes is refused by its length
        alone, before anything reads it.
        """
        found = None if len(_os.fsencode(value)) > LONGEST else self.parse(value)
        if found is None:
            raise StageError(f"{name}={shown(value)} must be {self.says}")
        return found

    def parse(self, value):
        """The value *value* stands for, or ``None`` when it is refused."""
        raise NotImplementedError


class YesNo(Kind):
    """A boolean: yes/no, on/off, true/false, 1/0, in any case."""

    says = "one of yes, no, on, off, true, false, 1, 0"

    def parse(self, value):
        """``True``, ``False`` or ``None``."""
        value = value.lower()
        return value in _TRUE if value in _TRUE + _FALSE else None


class Whole(Kind):
    """A whole number from *low* to *high*: decimal digits only."""

    def __init__(self, low, high):
        self.low, self.high = low, high
        self.says = f"a whole number from {low} to {high}"

    def parse(self, value):
        """An int in range, or ``None``."""
        found = _whole(value, self.high) if _digits(value) else None
        return found if found is not None and found >= self.low else None


class Seconds(Kind):
    """Seconds from 0 to *high*: digits, an optional fraction (``1.5``).

    No sign, no exponent, no ``inf`` or ``nan``: what ``float`` would also
    take (``1e10``, ``inf``) could overflow a timeout far from here.
    """

    def __init__(self, high=WAIT_MAX):
        self.high = high
        self.says = f"a number of seconds from 0 to {high}"

    def parse(self, value):
        """A float in range, or ``None``."""
        whole, dot, fraction = value.partition(".")
        if not _digits(whole) or (dot and not _digits(fraction)):
            return None
        seconds = _whole(whole, self.high)
        if seconds is None or seconds == self.high and fraction.strip("0"):
            return None  # compared as written: 86400.000000000000001 is above
        return float(value)


yes_no = YesNo()
seconds = Seconds()
EMULATED_MAX = 4096  # emulated nodes: one machine's ranks, at most
PIECE_MIN, PIECE_MAX = 64, 1 << 30  # bytes of one message: far below 2**31 - 1


def text(name, value):
    """Any text (a path, a command)."""
    return value


def paths(name, value):
    """A ``:``-separated list of directories."""
    return [p for p in value.split(_os.pathsep) if p]


class Setting:
    """One variable: *name*, its parser, its default, what it does (one line)."""

    def __init__(self, name, parse, default, meaning, value="", internal=False):
        self.name, self.parse, self.default = name, parse, default
        self.meaning, self.value, self.internal = meaning, value, internal

    def get(self, environ=None):
        """The parsed value, or the default when unset or empty."""
        found = self.text(environ)
        return self.parse(self.name, found) if found else self.default

    def text(self, environ=None):
        """The value as set, ``""`` when unset; text and paths lose outer spaces.

        A number or a boolean is taken exactly as written, as
        ``bin/mpistage-env`` takes it: ``" 2"`` is refused, not read as 2.
        """
        found = (_os.environ if environ is None else environ).get(self.name, "")
        return found if isinstance(self.parse, Kind) else found.strip()

    def says(self):
        """What the setting takes, as its refusal says (``""`` for text)."""
        return getattr(self.parse, "says", "")

    def shown(self):
        """``NAME=VALUE`` as the docs write it (``NAME`` alone for a path)."""
        return f"{self.name}={self.value}" if self.value else self.name


def _settings(*items):
    return {item.name: item for item in items}


SETTINGS = _settings(
    Setting("MPISTAGE_BUNDLE", text, None, "the bundle to stage (as `--bundle FILE`)"),
    Setting(
        "MPISTAGE_CACHE_DIR",
        text,
        None,
        "where `--auto` keeps bundles (as `--cache-dir DIR`; default "
        "`$XDG_CACHE_HOME/mpistage` or `~/.cache/mpistage`)",
    ),
    Setting(
        "MPISTAGE_REPORT",
        text,
        None,
        "write the job's report as JSON to this file",
        "path.json",
    ),
    Setting(
        "MPISTAGE_DATA",
        paths,
        [],
        "directories the runner copies once per node before the program runs "
        "(as `--data DIR`)",
        "dir1:dir2",
    ),
    Setting(
        "MPISTAGE_STAGE_DIR",
        paths,
        [],
        "staging candidates, tried first",
        "dir1:dir2",
    ),
    Setting(
        "MPISTAGE_STAGE_FALLBACK",
        yes_no,
        True,
        "with `no`, do not fall back to /dev/shm, `$TMPDIR`, /tmp",
        "no",
    ),
    Setting(
        "MPISTAGE_EMULATE_NODES",
        Whole(1, EMULATED_MAX),
        None,
        "split the ranks into N emulated nodes (contiguous rank blocks), each "
        "with its own place: for tests and benchmarks on one machine "
        "(at most the number of ranks)",
        "N",
    ),
    Setting(
        "MPISTAGE_BOOT",
        yes_no,
        True,
        "with `no`, no node boot: every rank imports mpi4py as usual",
        "no",
    ),
    Setting(
        "MPISTAGE_BOOT_WAIT",
        seconds,
        300.0,
        "how long a rank waits for its node's first rank before it imports "
        "mpi4py as usual (default 300; a first rank that ends is noticed at once)",
        "SECONDS",
    ),
    Setting(
        "MPISTAGE_LIVE",
        yes_no,
        True,
        "with `no`, a job without a bundle imports the plain way (no live imports)",
        "no",
    ),
    Setting(
        "MPISTAGE_LIVE_WAIT",
        seconds,
        5.0,
        "how long a rank waits for a live request's answer while nothing "
        "arrives at its node, before it imports from the originals (default 5)",
        "SECONDS",
    ),
    Setting(
        "MPISTAGE_PIECE_SIZE",
        Whole(PIECE_MIN, PIECE_MAX),
        16 << 20,
        "bytes in one MPI message of mpistage at most (default 16777216, "
        "16 MiB): the pieces a bundle, a data file and a live push travel in",
        "BYTES",
    ),
    Setting(
        "MPISTAGE_ENV_WAIT",
        seconds,
        600.0,
        "`mpistage-env`: how long a node's other processes wait for the one "
        "that unpacks the environment (default 600)",
        "SECONDS",
    ),
    Setting(
        "MPISTAGE_NODE_PYTHON",
        text,
        "/usr/bin/python3",
        "`mpistage-env`: the node-local Python 3.10+ that unpacks the "
        "environment (default /usr/bin/python3)",
        "PATH",
    ),
    Setting(
        "MPISTAGE_CI_CACHE",
        text,
        "",
        "where the suite and scripts/source-venv keep what they build once "
        "(default ~/.cache/mpistage-ci): wheels, sdists, the GPU-sized stack",
        internal=True,
    ),
    Setting(
        "MPISTAGE_SLURM_STATE",
        text,
        "/var/lib/mpistage-ci/slurm",
        "the Slurm test cluster's directory (scripts/slurm-cluster, the suite, "
        "the `slurm_run` campaign)",
        internal=True,
    ),
    Setting(
        "MPISTAGE_DATA_DIR",
        text,
        None,
        "set for the program by `--data` (the runner, `mpistage run`): the node's "
        "copy of each directory, `:`-separated in the order given",
        internal=True,
    ),
    Setting(
        "MPISTAGE_CHILD",
        text,
        None,
        "a Python child of a rank: the node's copy to import from",
        internal=True,
    ),
    Setting(
        "MPISTAGE_RECORD_DIR",
        text,
        None,
        "`mpistage record`: where Python children write what they used",
        internal=True,
    ),
    Setting(
        "MPISTAGE_RUN_OWNER",
        text,
        "",
        "`mpistage run`: the run that owns a stage (its marker's owner record)",
        internal=True,
    ),
    Setting(
        "MPISTAGE_RUN_KEEP",
        text,
        "",
        "`mpistage run --keep`: the stage outlives the run",
        internal=True,
    ),
)


def get(name, environ=None):
    """The value of the setting *name* (from *environ*, else ``os.environ``)."""
    return SETTINGS[name].get(environ)


def check(ranks=None, emulated=None):
    """Read every setting once: the first refusal is raised, as one line.

    The runner and the stager call it on every rank before anything else,
    so that a bad value ends the job at start-up rather than where it is
    first read (inside the program's own import, or in the node boot, which
    turns itself off on any doubt). Given the job's number of *ranks*, the
    emulated nodes are checked against it first, by *emulated*
    (:func:`mpistage.node.launch.emulated_nodes`): their refusal names it.
    """
    if ranks is not None and emulated is not None:
        emulated(ranks)
    for item in SETTINGS.values():
        item.get()


def help_lines(width=79):
    """The settings users set, ``NAME=VALUE  meaning`` each, wrapped (``--help``)."""
    import textwrap

    shown = [s for s in SETTINGS.values() if not s.internal]
    left = max(len(s.shown()) for s in shown) + 4
    lines = []
    for item in shown:
        text = f"  {item.shown():<{left - 4}}  {item.meaning.replace('`', '')}"
        lines += textwrap.wrap(text, width, subsequent_indent=" " * left)
    return lines


def markdown_rows():
    """The settings users set, as docs/usage.md's table rows."""
    return [
        f"| `{s.shown()}` | {s.meaning}{'; ' + s.says() if s.says() else ''} |"
        for s in SETTINGS.values()
        if not s.internal
    ]
