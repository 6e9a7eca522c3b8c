"""``mpistage pack --env`` and ``mpistage stage``: whole environments, node-local.

A small venv (numpy, mpi4py and the MPICH wheel on the project's base
interpreter, see ``envtools``) is packed once and staged for two emulated
nodes once; most tests look at that one stage. Then the staged tree runs
an MPI job under ``strace`` to show that nothing of the original venv or
its base interpreter is touched any more. The refusals each stage the same
bundle into a directory that must not be used and check that every rank
fails with one error line and nothing half-written is left.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envtools import elf_files, opened, runpaths, small_venv, trace_paths, under
from mpistage.bundle import elfdeps
from mpistage.runtime.read import read_manifest
from mpistage.runtime.roots import destinations
from stagetools import (
    MPIEXEC,
    PYTHON,
    clean_environ,
    flip_byte,
    job_dirs,
    mpirun_status,
    mpistage,
    run,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("reap_mpich_shm")]

SHELL_LINE = re.compile(r"^(export [A-Z_]+=|unset [A-Z_ ]+$)")


class Staged:
    """The module's one stage: the run's result and the two node dirs."""

    def __init__(self, base, result, status):
        self.base, self.result, self.status = base, result, status
        self.n0, self.n1 = base / "envs" / "n0", base / "envs" / "n1"
        self.lines = shell_lines(result)


def shell_lines(result):
    """Return stdout without the ``rank N exit M`` lines of mpirun_status."""
    return [ln for ln in result.stdout.splitlines() if not ln.startswith("rank ")]


def stage(n, bundle, to, nodes=None, extra=(), cwd=None):
    """Run ``mpiexec -n N python -m mpistage stage BUNDLE --to TO``."""
    env = clean_environ()
    if nodes:
        env["MPISTAGE_EMULATE_NODES"] = str(nodes)
    args = ["-m", "mpistage", "stage", bundle, "--to", to, *extra]
    return mpirun_status(n, args, env, cwd=cwd)


def assert_refused(outcome, ranks, *words):
    """Every rank exited 1; rank 0 printed one error line with *words*."""
    result, status = outcome
    assert result.returncode == 1, result
    assert status == {rank: 1 for rank in range(ranks)}, result
    errors = result.errors()
    assert len(errors) == 1, result
    for word in words:
        assert word in errors[0], result
    assert "export " not in result.stdout, result
    return errors[0]


def empty_or_absent(path):
    path = Path(path)
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def listing(root):
    """Return {relative path: (kind, size)} of everything below *root*."""
    root, found = Path(root), {}
    for path in root.rglob("*"):
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        size = path.lstat().st_size if kind == "file" else 0
        found[str(path.relative_to(root))] = (kind, size)
    return found


@pytest.fixture
def discard():
    """Paths to remove after the test (staged trees and bundle copies are big)."""
    paths = []
    yield paths.append
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    return small_venv(tmp_path_factory)


@pytest.fixture(scope="module")
def env_bundle(venv, tmp_path_factory):
    """The small venv packed with ``mpistage pack --env``, once."""
    path = tmp_path_factory.mktemp("envbundle") / "env.mpistage"
    result = mpistage(["pack", "--env", venv.prefix, "-o", path], clean_environ())
    assert result.returncode == 0, result
    assert path.is_file()
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def staged(env_bundle, tmp_path_factory):
    """The bundle staged with 4 ranks on 2 emulated nodes into ``envs/n{node}``."""
    base = tmp_path_factory.mktemp("envstage")
    (base / "envs").mkdir()
    result, status = stage(4, env_bundle, base / "envs" / "n{node}", nodes=2, cwd=base)
    assert result.returncode == 0, result
    yield Staged(base, result, status)
    shutil.rmtree(base, ignore_errors=True)


def test_stage_fills_one_dir_per_node(staged, env_bundle, venv):
    result, n0, n1 = staged.result, staged.n0, staged.n1
    assert staged.status == {0: 0, 1: 0, 2: 0, 3: 0}, result
    assert result.errors() == [], result
    assert "on 2 node(s) (0 already staged)" in result.stderr, result
    assert sorted(p.name for p in (staged.base / "envs").iterdir()) == ["n0", "n1"]

    lines = staged.lines
    assert all(SHELL_LINE.match(line) for line in lines), lines
    assert f'export PATH="{n0}/bin:$PATH"' in lines
    assert "export PYTHONNOUSERSITE=1" in lines
    assert "unset PYTHONHOME PYTHONPATH" in lines
    # Libraries from outside the venv were bundled into DIR/lib.
    keep = "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    assert f'export LD_LIBRARY_PATH="{n0}/lib{keep}"' in lines

    manifest = read_manifest(env_bundle)
    dests = destinations(manifest)
    for folder in (n0, n1):
        assert folder.stat().st_mode & 0o777 == 0o700
        marker = (folder / ".mpistage-stage").read_text().splitlines()
        assert "state=complete" in marker
        assert len(marker[0].partition("=")[2]) == 64
        for member in manifest["members"]:
            dest = dests[member["root"]]
            path = os.path.join(folder, dest, member["rel"])
            assert os.path.lexists(path), member
        # A venv stays one, its base below it; pyvenv.cfg names where it landed.
        cfg = (folder / "pyvenv.cfg").read_text()
        assert f"home = {folder}/base/bin\n" in cfg, cfg
        assert str(venv.prefix) not in cfg and str(venv.base) not in cfg, cfg
        # DIR/bin/python is a real file, or a symlink that stays inside DIR.
        python = folder / "bin" / "python"
        if python.is_symlink():
            assert not os.path.isabs(os.readlink(python))
        assert python.resolve().is_relative_to(folder)
        assert python.resolve().is_file() and not python.resolve().is_symlink()
    assert listing(n0) == listing(n1)


@pytest.fixture
def strace(tmp_path):
    """The strace command, if this machine lets it trace."""
    path = shutil.which("strace")
    if path is None:
        pytest.skip("strace is not installed")
    probe = run([path, "-f", "-qq", "-o", tmp_path / "probe", "true"], timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here (ptrace): {probe.stderr.strip()}")
    return path


RANK_CODE = """\
import json, os, sys, ssl, numpy, mpi4py.MPI as M
world = M.COMM_WORLD
info = {"rank": world.rank, "size": world.size, "sum": world.allreduce(1),
        "numpy": numpy.__file__, "mpi": M.__file__, "ssl": ssl._ssl.__file__,
        "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "executable": sys.executable, "path": sys.path}
os.write(1, ("RESULT " + json.dumps(info) + "\\n").encode())
"""


def test_staged_run_touches_only_node_local_storage(
    staged, venv, env_bundle, strace, tmp_path
):
    n0 = staged.n0
    trace = tmp_path / "trace"
    # As a job script would: a bare environment, the printed lines eval'ed,
    # then mpiexec found on PATH, that is the staged one.
    environ = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path))}
    command = [
        "/bin/sh",
        "-c",
        'eval "$1"; shift; exec "$@"',
        "sh",
        "\n".join(staged.lines),
        strace,
        "-f",
        "-qq",
        "-s",
        "4096",
        "-e",
        "trace=%file",
        "-o",
        trace,
        "mpiexec",
        "-n",
        "4",
        n0 / "bin" / "python",
        "-c",
        RANK_CODE,
    ]
    result = run(command, env=environ, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result

    ranks = [
        json.loads(line.split(" ", 1)[1])
        for line in result.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3], result
    for info in ranks:
        assert info["size"] == 4 and info["sum"] == 4, info
        for key in ("numpy", "mpi", "ssl", "executable"):
            assert Path(info[key]).is_relative_to(n0), (key, info)
        assert info["prefix"] == str(n0), info
        assert info["base_prefix"] == str(n0 / "base"), info
        assert all(under(p, n0) for p in info["path"] if p), info

    text = trace.read_text()
    paths = trace_paths(text)
    # The trace saw the job: mpiexec, its proxy and the ranks, from n0.
    assert str(n0 / "bin" / "mpiexec") in paths
    assert str(n0 / "bin" / "hydra_pmi_proxy") in paths
    loaded = opened(text)
    assert str(n0 / "lib" / "libmpi.so.12") in loaded
    assert str(venv.site.relative_to(venv.prefix)) in ranks[0]["numpy"]
    numpy_dir = os.path.dirname(ranks[0]["numpy"])
    assert [p for p in loaded if under(p, numpy_dir) and p.endswith(".so")]
    needed = elfdeps.dynamic((n0 / "bin" / "python").resolve())[0]
    for name in needed:
        if name.startswith("libpython"):
            # From the base's run path, $ORIGIN/../lib.
            assert str(n0 / "base" / "lib" / name) in map(os.path.normpath, loaded)

    forbidden = {
        "the original venv": venv.prefix,
        "the base interpreter's prefix": venv.base,
        "the project venv": Path(sys.prefix),
        "the bundle's directory": env_bundle.parent,
        "the other node's dir": staged.n1,
    }
    for what, prefix in forbidden.items():
        hits = sorted(p for p in paths if under(p, prefix))
        assert hits == [], f"the staged run touched {what}: {hits[:20]}"
    # The only shared libraries loaded from outside n0 are glibc's.
    outside = sorted(
        p for p in loaded if re.search(r"\.so(\.[0-9]+)*$", p) and not under(p, n0)
    )
    kept = elfdeps.Closure()
    assert [p for p in outside if not kept.excluded(os.path.basename(p))] == []


def test_restaging_the_same_bundle_reuses_the_dirs(staged, env_bundle):
    n0, n1 = staged.n0, staged.n1
    watched = [
        n0 / ".mpistage-stage",
        (n0 / "bin" / "python").resolve(),
        n1 / "lib" / "libmpi.so.12",
        n1 / "bin" / "hello",
    ]

    def stats():
        return [(s.st_ino, s.st_mtime_ns, s.st_ctime_ns) for s in map(os.stat, watched)]

    before, tree = stats(), (listing(n0), listing(n1))
    result, status = stage(
        4, env_bundle, staged.base / "envs" / "n{node}", nodes=2, cwd=staged.base
    )
    assert result.returncode == 0, result
    assert status == {0: 0, 1: 0, 2: 0, 3: 0}, result
    assert "on 2 node(s) (2 already staged)" in result.stderr, result
    assert shell_lines(result) == staged.lines
    assert stats() == before
    assert (listing(n0), listing(n1)) == tree


def test_print_env_prints_only_shell_lines(staged, env_bundle):
    result, status = stage(
        2,
        env_bundle,
        staged.base / "envs" / "n{node}",
        nodes=2,
        extra=["--print-env"],
        cwd=staged.base,
    )
    assert result.returncode == 0, result
    assert status == {0: 0, 1: 0}, result
    lines = shell_lines(result)
    assert lines == staged.lines
    assert all(SHELL_LINE.match(line) for line in lines), lines
    assert "staged" not in result.stderr and "export" not in result.stderr


def test_inspect_shows_a_venv_with_its_base(env_bundle, venv):
    result = mpistage(["inspect", env_bundle], clean_environ())
    assert result.returncode == 0, result
    assert f"environment: venv {venv.prefix} with base {venv.base}" in result.stdout
    manifest = read_manifest(env_bundle)
    assert manifest["kind"] == "env"
    assert manifest["env"]["kind"] == "venv"
    assert "pyvenv.cfg" not in {m["rel"] for m in manifest["members"]}


def test_staged_binaries_are_relocated(staged, venv):
    n0 = staged.n0
    original = venv.base_python.resolve()
    _rpath, old = runpaths(original)
    staged_python = (n0 / "bin" / "python").resolve()
    _rpath, new = runpaths(staged_python)
    assert not [e for e in new if under(e, venv.base) or under(e, venv.prefix)], new
    if any(e.startswith("/") for e in old):
        assert new and new[0].startswith("$ORIGIN"), new
        lib = os.path.normpath(new[0].replace("$ORIGIN", str(staged_python.parent)))
        assert lib == str(n0 / "base" / "lib")
        # Relocated in the bundle only: the base interpreter is unchanged.
        assert runpaths(original)[1] == old

    # No staged ELF file looks in the original places, and every $ORIGIN
    # entry stays inside the staged tree.
    count = 0
    for path in elf_files(n0):
        count += 1
        rpath, runpath = runpaths(path)
        for entry in rpath + runpath:
            assert not under(entry, venv.base) and not under(entry, venv.prefix), (
                path,
                entry,
            )
            if entry.startswith("$ORIGIN"):
                target = os.path.normpath(entry.replace("$ORIGIN", str(path.parent)))
                assert under(target, n0), (path, entry)
    assert count > 50  # the interpreter, libpython, extensions, libmpi...


def test_console_script_runs_from_the_staged_dir(staged, venv, tmp_path):
    n0 = staged.n0
    script = n0 / "bin" / "hello"
    assert script.read_text().startswith("#!/bin/sh\n")
    assert str(venv.prefix) not in script.read_text()
    # The original keeps its shebang: relocation happens in the bundle.
    original = (venv.prefix / "bin" / "hello").read_text()
    assert original.startswith(f"#!{venv.python}\n")
    env = {
        "PATH": f"{n0}/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONNOUSERSITE": "1",
    }
    elsewhere = tmp_path / "hi"
    elsewhere.symlink_to(script)
    for command in (["hello"], [script], [elsewhere]):
        result = run(command, env=env, cwd=tmp_path, timeout=30)
        assert result.returncode == 0, result
        assert result.stdout == f"hi {n0}\n", result


# -- refusals -----------------------------------------------------------------


@pytest.mark.parametrize("what", ["stray file", "stage of another bundle"])
def test_refuses_a_dir_that_is_not_empty(env_bundle, tmp_path, what, discard):
    discard(tmp_path / "envs")
    n0 = tmp_path / "envs" / "n0"
    n0.mkdir(parents=True, mode=0o700)
    if what == "stray file":
        stray, why = n0 / "notes.txt", "is not empty"
        stray.write_text("mine\n")
    else:  # a complete stage of another bundle, its marker as the stager writes it
        stray, why = n0 / ".mpistage-stage", "holds an interrupted or different stage"
        stray.write_text(f"sha256={'0' * 64}\nstate=complete\n")
    before = stray.read_text()
    # Node 1's dir is fine; node 0's is not.
    outcome = stage(2, env_bundle, tmp_path / "envs" / "n{node}", nodes=2)
    assert_refused(outcome, 2, why, str(n0), "mpistage clean")
    assert [p.name for p in n0.iterdir()] == [stray.name]
    assert stray.read_text() == before
    # Node 1 ends without a half-written tree: nothing, or a whole stage.
    n1 = tmp_path / "envs" / "n1"
    assert empty_or_absent(n1) or (n1 / ".mpistage-stage").is_file()


@pytest.fixture
def full_fs(tmp_path):
    """A 1 MiB tmpfs mounted below *tmp_path*, unmounted afterwards."""
    mount = shutil.which("mount")
    point = tmp_path / "full"
    point.mkdir()
    if mount is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield point
    umount = subprocess.run(
        ["umount", str(point)], capture_output=True, text=True, timeout=30
    )
    if umount.returncode != 0:
        subprocess.run(["umount", "-l", str(point)], timeout=30, check=False)


def test_refuses_a_dir_without_room(env_bundle, full_fs):
    target = full_fs / "env"
    error = assert_refused(stage(2, env_bundle, target), 2, "bytes free", "needed")
    need = int(error.rsplit(", ", 1)[1].split()[0])  # whole blocks of every file
    data = sum(m["size"] for m in read_manifest(env_bundle)["members"])
    assert data <= need <= env_bundle.stat().st_size * 2, error
    assert empty_or_absent(target)
    assert [p.name for p in full_fs.iterdir()] in ([], ["env"])


def test_run_without_room_says_so_in_one_line(env_bundle, full_fs, tmp_path):
    """``mpistage run --env`` whose nodes have no room: the stage step's reason,
    said once, and no line of its own about the failed step beside it."""
    command = [MPIEXEC, "-n", "2", PYTHON, "-c", "print('ran')"]
    args = ["run", "--env", env_bundle, "--to", full_fs / "env" / "n{node}"]
    env = dict(clean_environ(), MPISTAGE_EMULATE_NODES="2")
    result = mpistage([*args, "--", *command], env, cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result
    assert "ran" not in result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no space left for the bundle" in lines[0], lines


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_stage_ended_before_its_marker_leaves_no_directory(
    env_bundle, tmp_path, monkeypatch, stop
):
    """SIGINT between making DIR and marking it: no clean step could remove it."""
    from mpistage.runtime import stager
    from mpistage.runtime.extract import Footprint

    def interrupted(root):
        raise stop("ended here")

    monkeypatch.setattr(stager, "reap_beside", interrupted)
    buf = env_bundle.read_bytes()
    place = stager.TargetPlace(str(tmp_path / "stage"), "token")
    with pytest.raises(stop):
        place.make(buf, Footprint(read_manifest(env_bundle)))
    assert not (tmp_path / "stage").exists()
    (tmp_path / "kept").mkdir(mode=0o700)  # a DIR the user made stays
    with pytest.raises(stop):
        stager.TargetPlace(str(tmp_path / "kept")).make(buf, None)
    assert (tmp_path / "kept").is_dir()


def test_corrupt_bundle_leaves_no_partial_tree(env_bundle, tmp_path, discard):
    manifest = read_manifest(env_bundle)
    # The last file in the data: everything before it is written first.
    files = [m for m in manifest["members"] if m["type"] == "file" and m["size"]]
    member = max(files, key=lambda m: m["offset"])
    discard(tmp_path / "bad.mpistage")
    discard(tmp_path / "envs")
    corrupt = flip_byte(
        env_bundle, tmp_path / "bad.mpistage", member["offset"] + member["size"] // 2
    )
    (tmp_path / "envs").mkdir()
    outcome = stage(2, corrupt, tmp_path / "envs" / "n{node}", nodes=2)
    error = assert_refused(outcome, 2, "checksum mismatch")
    assert repr(member["rel"]) in error
    for node in ("n0", "n1"):
        assert empty_or_absent(tmp_path / "envs" / node), listing(tmp_path / "envs")


def test_runner_bundle_is_not_an_environment_bundle(numpy_bundle, tmp_path):
    target = tmp_path / "env"
    outcome = stage(2, numpy_bundle, target)
    assert_refused(outcome, 2, "not an environment bundle", "pack --env")
    assert not target.exists()


def test_runner_refuses_an_environment_bundle(
    env_bundle, stage_env, stage_dir, tmp_path
):
    args = ["-m", "mpistage", "--bundle", env_bundle, "-c", "pass"]
    outcome = mpirun_status(2, args, stage_env, cwd=tmp_path)
    assert_refused(outcome, 2, "environment bundle", "`mpistage stage`")
    assert job_dirs(stage_dir) == []


def test_refuses_a_symlink(env_bundle, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert_refused(stage(2, env_bundle, link), 2, "symlink")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert list(real.iterdir()) == []


def test_refuses_a_dir_others_can_write_to(env_bundle, tmp_path):
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o777)
    assert_refused(stage(2, env_bundle, target), 2, "writable by others")
    assert list(target.iterdir()) == []
    assert target.stat().st_mode & 0o777 == 0o777


# -- clean ---------------------------------------------------------------------


def test_clean_removes_a_staged_dir(env_bundle, tmp_path, discard):
    target = tmp_path / "env"
    discard(target)
    result, status = stage(1, env_bundle, target)
    assert result.returncode == 0 and status == {0: 0}, result
    assert (target / ".mpistage-stage").is_file()
    env = clean_environ()

    # A symlink to a stage is not a stage.
    link = tmp_path / "link"
    link.symlink_to(target)
    refused = mpistage(["clean", link], env)
    assert refused.returncode == 1, refused
    assert len(refused.errors()) == 1 and "not a directory" in refused.stderr
    assert target.is_dir()

    dry = mpistage(["clean", target, "--dry-run"], env)
    assert dry.returncode == 0, dry
    assert dry.stdout == f"would remove {target}\n"
    assert (target / "bin" / "python").exists()

    done = mpistage(["clean", target], env)
    assert done.returncode == 0, done
    assert done.stdout == f"removed {target}\n"
    assert not target.exists()


def test_clean_refuses_a_dir_without_the_marker(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "data.txt").write_text("keep me\n")
    result = mpistage(["clean", target], clean_environ())
    assert result.returncode == 1, result
    assert result.stderr.splitlines() == result.errors(), result
    assert len(result.errors()) == 1, result
    assert "not a stage made by `mpistage stage`" in result.errors()[0]
    assert (target / "data.txt").read_text() == "keep me\n"
    assert result.stdout == ""


RUN_CODE = (
    "import sys, numpy; from mpi4py import MPI; r = MPI.COMM_WORLD.rank; "
    "open(f'{sys.argv[2]}/rank{r}', 'w').write(f'{sys.executable} {numpy.__file__}'); "
    "MPI.COMM_WORLD.Barrier(); sys.exit(int(sys.argv[1]) if r == 1 else 0)"
)


@pytest.mark.parametrize("status", [0, 5])
def test_run_stages_runs_and_cleans(env_bundle, tmp_path, status):
    folder = tmp_path / "run" / "n{node}"
    env = dict(clean_environ(), MPISTAGE_EMULATE_NODES="2")
    command = [MPIEXEC, "-n", "4", PYTHON, "-c", RUN_CODE, str(status), tmp_path]
    args = ["run", "--env", env_bundle, "--to", folder, "--", *command]
    result = mpistage(args, env, cwd=tmp_path, timeout=120)
    assert result.returncode == status, result
    for rank in range(4):
        executable, numpy_file = (tmp_path / f"rank{rank}").read_text().split()
        node = tmp_path / "run" / f"n{rank * 2 // 4}"
        assert Path(executable).is_relative_to(node), (rank, executable)
        assert Path(numpy_file).is_relative_to(node), (rank, numpy_file)
    assert not (tmp_path / "run").exists()  # cleaned on every node


# `rm` killed halfway through, with the shell that ran it (the job's end):
# in a directory it removes the stage marker first, as an unordered walk may.
CUT_RM = """#!/bin/sh
for last; do :; done
if [ -d "$last" ]; then
  /bin/rm -f -- "$last/.mpistage-stage"
  for entry in "$last"/*; do /bin/rm -rf -- "$entry"; break; done
else
  /bin/rm -f -- "$last"
fi
kill -9 $PPID $$
"""

# Run by every rank: whether the environment it runs in has each NAME.
WHOLE_CODE = (
    "import os, sys; "
    "sys.exit(not all(os.path.lexists(os.path.join(sys.prefix, n)) "
    "for n in sys.argv[1:]))"
)


def test_a_clean_step_cut_short_is_finished_by_the_next_run(env_bundle, tmp_path):
    """The clean step killed halfway leaves what the next run can judge and remove.

    The stage marker, the owner record, goes last: the next ``mpistage run``
    into the same ``DIR`` finds a dead run's stage there, stages it again
    (never runs on the half-removed one), and removes it.
    """
    folder = tmp_path / "run" / "n{node}"
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "rm").write_text(CUT_RM)
    (stub / "rm").chmod(0o755)
    env = dict(clean_environ(), MPISTAGE_EMULATE_NODES="2")
    command = [MPIEXEC, "-n", "2", PYTHON, "-c", "pass"]
    args = ["run", "--env", env_bundle, "--to", folder, "--", *command]
    cut = dict(env, PATH=f"{stub}:{env['PATH']}")
    mpistage(args, cut, cwd=tmp_path, timeout=120)
    n0, n1 = tmp_path / "run" / "n0", tmp_path / "run" / "n1"
    assert (n0 / ".mpistage-stage").is_file()  # its removal cut short
    gone = sorted(set(listing(n1)) - set(listing(n0)))[:3]
    assert gone, "the cut-short clean step removed nothing"
    command = [MPIEXEC, "-n", "2", PYTHON, "-c", WHOLE_CODE, *gone]
    args = ["run", "--env", env_bundle, "--to", folder, "--", *command]
    result = mpistage(args, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    assert not (tmp_path / "run").exists()


def test_an_environment_changed_since_pack_is_refused(env_bundle, venv, tmp_path):
    """An install after ``pack --env``: run and stage refuse in one line, --trust not.

    The environment gets a new distribution, then loses it again: the
    bundle is stale in between and fresh afterwards.
    """
    added = venv.site / "newpkg-1.0.dist-info"
    env = dict(clean_environ(), MPISTAGE_EMULATE_NODES="2")
    command = [MPIEXEC, "-n", "2", PYTHON, "-c", "pass"]
    run_args = ["run", "--env", env_bundle, "--to", tmp_path / "r" / "n{node}"]
    added.mkdir()
    try:
        refused = mpistage([*run_args, "--", *command], env, timeout=60)
        assert refused.returncode == 1, refused
        (line,) = refused.stderr.splitlines()
        assert line.startswith("mpistage: error: environment bundle "), line
        assert f"{str(venv.site)!r} changed since `pack --env`" in line, line
        assert "--trust" in line, line
        outcome = stage(2, env_bundle, tmp_path / "s" / "n{node}", nodes=2)
        assert "is stale" in assert_refused(outcome, 2, "changed since")
        assert not (tmp_path / "r").exists() and empty_or_absent(tmp_path / "s")
        trusted, _ = stage(2, env_bundle, tmp_path / "t" / "n{node}", 2, ["--trust"])
        assert trusted.returncode == 0, trusted
        shutil.rmtree(tmp_path / "t")
    finally:
        added.rmdir()
    assert mpistage([*run_args, "--", *command], env, timeout=60).returncode == 0


def test_run_refuses_a_command_without_python(env_bundle, tmp_path):
    command = [MPIEXEC, "-n", "2", "hostname"]
    result = mpistage(["run", "--env", env_bundle, "--", *command], clean_environ())
    assert result.returncode == 1, result
    assert result.stderr.startswith("mpistage: error: no python in the command")


def test_pack_env_of_a_venv_of_another_python(tmp_path):
    venv = tmp_path / "old-venv"
    (venv / "lib" / "python3.9" / "site-packages").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {tmp_path}/gone/bin\nversion = 3.9.7\n")
    out = tmp_path / "old.mpistage"
    result = mpistage(["pack", "--env", venv, "-o", out], clean_environ())
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1 and "Python 3.9" in result.stderr, result
    assert "Traceback" not in result.stderr
