"""Helpers of the mpistage tests: real ``mpiexec`` launches, bundles, results.

Every subprocess has a timeout and runs in its own session, so a hung job is
killed whole (``mpiexec`` and all its ranks), never left behind.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpistage.runtime import bundlefile
from mpistage.runtime.read import read_manifest

PYTHON = sys.executable
TIMEOUT = 60


def find_mpiexec():
    """Return the mpiexec next to this Python (the MPICH wheel), else on PATH."""
    sibling = Path(PYTHON).parent / "mpiexec"
    if sibling.exists():
        return str(sibling)
    return shutil.which("mpiexec")


MPIEXEC = find_mpiexec()


class Result:
    """What a finished subprocess did, and how long it took."""

    def __init__(self, args, returncode, stdout, stderr, elapsed):
        self.args, self.returncode = args, returncode
        self.stdout, self.stderr, self.elapsed = stdout, stderr, elapsed

    def errors(self):
        """Return the ``mpistage: error:`` lines of stderr."""
        return [
            line
            for line in self.stderr.splitlines()
            if line.startswith("mpistage: error:")
        ]

    def __repr__(self):
        return (
            f"<Result rc={self.returncode} {self.elapsed:.1f}s args={self.args!r}\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}>"
        )


def run(args, env=None, cwd=None, timeout=TIMEOUT):
    """Run *args*; kill its whole process group if it outlives *timeout*."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(a) for a in args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"timed out after {timeout} s: {args!r}\n--- stdout\n{out}\n"
            f"--- stderr\n{err}"
        )
    finally:
        try:  # ranks that outlived mpiexec, if any
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Result(args, proc.returncode, out, err, time.monotonic() - start)


def mpirun(n, args, env, cwd=None, timeout=TIMEOUT):
    """Run ``mpiexec -n N python ARGS``."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    return run([MPIEXEC, "-n", n, PYTHON, *args], env=env, cwd=cwd, timeout=timeout)


# Wraps each rank so that it reports its own exit status on stdout.
RANK_STATUS = '"$0" "$@"; rc=$?; echo "rank $PMI_RANK exit $rc"; exit $rc'


def mpirun_status(n, args, env, cwd=None, timeout=TIMEOUT):
    """Like :func:`mpirun`; also return {rank: exit status} of every rank."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    cmd = [MPIEXEC, "-n", n, "sh", "-c", RANK_STATUS, PYTHON, *args]
    result = run(cmd, env=env, cwd=cwd, timeout=timeout)
    status = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "rank" and parts[2] == "exit":
            status[int(parts[1])] = int(parts[3])
    return result, status


def mpistage(args, env, cwd=None, timeout=TIMEOUT):
    """Run a tool: ``python -m mpistage ARGS`` (no mpiexec)."""
    return run([PYTHON, "-m", "mpistage", *args], env=env, cwd=cwd, timeout=timeout)


def clean_environ():
    """Return os.environ without any MPISTAGE_* setting or PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPISTAGE_")}
    env.pop("PYTHONPATH", None)
    return env


def uid_dir(candidate):
    """Return ``<candidate>/mpistage-<uid>``."""
    return Path(candidate) / f"mpistage-{os.getuid()}"


def job_dirs(candidate):
    """Return the job directories (node places) below *candidate*."""
    return sorted(Path(candidate).glob("mpistage-*/job-*"))


# A target prepends this to write one JSON result per rank (or "plain"),
# which is more robust than parsing interleaved stdout of several ranks.
EMIT = """\
import json as _json, os as _os
def where(module):
    # The file a module was read from: a module of a tree no distribution owns
    # keeps its original __file__ and is read from the staged copy.
    loader = getattr(module, "__loader__", None)
    path = module.__file__
    return loader.staged_path(path) if hasattr(loader, "staged_path") else path
def emit(data):
    rank = _os.environ.get("PMI_RANK", "plain")
    out = _os.path.join(_os.environ["MPISTAGE_TEST_OUT"], rank + ".json")
    with open(out, "w") as f:
        _json.dump(data, f)
"""


def write_target(path, body):
    """Write a target script: :data:`EMIT` followed by *body*."""
    path = Path(path)
    path.write_text(EMIT + body)
    return path


def results(env, ranks):
    """Return the emitted results of ranks 0..ranks-1, checking all are there."""
    out = Path(env["MPISTAGE_TEST_OUT"])
    found = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(found) == sorted(str(r) for r in range(ranks)), found
    return [found[str(r)] for r in range(ranks)]


def pack(output, *args, env=None, cwd=None):
    """Run ``mpistage pack -o OUTPUT ARGS``, asserting success."""
    result = mpistage(
        ["pack", "-o", output, *args], env=env or clean_environ(), cwd=cwd
    )
    assert result.returncode == 0, result
    return Path(output)


def mapped_files():
    """Return the paths of the files some process of this machine maps."""
    found = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process is gone, or not ours to read
            continue
        found.update(line.split()[-1] for line in text.splitlines() if "/" in line)
    return found


def reap_shm(before):
    """Remove MPICH segments in /dev/shm that appeared since *before*, unused.

    MPICH cannot remove its shared memory segment when a job ends in
    ``MPI_Abort``; a segment that no process maps any more is garbage.
    """
    new = set(Path("/dev/shm").glob("mpich_shm_*")) - before
    new = {p for p in new if p.exists() and p.stat().st_uid == os.getuid()}
    deadline = time.monotonic() + 3  # killed ranks may still be exiting
    while new:
        used = mapped_files()
        for path in list(new):
            if str(path) not in used:
                path.unlink(missing_ok=True)
                new.discard(path)
        if not new or time.monotonic() > deadline:
            break  # what is left belongs to a job that is still running
        time.sleep(0.05)


def sha256(path):
    """Return the SHA-256 of the file at *path* in hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_digests(root):
    """Return {relative path: sha256} of every regular file below *root*.

    ``__pycache__`` is left out: Python writes bytecode there whenever it
    imports a module (into an original after packing, into a copy as a rank
    runs), so it is no file of the bundle's to compare.
    """
    root = Path(root)
    return {
        str(p.relative_to(root)): sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.is_symlink()
        and "__pycache__" not in p.relative_to(root).parts
    }


def make_site(site):
    """Create a small sys.path root: ``tinypkg`` (bundled) and ``othermod``.

    ``tinypkg`` has a subpackage, a data module and a 10 000-byte blob with a
    size that is no multiple of any small chunk size.
    """
    site = Path(site)
    pkg = site / "tinypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    (pkg / "data.py").write_text("TEXT = 'tiny data'\n")
    (pkg / "sub" / "__init__.py").write_text("from tinypkg.data import TEXT\n")
    (pkg / "main.py").write_text(
        "import sys\n"
        "from tinypkg import VALUE\n"
        "print('tinypkg.main', VALUE, sys.argv[1:])\n"
    )
    blob = bytes((i * 7919 + 13) % 251 for i in range(10_000))
    (pkg / "blob.bin").write_bytes(blob)
    (site / "othermod.py").write_text("OTHER = 'not bundled'\n")
    install_record(site, "tinypkg", "1.0")
    return site


def install_record(site, name, version):
    """Make *name* in *site* an installed distribution: a dist-info with RECORD.

    Files a distribution owns are served with their staged paths; trees no
    distribution owns keep their original ``__file__`` (docs/usage.md).
    """
    site = Path(site)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    files = sorted(p for p in (site / name).rglob("*") if p.is_file())
    lines = [f"{p.relative_to(site)},," for p in files]
    lines += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(lines) + "\n")


def rewrite_manifest(src, dst, edit):
    """Copy the bundle *src* to *dst* with its manifest changed by *edit*.

    The result is a valid bundle (header, offsets and manifest checksum are
    consistent): only what *edit* changed differs.
    """
    raw = Path(src).read_bytes()
    _magic, fmt, reserved, offset, _length, _digest = bundlefile.HEADER.unpack_from(raw)
    manifest = read_manifest(src)
    edit(manifest)
    new = json.dumps(manifest, separators=(",", ":")).encode()
    digest = hashlib.sha256(new).digest()
    header = bundlefile.HEADER.pack(
        bundlefile.MAGIC, fmt, reserved, offset, len(new), digest
    )
    header = header.ljust(bundlefile.HEADER_SIZE, b"\0")
    Path(dst).write_bytes(header + raw[bundlefile.HEADER_SIZE : offset] + new)
    return Path(dst)


def flip_byte(src, dst, position):
    """Copy *src* to *dst* with the byte at *position* inverted."""
    data = bytearray(Path(src).read_bytes())
    data[position] ^= 0xFF
    Path(dst).write_bytes(bytes(data))
    return Path(dst)


def first_file_member(manifest):
    """Return the first file member with some data."""
    return next(m for m in manifest["members"] if m["type"] == "file" and m["size"])
