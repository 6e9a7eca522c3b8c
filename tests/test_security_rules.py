"""Security and faults, by class: each test names the rule it holds.

1. nothing a bundle says writes outside its root (links, the runner's files);
2. member data ranges are disjoint and counted as written;
3. depth is bounded and never recursed over;
4. only regular files are read as bundles or data;
5. cleanup from the first byte (hooks before extraction, reaping dead jobs);
6. collective calls agree on their arguments first;
7. only the process that made a session ends it (fork);
8. a squatted staging directory falls back to a private one;
9. terminal output escapes control characters;
10. bad ``.npy`` headers are one clear error;
11. bad input to every command that reads a bundle is one line, never a
    traceback or a hang (a malformed manifest, a sparse terabyte, an
    ``env.watch`` that names no directory).

Bundles are crafted byte by byte from the documented format (crafttools).
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from crafttools import craft
from stagetools import (
    MPIEXEC,
    PYTHON,
    job_dirs,
    mpirun,
    mpirun_status,
    mpistage,
    results,
    uid_dir,
    write_target,
)

QUICK = 20  # seconds an error path may take, at most

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")


def run_code(bundle, env, code, ranks=2, nodes=2, extra=("--trust",), site=None):
    """Run ``python -m mpistage --bundle BUNDLE -c CODE``; return (result, status)."""
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    if site is not None:
        env["PYTHONPATH"] = str(site)
    args = ["-m", "mpistage", "--bundle", bundle, *extra, "-c", code]
    return mpirun_status(ranks, args, env, timeout=QUICK + 10)


def stage_to(bundle, folder, env, ranks=2, nodes=2):
    """Run ``mpistage stage BUNDLE --to FOLDER`` under mpiexec."""
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    args = ["-m", "mpistage", "stage", bundle, "--to", folder]
    return mpirun_status(ranks, args, env, timeout=QUICK + 10)


def refused(result, status, ranks=2, words=()):
    """Every rank exited 1, quickly, with one error line naming *words*.

    Choose *words* from the message itself, not from a path: test paths
    hold the test's name.
    """
    assert result.returncode == 1, result
    assert status == dict.fromkeys(range(ranks), 1), result
    assert result.elapsed < QUICK, result
    errors = result.errors()
    assert len(errors) == 1, result
    for word in words:
        assert word in errors[0], result
    return errors[0]


@pytest.fixture
def site(tmp_path):
    """The (empty) original root that crafted bundles name."""
    path = tmp_path / "site"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path):
    """A directory no bundle may touch, with its mtime fixed."""
    path = tmp_path / "outside"
    path.mkdir()
    os.utime(path, ns=(10**18, 10**18))
    return path


@pytest.fixture
def deep_cleanup(tmp_path):
    """Remove this test's files with a loop: pytest's own removal recurses."""
    yield
    from mpistage.node.cleanup import remove_entry

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(fd):
            remove_entry(fd, name)
    finally:
        os.close(fd)


def untouched(path):
    """Whether the *outside* directory is as the fixture made it."""
    return list(path.iterdir()) == [] and path.stat().st_mtime_ns == 10**18


def package(*extra):
    """Members of a package ``pkg`` with an ``__init__``, plus *extra*."""
    return [
        {"rel": "pkg", "type": "dir", "mode": 0o755},
        {"rel": "pkg/__init__.py", "type": "file", "data": b"X = 1\n"},
        *extra,
    ]


# -- 1. links stay inside, the runner's own files are out of reach -------------

LINKS = {
    "absolute": lambda out: [
        {"rel": "pkg/__pycache__", "type": "link", "target": str(out)}
    ],
    "climbing": lambda out: [
        {"rel": "pkg/__pycache__", "type": "link", "target": "../" * 8 + "x"}
    ],
    # Lexically inside (d/a/b/l/../../../.. is the root); the kernel follows
    # l to the root first, then climbs four levels: into tmp_path/outside.
    "through another link": lambda out: [
        {"rel": "d/a/b/l", "type": "link", "target": "../../.."},
        {
            "rel": "pkg/__pycache__",
            "type": "link",
            "target": "../d/a/b/l/" + "../" * 4 + "outside",
        },
    ],
}


@pytest.mark.parametrize("case", sorted(LINKS))
def test_bytecode_never_lands_outside_through_a_link(
    tmp_path, stage_env, stage_dir, site, outside, case
):
    bundle = craft(tmp_path / "evil.mpistage", package(*LINKS[case](outside)))
    result, status = run_code(bundle, stage_env, "import pkg", site=site)
    refused(result, status, words=["pkg/__pycache__", "inside its root"])
    assert untouched(outside)
    assert job_dirs(stage_dir) == []


def test_links_inside_the_root_still_work(tmp_path, stage_env, stage_dir, site):
    members = package(
        {"rel": "pkg/real.py", "type": "file", "data": b"Y = 2\n"},
        {"rel": "pkg/alias.py", "type": "link", "target": "real.py"},
    )
    bundle = craft(tmp_path / "ok.mpistage", members)
    code = "import pkg.alias; assert pkg.alias.Y == 2"
    result, status = run_code(bundle, stage_env, code, site=site)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result


def test_packages_bundle_may_not_choose_a_destination(
    tmp_path, stage_env, stage_dir, site
):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    roots = [{"path": str(site), "listing": [], "dest": ""}]
    members = [{"rel": ".mpistage-plan.pickle", "type": "link", "target": str(victim)}]
    bundle = craft(tmp_path / "evil.mpistage", members, roots=roots)
    result, status = run_code(bundle, stage_env, "pass", site=site)
    refused(result, status, words=["has a dest, which a packages"])
    assert victim.read_text() == "mine"


@pytest.mark.parametrize("name", [".mpistage-stage", ".mpistage-owner", ".mpistage-x"])
def test_reserved_names_are_refused(tmp_path, stage_env, outside, name):
    victim = outside / "victim"
    members = [{"rel": name, "type": "link", "target": str(victim)}]
    roots = [{"path": str(tmp_path / "env"), "listing": [], "dest": ""}]
    bundle = craft(tmp_path / "evil.mpistage", members, roots=roots, kind="env")
    result, status = stage_to(bundle, tmp_path / "env{node}", stage_env)
    refused(result, status, words=[name, "reserved for mpistage"])
    assert not victim.exists()


CHILD_PLAN = """
import os, json
plan = os.environ["MPISTAGE_CHILD"]
with open(plan, "rb") as f:
    head = f.read()
emit({"plan": plan, "json": json.loads(head) is not None})
"""


def test_children_read_a_plan_that_is_no_pickle(tmp_path, stage_env, stage_dir, tiny):
    target = write_target(tmp_path / "plan.py", CHILD_PLAN)
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], target]
    result = mpirun(2, args, env)
    assert result.returncode == 0, result
    for found in results(env, 2):
        assert found["json"] is True
        assert found["plan"].startswith(str(stage_dir))


# -- 2. data ranges ----------------------------------------------------------------


def overlapping(manifest):
    """Point every file member at the first one's bytes."""
    files = [m for m in manifest["members"] if m["type"] == "file"]
    for member in files[1:]:
        member.update(offset=files[0]["offset"], size=files[0]["size"])
        member["sha256"] = files[0]["sha256"]


def backwards(manifest):
    """Swap the data of the first two file members (ranges out of order)."""
    first, second = [m for m in manifest["members"] if m["type"] == "file"][:2]
    for key in ("offset", "size", "sha256"):
        first[key], second[key] = second[key], first[key]


@pytest.mark.parametrize("edit", [overlapping, backwards])
def test_data_ranges_are_disjoint_and_in_order(
    tmp_path, stage_env, stage_dir, site, edit
):
    members = [
        {"rel": f"m{i}.bin", "type": "file", "data": bytes([i]) * 8192}
        for i in range(64)
    ]
    bundle = craft(tmp_path / "fill.mpistage", members, edit=edit)
    result, status = run_code(bundle, stage_env, "pass", site=site)
    refused(result, status, words=["overlaps or precedes", "m1.bin"])
    assert job_dirs(stage_dir) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt])
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", mnt])


def test_room_counts_the_blocks_files_take(tmp_path, stage_env, site, small_tmpfs):
    # 400 one-byte files: 400 bytes of data, but 400 blocks (1.6 MiB) on disk.
    members = [{"rel": f"m{i}.py", "type": "file", "data": b"z"} for i in range(400)]
    bundle = craft(tmp_path / "many.mpistage", members)
    env = dict(stage_env, MPISTAGE_STAGE_DIR=str(small_tmpfs))
    result, status = run_code(bundle, env, "pass", site=site)
    refused(result, status, words=["no space left", "needed"])
    assert job_dirs(small_tmpfs) == []


# -- 3. depth ----------------------------------------------------------------------


def test_deep_member_paths_are_refused(
    tmp_path, stage_env, stage_dir, site, deep_cleanup
):
    deep = "/".join(["d"] * 1500) + "/f.py"
    bundle = craft(tmp_path / "deep.mpistage", [{"rel": deep, "type": "file"}])
    result, status = run_code(bundle, stage_env, "pass", site=site)
    refused(result, status, words=["is too deep (1502 levels"])
    assert job_dirs(stage_dir) == []


def nested(manifest):
    """Hide a value nested 600 levels deep in the manifest."""
    value = []
    for _ in range(600):
        value = [value]
    manifest["created_by"] = value


@pytest.mark.parametrize("nodes", [1, 2])
def test_deeply_nested_manifest_is_one_line(
    tmp_path, stage_env, stage_dir, site, nodes
):
    members = [{"rel": "m.py", "type": "file"}]
    bundle = craft(tmp_path / "nested.mpistage", members, edit=nested)
    result, status = run_code(bundle, stage_env, "pass", nodes=nodes, site=site)
    refused(result, status, words=["nested too deeply"])
    assert job_dirs(stage_dir) == []


def make_deep_tree(top, depth):
    """Create *depth* nested directories below *top*, by descriptors."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            (open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w")).close()
            new = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = new
    finally:
        os.close(fd)


def dead_pid():
    """Return the pid of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def fake_root(stage_dir, name, pid, keep=False):
    """Make a node's place as a leader of pid *pid* on this host would."""
    root = uid_dir(stage_dir) / name
    (root / "r0").mkdir(parents=True, mode=0o700)
    uid_dir(stage_dir).chmod(0o700)
    lines = f"kind=job\nhost={os.uname().nodename}\npid={pid}\njob={name}\n"
    (root / ".mpistage-owner").write_text(lines + ("keep=yes\n" if keep else ""))
    return root


def test_clean_removes_a_deep_tree(tmp_path, stage_env, stage_dir, deep_cleanup):
    root = fake_root(stage_dir, "job-deep.n0", dead_pid())
    make_deep_tree(root / "r0", 2500)
    done = mpistage(["clean"], env=stage_env)
    assert done.returncode == 0, done
    assert done.stdout.strip() == f"removed {root}"
    assert not root.exists()


# -- 4. non-regular files ----------------------------------------------------------


@pytest.fixture
def fifo(tmp_path):
    """A FIFO nobody writes to, named like a bundle."""
    path = tmp_path / "fifo.mpistage"
    os.mkfifo(path)
    return path


def test_runner_refuses_a_fifo_bundle(stage_env, stage_dir, fifo):
    result, status = run_code(fifo, stage_env, "pass")
    refused(result, status, words=["not a regular file", "fifo.mpistage"])


def test_stager_refuses_a_fifo_bundle(tmp_path, stage_env, fifo):
    result, status = stage_to(fifo, tmp_path / "env{node}", stage_env)
    refused(result, status, words=["not a regular file"])


def test_inspect_refuses_a_fifo(fifo, stage_env):
    done = mpistage(["inspect", fifo], env=stage_env, timeout=QUICK)
    assert done.returncode == 1, done
    assert done.errors() and "not a regular file" in done.errors()[0], done


DATA_FIFO = """
from mpi4py import MPI
from mpistage import StageError, data
try:
    data.read(sys.argv[1], comm=MPI.COMM_WORLD)
    emit("no error")
except StageError as exc:
    emit(str(exc))
"""


def test_data_refuses_a_fifo(tmp_path, stage_env, fifo):
    target = write_target(tmp_path / "t.py", "import sys\n" + DATA_FIFO)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, [target, fifo], env, timeout=QUICK + 10)
    assert result.returncode == 0, result
    found = results(env, 2)
    assert len(set(found)) == 1 and "not a regular file" in found[0], found


# -- 5. cleanup from the first byte ------------------------------------------------


@pytest.fixture(scope="module")
def slow_bundle(tmp_path_factory):
    """A bundle of 30 000 small files: extraction takes a while."""
    folder = tmp_path_factory.mktemp("slow")
    (folder / "site").mkdir()
    members = [
        {"rel": f"d{i % 100}/f{i}.py", "type": "file", "data": b"x = 1\n"}
        for i in range(30_000)
    ]
    return craft(folder / "slow.mpistage", members)


def owner_text(root):
    """The owner record of *root* so far ("" while it is not there)."""
    try:
        return (root / ".mpistage-owner").read_text()
    except OSError:
        return ""


def wait_for_owner(stage_dir, count, timeout=QUICK):
    """Wait until *count* node places have their owner record; return them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in job_dirs(stage_dir) if "pid=" in owner_text(p)]
        if len(found) >= count:
            return found
        time.sleep(0.002)
    raise AssertionError(f"no node's place appeared in {stage_dir}")


def settled(stage_dir, timeout=5.0):
    """Wait for watchdogs to finish; return the job directories left."""
    deadline = time.monotonic() + timeout
    while job_dirs(stage_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    return job_dirs(stage_dir)


def start_job(bundle, env, ranks=2, nodes=2):
    """Start a job staging *bundle* in the background; return the Popen."""
    env = dict(env, MPISTAGE_EMULATE_NODES=str(nodes))
    cmd = [MPIEXEC, "-n", str(ranks), PYTHON, "-m", "mpistage", "--bundle"]
    return subprocess.Popen(
        [*cmd, str(bundle), "--trust", "-c", "pass"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def finish(proc):
    """Make sure the job *proc* is gone."""
    try:
        proc.wait(timeout=QUICK)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_leader_killed_while_extracting_leaves_no_copy(
    stage_env, stage_dir, slow_bundle
):
    proc = start_job(slow_bundle, stage_env, nodes=1)
    try:
        (root,) = wait_for_owner(stage_dir, 1)
        owner = dict(
            line.split("=", 1)
            for line in (root / ".mpistage-owner").read_text().splitlines()
        )
        os.kill(int(owner["pid"]), signal.SIGKILL)
        assert len(list((root / "r0").glob("*/*.py"))) < 30_000  # still extracting
    finally:
        finish(proc)
    assert settled(stage_dir) == []


@pytest.mark.slow
def test_sigterm_while_extracting_leaves_no_copy(stage_env, stage_dir, slow_bundle):
    proc = start_job(slow_bundle, stage_env, nodes=2)
    try:
        wait_for_owner(stage_dir, 2)
        proc.send_signal(signal.SIGTERM)
    finally:
        finish(proc)
    assert settled(stage_dir) == []


def test_new_job_reaps_roots_of_dead_jobs(tmp_path, stage_env, stage_dir, tiny):
    dead = fake_root(stage_dir, "job-dead.n0", dead_pid())
    kept = fake_root(stage_dir, "job-kept.n0", dead_pid(), keep=True)
    live = fake_root(stage_dir, "job-live.n1", os.getpid())
    elsewhere = fake_root(stage_dir, "job-other.n0", dead_pid())
    text = (elsewhere / ".mpistage-owner").read_text()
    (elsewhere / ".mpistage-owner").write_text(text.replace("host=", "host=x"))
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]))
    result, status = run_code(tiny["bundle"], env, "import tinypkg", extra=())
    assert result.returncode == 0, result
    assert not dead.exists()
    assert kept.exists() and live.exists() and elsewhere.exists()


# -- 6. collective calls agree on their arguments ----------------------------------

DISAGREE = """
import numpy as np
from mpi4py import MPI
from mpistage import StageError, data
comm = MPI.COMM_WORLD
a, b, npy = sys.argv[1:4]
r = comm.rank
CASES = {
    "path": lambda: data.read(a if r == 0 else b, comm=comm),
    "readers": lambda: data.read(a, comm=comm, readers=1 + r % 2),
    "io": lambda: data.read(a, comm=comm, io="posix" if r == 0 else "mpiio"),
    "dtype": lambda: data.load(a, comm=comm, dtype="u1" if r == 0 else "u2"),
    "offset": lambda: data.load(a, comm=comm, dtype="u1", offset=r),
    "shape": lambda: data.load(a, comm=comm, dtype="u1", shape=(8, 8) if r else (64,)),
    "member": lambda: data.load(npy, comm=comm, member=None if r == 0 else "x"),
}
out = {}
for case, call in CASES.items():
    try:
        call()
        out[case] = "no error"
    except StageError as exc:
        out[case] = str(exc)
    comm.Barrier()
out["after"] = bytes(data.read(a, comm=comm).view).hex()
emit(out)
"""


def test_collective_data_calls_agree_on_their_arguments(tmp_path, stage_env):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(bytes(range(64)))
    b.write_bytes(bytes(range(64, 128)))
    npy = tmp_path / "x.npy"
    np.save(npy, np.arange(4))
    target = write_target(tmp_path / "t.py", "import sys\n" + DISAGREE)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(4, [target, a, b, npy], env, timeout=QUICK + 20)
    assert result.returncode == 0, result
    found = results(env, 4)
    for case in ("path", "readers", "io", "dtype", "offset", "shape", "member"):
        messages = {out[case] for out in found}
        assert len(messages) == 1, (case, found)
        assert "differ" in messages.pop(), (case, found)
    assert {out["after"] for out in found} == {bytes(range(64)).hex()}


# -- 7. fork ---------------------------------------------------------------------

FORK = """
import os, sys
import tinypkg
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child ends as a script does
os.waitpid(pid, 0)
import tinypkg.sub  # first imported now: still from the node's copy
emit({"sub": where(tinypkg.sub)})
"""


def test_forked_child_leaves_the_copy_alone(tmp_path, stage_env, stage_dir, tiny):
    target = write_target(tmp_path / "fork.py", FORK)
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    args = ["-m", "mpistage", "--bundle", tiny["bundle"], target]
    result, status = mpirun_status(2, args, env, timeout=QUICK + 10)
    assert result.returncode == 0 and status == {0: 0, 1: 0}, result
    for found in results(env, 2):
        assert found["sub"].startswith(str(stage_dir)), found
    assert job_dirs(stage_dir) == []


STAGED_FORK = """
import os, sys
from mpi4py import MPI
import mpistage
pid = None
try:
    with mpistage.staged(sys.argv[1], comm=MPI.COMM_WORLD):
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # leaves the block in the child
        os.waitpid(pid, 0)
        import tinypkg.sub
        emit({"sub": where(tinypkg.sub)})
finally:
    if pid == 0:
        os._exit(0)  # as multiprocessing ends a child: MPI is the parent's
"""


def test_forked_child_leaves_a_staged_block_alone(tmp_path, stage_env, stage_dir, tiny):
    target = write_target(tmp_path / "fork.py", STAGED_FORK)
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, [target, tiny["bundle"]], env, timeout=QUICK + 10)
    assert result.returncode == 0, result
    for found in results(env, 2):
        assert found["sub"].startswith(str(stage_dir)), found
    assert job_dirs(stage_dir) == []


# -- 8. squatting --------------------------------------------------------------------


def test_squatted_user_directory_falls_back_to_a_private_one(
    tmp_path, stage_env, stage_dir, tiny
):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    stage_dir.chmod(0o1777)
    squat = uid_dir(stage_dir)
    squat.mkdir()
    os.chown(squat, 4242, 4242)
    target = write_target(
        tmp_path / "t.py", "import tinypkg\nemit({'file': where(tinypkg)})\n"
    )
    env = dict(stage_env, PYTHONPATH=str(tiny["site"]), MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, ["-m", "mpistage", "--bundle", tiny["bundle"], target], env)
    assert result.returncode == 0, result
    for found in results(env, 2):
        used = Path(found["file"]).relative_to(stage_dir).parts[0]
        assert used.startswith(f"mpistage-{os.getuid()}-"), found
    assert sorted(p.name for p in stage_dir.iterdir()) == [squat.name]


# -- 9. terminal output ------------------------------------------------------------


def test_inspect_escapes_control_characters(tmp_path, stage_env):
    name = "evil\x1b[2J\rname.py"
    members = [{"rel": name, "type": "file", "data": b"x" * 100}]
    roots = [{"path": str(tmp_path / "s\x07ite"), "listing": []}]
    bundle = craft(tmp_path / "ctl.mpistage", members, roots=roots)
    done = mpistage(["inspect", bundle], env=stage_env)
    assert done.returncode == 0, done
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\r" not in done.stdout
    assert "evil\\x1b[2J\\rname.py" in done.stdout
    assert "s\\x07ite" in done.stdout


# -- 10. .npy headers --------------------------------------------------------------

NPY = """
from mpi4py import MPI
from mpistage import StageError, data
try:
    data.load(sys.argv[1], comm=MPI.COMM_WORLD)
    emit("no error")
except StageError as exc:
    emit(str(exc))
"""


def npy_with_header(path, header):
    """Write a version 1.0 .npy file whose header dict is *header*."""
    text = header + " " * (-(len(header) + 11) % 64) + "\n"
    raw = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()
    path.write_bytes(raw + bytes(64))
    return path


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': '<f8', 'fortran_order': False, 'shape': (-1, 3), }",
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2, -3), }",
        "{'descr': 'not a dtype', 'fortran_order': False, 'shape': (2,), }",
        "{'descr': '|V0', 'fortran_order': False, 'shape': (4,), }",
        "{'descr': '<U0', 'fortran_order': False, 'shape': (2, 2), }",
    ],
)
def test_bad_npy_header_is_one_error_everywhere(tmp_path, stage_env, header):
    npy = npy_with_header(tmp_path / "bad.npy", header)
    target = write_target(tmp_path / "t.py", "import sys\n" + NPY)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, [target, npy], env, timeout=QUICK + 10)
    assert result.returncode == 0, result
    found = results(env, 2)
    assert len(set(found)) == 1, found
    assert "bad.npy" in found[0] and "\n" not in found[0], found


RAW = """
from mpi4py import MPI
from mpistage import StageError, data
try:
    data.load(sys.argv[1], comm=MPI.COMM_WORLD, dtype=sys.argv[2])
    emit("no error")
except StageError as exc:
    emit(str(exc))
"""


@pytest.mark.parametrize("size", [0, 64])
@pytest.mark.parametrize("dtype", ["V0", "U0", "S0"])
def test_raw_items_without_bytes_are_one_error_everywhere(
    tmp_path, stage_env, dtype, size
):
    raw = tmp_path / "items.raw"
    raw.write_bytes(bytes(size))
    target = write_target(tmp_path / "t.py", "import sys\n" + RAW)
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, [target, raw, dtype], env, timeout=QUICK + 10)
    assert result.returncode == 0, result
    found = results(env, 2)
    assert len(set(found)) == 1, found
    assert "no bytes" in found[0] and "\n" not in found[0], found


# -- 11. bad input to every command that reads a bundle ----------------------------


def member(**extra):
    """One file member ``m.py``, with *extra* keys changed after crafting."""
    return {"rel": "m.py", "type": "file", **extra}


def set_member(**values):
    """An edit that sets *values* in the first member's manifest entry."""
    return lambda manifest: manifest["members"][0].update(values)


def drop(key):
    """An edit that removes *key* from the manifest."""
    return lambda manifest: manifest.pop(key)


# name: (craft keywords, words of the one line)
MALFORMED = {
    "not JSON": ({"raw": b"{members: ["}, ["is malformed: manifest:"]),
    "not an object": ({"raw": b'["members"]'}, ["manifest is not an object"]),
    "member of the wrong type": (
        {"edit": lambda m: m["members"].append("m.py")},
        ["member 1 is not an object"],
    ),
    "size as text": ({"edit": set_member(size="1")}, ["member 0 has no offset"]),
    "negative offset": (
        {"edit": set_member(offset=-64)},
        ["member 0 has a bad offset"],
    ),
    "huge size": ({"edit": set_member(size=2**70)}, ["outside the data section"]),
    "huge mode": ({"edit": set_member(mode=2**70)}, ["member 0 has a bad mode"]),
    "huge mtime": ({"edit": set_member(mtime_ns=2**70)}, ["bad mtime_ns"]),
    "no members key": ({"edit": drop("members")}, ["manifest has no members list"]),
    "sha256 a number": ({"edit": set_member(sha256=5)}, ["member 0 has a bad sha256"]),
    "packages not a list": (
        {"edit": lambda m: m.update(packages=5)},
        ["manifest has a bad packages list"],
    ),
    "root identity of one number": (
        {"edit": lambda m: m["roots"][0].update(identity=[7])},
        ["root 0 has a bad identity"],
    ),
    "stdlib stamp without a name": (
        {"edit": lambda m: m["roots"][0].update(stdlib=[1, 2])},
        ["root 0 has a bad stdlib stamp"],
    ),
    "dists as a list": (
        {"edit": lambda m: m["roots"][0].update(dists=["x"])},
        ["root 0 has a bad dists"],
    ),
}


def malformed(tmp_path, case, kind="packages"):
    """Craft the bundle of the *case* of :data:`MALFORMED`; return (path, words)."""
    keywords, words = MALFORMED[case]
    roots = None
    if kind == "env":
        roots = [{"path": str(tmp_path / "site"), "listing": [], "dest": "lib"}]
    path = craft(tmp_path / "bad.mpistage", [member()], roots, kind, **keywords)
    return path, words


def one_line(done, words=()):
    """A tool's refusal: status 1, one error line with *words*, no traceback."""
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done
    assert len(done.errors()) == 1, done
    for word in words:
        assert word in done.errors()[0], done


def run_env(bundle, env, tmp_path):
    """``mpistage run --env BUNDLE -- mpiexec -n 2 python -c pass``."""
    line = [MPIEXEC, "-n", "2", PYTHON, "-c", "pass"]
    args = ["run", "--env", bundle, "--to", tmp_path / "to{node}", "--", *line]
    return mpistage(args, env=dict(env, MPISTAGE_EMULATE_NODES="2"), timeout=QUICK)


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_manifest_is_one_line_in_inspect(tmp_path, stage_env, case):
    bundle, words = malformed(tmp_path, case)
    one_line(mpistage(["inspect", bundle], env=stage_env, timeout=QUICK), words)


@pytest.mark.parametrize("trust", [(), ("--trust",)])
@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_manifest_ends_the_runner_on_every_rank(
    tmp_path, stage_env, stage_dir, site, case, trust
):
    """With or without ``--trust``: the staleness check reads the roots too."""
    bundle, words = malformed(tmp_path, case)
    (site / "m.py").write_text("x")
    code = "print('ran')"
    result, status = run_code(bundle, stage_env, code, site=site, extra=trust)
    refused(result, status, words=["is malformed", *words])
    assert "Traceback" not in result.stderr, result
    assert job_dirs(stage_dir) == []


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_manifest_is_one_line_in_stage_and_run(
    tmp_path, stage_env, site, case
):
    bundle, words = malformed(tmp_path, case, kind="env")
    result, status = stage_to(bundle, tmp_path / "env{node}", stage_env)
    refused(result, status, words=words)
    one_line(run_env(bundle, stage_env, tmp_path), words)


@pytest.fixture
def terabyte(tmp_path):
    """A sparse file of 1 TiB named like a bundle (``truncate -s 1T``)."""
    path = tmp_path / "big.mpistage"
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    return path


def test_a_sparse_terabyte_is_one_line_for_every_command(
    tmp_path, stage_env, stage_dir, terabyte
):
    words = ["is not an mpistage bundle"]
    one_line(mpistage(["inspect", terabyte], env=stage_env, timeout=QUICK), words)
    refused(*run_code(terabyte, stage_env, "pass"), words=words)
    refused(*stage_to(terabyte, tmp_path / "env{node}", stage_env), words=words)
    one_line(run_env(terabyte, stage_env, tmp_path), words)
    assert job_dirs(stage_dir) == []


def watching(path):
    """An environment bundle's edit: ``env.watch`` names *path* (any value)."""
    return lambda manifest: manifest.update(env={"watch": [path]})


@pytest.fixture
def not_dirs(tmp_path):
    """A FIFO nobody writes to and a regular file, by kind."""
    fifo, file = tmp_path / "fifo", tmp_path / "file"
    os.mkfifo(fifo)
    file.write_text("x")
    return {"fifo": str(fifo), "file": str(file)}


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_a_watched_path_that_is_no_directory_is_stale_never_a_hang(
    tmp_path, stage_env, site, not_dirs, kind
):
    """Stale: the bundle watched a directory there; it was never opened."""
    roots = [{"path": str(site), "listing": [], "dest": "lib"}]
    entry = [not_dirs[kind], 1, "digest"]
    bundle = craft(
        tmp_path / "w.mpistage", [member()], roots, "env", edit=watching(entry)
    )
    result, status = stage_to(bundle, tmp_path / "env{node}", stage_env)
    refused(result, status, words=["is stale", kind])
    one_line(run_env(bundle, stage_env, tmp_path), ["is stale", kind])


@pytest.mark.parametrize(
    "entry", ["/usr/lib", ["/usr/lib", 1], ["lib", 1, None], ["/usr/lib", "1", None], 7]
)
def test_a_malformed_watch_entry_is_one_line(tmp_path, stage_env, site, entry):
    roots = [{"path": str(site), "listing": [], "dest": "lib"}]
    bundle = craft(
        tmp_path / "w.mpistage", [member()], roots, "env", edit=watching(entry)
    )
    words = ["is malformed: manifest has a bad env.watch entry"]
    result, status = stage_to(bundle, tmp_path / "env{node}", stage_env)
    refused(result, status, words=words)
    one_line(mpistage(["inspect", bundle], env=stage_env, timeout=QUICK), words)
    one_line(run_env(bundle, stage_env, tmp_path), words)
