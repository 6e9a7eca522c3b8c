"""Two ordinary users of this machine: the victim, and another user on the same nodes.

The tests of what another user can do run the launches as users run them,
never as root: root's ``kill -0`` reaches every process, root may write
where a user may not, and a test as root hides exactly what fails for
everybody else. As root, the suite makes two users (``useradd``, kept for
later runs) and runs their commands with ``setpriv``; each gets a private
directory of its own below :data:`BASE`. Without root, ``useradd`` or
``setpriv``, these tests skip with one line.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stagetools import clean_environ, run

VICTIM, OTHER = "mpistage-victim", "mpistage-other"
BASE = Path("/tmp/mpistage-users")  # world-traversable; each user's part is 0700
ROOT = Path(__file__).resolve().parent.parent
PATH = "/usr/bin:/bin"
CLEAN = ("SLURM_", "OMPI_", "PMI", "PMIX_", "FLUX_", "PBS_", "LSB_", "XDG_", "TMPDIR")


class User:
    """An ordinary user: its name, uid, gid and a private directory of its own."""

    def __init__(self, name):
        import pwd

        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, entry.pw_uid, entry.pw_gid
        self.home = BASE / name

    def command(self, args):
        """*args* run as this user, with no group or capability of root's."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}",
                "--clear-groups", "--inh-caps=-all", *map(str, args)]  # fmt: skip

    def environ(self, **extra):
        """A login's environment for this user, with *extra* settings."""
        env = {
            k: v
            for k, v in clean_environ().items()
            if not k.startswith(CLEAN) and k != "VIRTUAL_ENV"
        }
        env.update(HOME=str(self.home), USER=self.name, LOGNAME=self.name, PATH=PATH)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, args, env, cwd=None, timeout=120):
        """Run *args* as this user (see :func:`stagetools.run`)."""
        return run(self.command(args), env, cwd=cwd or self.home, timeout=timeout)

    def start(self, args, env, cwd=None):
        """Start *args* as this user, in a session of its own."""
        return subprocess.Popen(
            self.command(args),
            env=env,
            cwd=cwd or self.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def folder(self, name, mode=0o700):
        """A new directory *name* of this user's below its own; returns it."""
        path = self.home / name
        if path.exists():
            subprocess.run(["rm", "-rf", str(path)], check=True)
        path.mkdir(mode=mode)
        path.chmod(mode)
        self.own(path)
        return path

    def own(self, path):
        """Make *path*, and everything below it, this user's."""
        subprocess.run(
            ["chown", "-hR", f"{self.uid}:{self.gid}", str(path)], check=True
        )

    def kill_all(self):
        """SIGKILL every process of this user (a launch killed outright)."""
        subprocess.run(["pkill", "-KILL", "-U", str(self.uid)], check=False)


class Subreaper:
    """While inside, the test process adopts orphans; on exit, it reaps them.

    A launch killed outright leaves its launcher's processes to init, which in
    a container may never reap them: a zombie holds its pid for good.
    """

    PR_SET_CHILD_SUBREAPER = 36

    def __enter__(self):
        self.prctl(1)
        return self

    def __exit__(self, *exc):
        self.reap()
        self.prctl(0)

    def prctl(self, value):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(self.PR_SET_CHILD_SUBREAPER, value)

    @staticmethod
    def reap():
        """Collect every child that has ended."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return


def missing():
    """Why the two users cannot be had here, or ``""``."""
    if os.getuid() != 0:
        return "not root: the tests as two ordinary users need root to make them"
    for tool in ("useradd", "setpriv", "pkill"):
        if shutil.which(tool) is None:
            return f"no {tool}: the tests as two ordinary users need it"
    return ""


def ensure(name):
    """Make the user *name* if it does not exist; return it."""
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", name],
            capture_output=True,
            text=True,
        )
        if made.returncode not in (0, 9):  # 9: made meanwhile
            pytest.skip(f"useradd {name} failed: {made.stderr.strip()}")
    user = User(name)
    BASE.mkdir(mode=0o755, exist_ok=True)
    BASE.chmod(0o755)
    user.home.mkdir(mode=0o700, exist_ok=True)
    user.home.chmod(0o700)
    user.own(user.home)
    return user


def python_for(user):
    """A venv of Debian's Python with this checkout's mpistage, the user's own.

    As ``pip install -e`` would leave it: a ``.pth`` naming the sources.
    Made once per user; the suite's own venv is root's and not theirs.
    """
    venv = user.home / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        base = Path("/usr/bin/python3")
        if not base.exists():
            pytest.skip("no /usr/bin/python3 for the ordinary users' venv")
        made = user.run([base, "-m", "venv", "--without-pip", venv], user.environ())
        assert made.returncode == 0, made
    for site in venv.glob("lib/python3*/site-packages"):
        pth = site / "mpistage-checkout.pth"
        pth.write_text(f"{ROOT / 'src'}\n")
        user.own(pth)
    return python
