"""Live imports: no bundle, one reader, one copy per node, nothing collective.

Every launch runs at 1, 2 and 5 ranks on (at most) 2 emulated nodes, with a
timeout (``stagetools.run``): ranks that import different things, nothing,
or something that is not there, or that leave early, must not hang anyone.
At 5 ranks, node 0 holds ranks 0-2 and node 1 ranks 3-4; rank 3 leads node 1.
"""

import compileall
import json
import re
import shutil
from pathlib import Path

import pytest

from mpistage.runtime.read import read_manifest
from recordtools import need_report, replay
from stagetools import (
    MPIEXEC,
    PYTHON,
    install_record,
    job_dirs,
    mpirun,
    results,
    run,
    write_target,
)

pytestmark = pytest.mark.usefixtures("reap_mpich_shm")
RANKS = [1, 2, 5]
MARK = "/nonexistent-mpistage-live-mark"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A sys.path root: plain modules, a package with data and metadata."""
    site = tmp_path_factory.mktemp("live") / "site"
    pkg = site / "livepkg"
    (pkg / "data").mkdir(parents=True)
    (site / "common.py").write_text("COMMON = 'common'\n")
    (site / "only3.py").write_text("ONLY = 'three'\n")
    (site / "late.py").write_text("import json, email.message\nLATE = 'late'\n")
    for i in range(4):
        (site / f"threaded{i}.py").write_text(
            f"import time\ntime.sleep(0.05)\nT = {i}\n"
        )
    (pkg / "__init__.py").write_text("VALUE = 7\n")
    (pkg / "sub.py").write_text("from livepkg import VALUE\nTWICE = 2 * VALUE\n")
    (pkg / "boom.py").write_text("def boom():\n    raise ValueError('boom')\n")
    (pkg / "data" / "table.txt").write_text("1 2 3\n")
    install_record(site, "livepkg", "1.2")
    info = site / "livepkg-1.2.dist-info"
    (info / "entry_points.txt").write_text("[live.plugins]\nsub = livepkg.sub:TWICE\n")
    return site


@pytest.fixture
def env(stage_env, site):
    return dict(stage_env, PYTHONPATH=str(site))


def launch(ranks, target, env, cwd=None, options=(), timeout=90):
    """``mpiexec -n RANKS python -m mpistage OPTIONS TARGET`` on up to 2 nodes."""
    env = dict(env, MPISTAGE_EMULATE_NODES=str(min(2, ranks)))
    args = ["-m", "mpistage", *options, target]
    return mpirun(ranks, args, env, cwd=cwd, timeout=timeout), env


def below(path, root):
    return str(path).startswith(str(root).rstrip("/") + "/")


ONLY_ONE = """
import sys
from mpi4py import MPI
world = MPI.COMM_WORLD
chosen = min(3, world.size - 1)
if world.rank == chosen:
    import only3
    emit([where(only3), only3.__file__, only3.ONLY])
else:
    emit(["only3" in sys.modules])
"""


@pytest.mark.parametrize("ranks", RANKS)
def test_a_module_only_one_rank_imports(tmp_path, env, stage_dir, site, ranks):
    target = write_target(tmp_path / "one.py", ONLY_ONE)
    result, env = launch(ranks, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    emitted = results(env, ranks)
    chosen = min(3, ranks - 1)
    read, file, value = emitted[chosen]
    assert below(read, stage_dir) and read.endswith(str(site / "only3.py")), read
    assert file == str(site / "only3.py") and value == "three"
    assert [e for i, e in enumerate(emitted) if i != chosen] == [[False]] * (ranks - 1)
    assert job_dirs(stage_dir) == []


EARLY = """
import os, sys, time
from mpi4py import MPI
world = MPI.COMM_WORLD
early = int(os.environ["EARLY"])
if world.rank == early:
    emit("left")
    sys.exit(0)
time.sleep(0.5)  # the early rank is gone from the program by now
import late, livepkg.sub
emit([late.LATE, livepkg.sub.TWICE, where(late)])
"""


@pytest.mark.parametrize("who", ["reader", "leader"])
@pytest.mark.parametrize("ranks", [2, 5])
def test_a_rank_that_leaves_early_blocks_nobody(tmp_path, env, stage_dir, ranks, who):
    """Rank 0 (the reader) or node 1's leader leaves; their relays serve on."""
    early = 0 if who == "reader" else (ranks + 1) // 2
    target = write_target(tmp_path / "early.py", EARLY)
    result, env = launch(ranks, target, dict(env, EARLY=str(early)), cwd=tmp_path)
    assert result.returncode == 0, result
    for rank, got in enumerate(results(env, ranks)):
        if rank == early:
            assert got == "left"
        else:
            assert got[:2] == ["late", 14] and below(got[2], stage_dir), got
    assert job_dirs(stage_dir) == []


IMPORT_ERROR = """
from mpi4py import MPI
world = MPI.COMM_WORLD
if world.rank == world.size - 1:
    try:
        import no_such_module_anywhere
    except ImportError as exc:
        emit(["error", str(exc), exc.name])
else:
    import common
    emit(["ok", common.COMMON])
"""


@pytest.mark.parametrize("ranks", RANKS)
def test_an_import_error_is_on_its_rank_only(tmp_path, env, stage_dir, ranks):
    target = write_target(tmp_path / "err.py", IMPORT_ERROR)
    result, env = launch(ranks, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    emitted = results(env, ranks)
    message = "No module named 'no_such_module_anywhere'"
    assert emitted[-1] == ["error", message, "no_such_module_anywhere"]
    assert emitted[:-1] == [["ok", "common"]] * (ranks - 1)


CREATED = """
import importlib, os, sys
from mpi4py import MPI
import common  # the script's directory is listed by now
rank = MPI.COMM_WORLD.rank
with open(os.path.join(os.path.dirname(__file__), f"made{rank}.py"), "w") as f:
    f.write(f"MADE = {rank}")
importlib.invalidate_caches()
module = importlib.import_module(f"made{rank}")
emit([module.MADE, where(module)])
"""


@pytest.mark.parametrize("ranks", RANKS)
def test_a_module_created_while_running(tmp_path, env, stage_dir, ranks):
    """After ``importlib.invalidate_caches()``, a new module is found, as plain."""
    app = tmp_path / "app"
    app.mkdir()
    target = write_target(app / "made.py", CREATED)
    result, env = launch(ranks, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    for rank, (made, read) in enumerate(results(env, ranks)):
        assert made == rank and below(read, stage_dir), read


UNCAUGHT = """
import time
from mpi4py import MPI
if MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1:
    import no_such_module_anywhere
import common
time.sleep(60)
"""


def test_an_uncaught_import_error_ends_the_job(tmp_path, env, stage_dir):
    target = write_target(tmp_path / "uncaught.py", UNCAUGHT)
    result, _ = launch(5, target, env, cwd=tmp_path, timeout=50)
    assert result.elapsed < 30, result
    assert result.returncode != 0, result
    assert "ModuleNotFoundError: No module named 'no_such_module_anywhere'" in (
        result.stderr
    )
    assert job_dirs(stage_dir) == [] or not wait_removed(stage_dir), result


def wait_removed(stage_dir, seconds=5):
    """Wait for the watchdogs; return the roots still there."""
    import time

    deadline = time.monotonic() + seconds
    while job_dirs(stage_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return job_dirs(stage_dir)


THREADS = """
import threading
from mpi4py import MPI
got = {}
def work(i):
    module = __import__(f"threaded{i}")
    got[i] = (module.T, where(module))
threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
import livepkg.sub  # the main thread imports meanwhile
for t in threads:
    t.join()
emit([got[i] for i in range(4)] + [livepkg.sub.TWICE])
"""


@pytest.mark.parametrize("ranks", RANKS)
def test_ranks_import_inside_threads(tmp_path, env, stage_dir, ranks):
    target = write_target(tmp_path / "threads.py", THREADS)
    result, env = launch(ranks, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    for got in results(env, ranks):
        assert [t[0] for t in got[:4]] == [0, 1, 2, 3] and got[4] == 14, got
        assert all(below(t[1], stage_dir) for t in got[:4]), got


NUMPY = """
import numpy, numpy.linalg
from numpy._core import _multiarray_umath as core
maps = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if "openblas" in line or "_multiarray_umath" in line})
emit([where(core), maps, float(numpy.linalg.inv(2 * numpy.eye(3))[0, 0]),
      [numpy.__file__, core.__file__]])
"""


@pytest.mark.parametrize("ranks", RANKS)
def test_numpy_extensions_load_from_the_copy(tmp_path, stage_env, stage_dir, ranks):
    pytest.importorskip("numpy")
    import numpy

    target = write_target(tmp_path / "np.py", NUMPY)
    result, env = launch(ranks, target, stage_env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    roots = set()
    umath = numpy._core._multiarray_umath.__file__
    for core, maps, value, files in results(env, ranks):
        # shown at the original, as with plain python; mapped from the copy
        assert value == 0.5 and files == [numpy.__file__, umath]
        assert below(core, stage_dir) and core.endswith("_multiarray_umath" + suffix())
        assert core in maps and len(maps) > 1, maps
        assert all(below(m, stage_dir) for m in maps), maps  # $ORIGIN
        roots.add(Path(core).relative_to(stage_dir).parts[1])
    assert len(roots) == min(2, ranks)  # one copy per node
    assert job_dirs(stage_dir) == []


def suffix():
    import sysconfig

    return sysconfig.get_config_var("EXT_SUFFIX")


ECOSYSTEM = """
import importlib.metadata as md, importlib.resources as res, os, pkgutil, sys
import inspect, traceback
import livepkg, livepkg.boom, livepkg.sub
try:
    livepkg.boom.boom()
except ValueError:
    trace = traceback.format_exc().splitlines()[-3:]
plugins = sorted(e.value for e in md.entry_points(group="live.plugins"))
dist = md.distribution("livepkg")
folder = res.files("livepkg")
emit({
    "version": md.version("livepkg"),
    "plugins": plugins,
    "files": sorted(str(f) for f in dist.files or []),
    "located": str(dist.locate_file("livepkg/__init__.py")),
    "table": folder.joinpath("data", "table.txt").read_text(),
    "listing": sorted(p.name for p in folder.iterdir()),
    "is_dir": folder.joinpath("data").is_dir(),
    "missing": folder.joinpath("nothing.txt").exists(),
    "legacy": res.read_text("livepkg", "sub.py")[:20],
    "absent": [n for n in ("no-such-dist",) if not list(md.distributions(name=n))],
    "modules": sorted(m.name for m in pkgutil.iter_modules()),
    "inside": sorted(m.name for m in pkgutil.iter_modules(livepkg.__path__)),
    "traceback": trace,
    "source": inspect.getsource(livepkg.sub),
    "pid": os.getpid(),
})
"""


@pytest.mark.parametrize("ranks", RANKS)
def test_metadata_and_resources_as_plain_python(tmp_path, env, ranks):
    target = write_target(tmp_path / "eco.py", ECOSYSTEM)
    plain = run([PYTHON, target], env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain
    expected = plain_result(env)
    result, env = launch(ranks, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert expected["version"] == "1.2" and expected["plugins"] == ["livepkg.sub:TWICE"]
    for got in results(env, ranks):
        assert {**got, "pid": 0} == {**expected, "pid": 0}


def plain_result(env):
    path = Path(env["MPISTAGE_TEST_OUT"]) / "plain.json"
    data = json.loads(path.read_text())
    path.unlink()
    return data


CHILDREN = """
import multiprocessing as mp, os, subprocess, sys

def in_child(_):
    import livepkg.sub
    return livepkg.sub.TWICE, livepkg.sub.__file__

if __name__ == "__main__":
    import livepkg
    out = subprocess.run(
        [sys.executable, "-c", "import livepkg.sub as s; print(s.TWICE, s.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    with mp.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(in_child, [0])[0]
    emit([out, list(spawned), os.environ.get("PYTHONPATH")])
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_child_processes_import_the_plain_way(tmp_path, env, site, ranks):
    target = write_target(tmp_path / "kids.py", CHILDREN)
    result, env = launch(ranks, target, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result
    file = str(site / "livepkg" / "sub.py")
    for out, spawned, pythonpath in results(env, ranks):
        assert out == ["14", file] and spawned == [14, file]
        assert pythonpath == str(site)


AUTO = ONLY_ONE + "import common, livepkg.sub\n"


@pytest.mark.parametrize("ranks", [2, 5])
def test_first_auto_run_saves_what_was_served(tmp_path, env, stage_dir, ranks):
    target = write_target(tmp_path / "auto.py", AUTO)
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    result, facts = replay(ranks, options, target, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"].startswith("recorded"), facts
    assert facts["live"]["mode"] == "live" and facts["live"]["read_files"] > 0, facts
    (saved,) = (tmp_path / "cache").glob("*.mpistage")
    rels = {m["rel"] for m in read_manifest(saved)["members"]}
    assert {"common.py", "only3.py", "livepkg/sub.py"} <= rels, rels
    assert job_dirs(stage_dir) == []

    shutil.rmtree(Path(env["MPISTAGE_TEST_OUT"]))
    Path(env["MPISTAGE_TEST_OUT"]).mkdir()
    result, facts = replay(ranks, options, target, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"] == "replayed" and facts["live"] is None, facts
    assert facts["modules"]["served"] > 0 and facts["modules"]["missed"] == 0, facts
    read = results(dict(env), ranks)[min(3, ranks - 1)][0]
    assert below(read, stage_dir), read


ADDED_LATER = """
import sys
sys.path.insert(0, {extra!r})
import laterpkg.mod
from mpi4py import MPI
emit(laterpkg.mod.__file__)
"""


def test_first_auto_run_saves_modules_from_a_directory_added_later(
    tmp_path, env, stage_dir
):
    # A directory the program puts on sys.path itself is not served live;
    # what was imported from it still goes into the bundle the run saves.
    extra = tmp_path / "later"
    (extra / "laterpkg").mkdir(parents=True)
    (extra / "laterpkg" / "__init__.py").write_text("")
    (extra / "laterpkg" / "mod.py").write_text("X = 1\n")
    compileall.compile_dir(extra, quiet=1)  # only the bytecode is read then
    (tmp_path / "job").mkdir()
    target = write_target(
        tmp_path / "job" / "app.py", ADDED_LATER.format(extra=str(extra))
    )
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    result, facts = replay(2, options, target, env, tmp_path / "r.json")
    assert need_report(result, facts)["auto"].startswith("recorded"), result
    (saved,) = (tmp_path / "cache").glob("*.mpistage")
    rels = {m["rel"] for m in read_manifest(saved)["members"]}
    assert {"laterpkg/__init__.py", "laterpkg/mod.py"} <= rels, rels

    shutil.rmtree(Path(env["MPISTAGE_TEST_OUT"]))
    Path(env["MPISTAGE_TEST_OUT"]).mkdir()
    result, facts = replay(2, options, target, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    assert facts["auto"] == "replayed", facts
    assert facts["modules"]["missed"] == 0, facts
    assert facts["modules"]["served"] >= 2, facts  # laterpkg and its mod


def test_first_auto_run_records_no_file_of_the_working_directory_it_never_read(
    tmp_path, env
):
    # The reader opens files relative to directory descriptors; a name such
    # as ``__init__.py`` is not a file of the working directory (a root, with
    # ``-c``), and the saved bundle must not take the one that is there.
    job = tmp_path / "job"
    job.mkdir()
    (job / "__init__.py").write_text("raise SystemExit('not this one')\n")
    (job / "sub.py").write_text("raise SystemExit('nor this one')\n")
    code = "import livepkg.sub"
    options = ["--auto", "--cache-dir", tmp_path / "cache"]
    result, facts = replay(2, options, "-c", env, tmp_path / "r.json", cwd=job,
                           args=[code])  # fmt: skip
    assert need_report(result, facts)["auto"].startswith("recorded"), result
    (saved,) = (tmp_path / "cache").glob("*.mpistage")
    manifest = read_manifest(saved)
    job_root = [i for i, r in enumerate(manifest["roots"]) if r["path"] == str(job)]
    taken = {m["rel"] for m in manifest["members"] if m["root"] in job_root}
    assert not taken & {"__init__.py", "sub.py"}, taken


def test_without_thread_multiple_the_job_runs_plain(tmp_path, env, site):
    env = dict(env, MPI4PY_RC_THREAD_LEVEL="serialized")
    target = write_target(tmp_path / "one.py", ONLY_ONE)
    options = ["--report"]
    result, facts = replay(2, options, target, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    notes = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("mpistage:") and "MPI_THREAD_MULTIPLE" in line
    ]
    assert len(notes) == 1 and notes[0].startswith("mpistage: no live imports"), result
    assert facts["live"]["mode"] == "plain: no MPI_THREAD_MULTIPLE", facts
    assert "live imports: none (plain: no MPI_THREAD_MULTIPLE)" in result.stderr
    assert results(env, 2)[1][0] == str(site / "only3.py")  # read from the original


FINALIZER = """
from mpi4py import MPI
import livepkg.sub
world = MPI.COMM_WORLD
if world.rank == world.size - 1:
    import only3
emit(livepkg.sub.TWICE)
MPI.Finalize()
print("after finalize", flush=True)
"""


@pytest.mark.parametrize("ranks", [2, 5])
def test_program_that_finalizes_mpi_itself(tmp_path, env, stage_dir, ranks):
    target = write_target(tmp_path / "fin.py", FINALIZER)
    result, env = launch(ranks, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.count("after finalize") == ranks
    assert results(env, ranks) == [14] * ranks
    assert job_dirs(stage_dir) == []


# MPI.Finalize as the program finds it under mpistage's: each rank says how
# many threads besides its main one still ran when it was called (waiting up
# to 2 s for them to end).
THREADS_AT_FINALIZE = """
import _thread, os, sys, time
import mpistage.node.cleanup as cleanup
real_at_finalize = cleanup.at_finalize
def at_finalize(func, comm):
    from mpi4py import MPI
    real = MPI.Finalize
    def finalize():
        deadline = time.monotonic() + 2
        while _thread._count() and time.monotonic() < deadline:
            time.sleep(0.01)
        out = os.path.join(os.environ["MPISTAGE_TEST_OUT"], os.environ["PMI_RANK"])
        with open(out + ".threads", "a") as f:
            f.write(str(_thread._count()))
        real()
    MPI.Finalize = finalize
    return real_at_finalize(func, comm)
cleanup.at_finalize = at_finalize
from mpistage.__main__ import main
main(sys.argv[1:])
"""


def test_no_thread_of_ours_is_in_mpi_when_the_program_finalizes_it(
    tmp_path, env, stage_dir
):
    """The standard lets ``MPI_Finalize`` begin only once every other thread
    has completed its MPI calls, and MPICH stops locking before it runs the
    callbacks that end the job: a relay thread still polling there made one
    run in fifty crash, hang or leave a mutex locked."""
    target = write_target(tmp_path / "fin.py", FINALIZER)
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(5, ["-c", THREADS_AT_FINALIZE, target], env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.count("after finalize") == 5
    out = Path(env["MPISTAGE_TEST_OUT"])
    threads = {p.stem: p.read_text() for p in out.glob("*.threads")}
    assert threads == dict.fromkeys(map(str, range(5)), "0"), threads
    assert job_dirs(stage_dir) == []


# A program whose C code finalizes MPI: mpistage's end runs inside it.
C_FINALIZER = FINALIZER.replace(
    "MPI.Finalize()\n",
    """import ctypes
libmpi = [line.split()[-1] for line in open("/proc/self/maps") if "/libmpi.so" in line]
ctypes.CDLL(libmpi[0]).MPI_Finalize()
assert MPI.Is_finalized()
""",
)


def test_program_whose_c_code_finalizes_mpi(tmp_path, env, stage_dir):
    target = write_target(tmp_path / "fin.py", C_FINALIZER)
    result, env = launch(5, target, env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert result.stdout.count("after finalize") == 5
    assert results(env, 5) == [14] * 5
    assert job_dirs(stage_dir) == []


# The leader's reply to a rank comes 50 ms after its node's log has the
# answer; each rank says how many replies it had not taken when it closed.
LATE_REPLIES = """
import os, sys, time
import mpistage.runtime.live.relay as relay
import mpistage.runtime.live.request as request
real_answer, real_close = relay.Relay.answer, request.RankClient.close
def answer(self, waiter, result=None):
    if not isinstance(waiter, relay.Waiter):
        time.sleep(0.05)
    return real_answer(self, waiter, result)
def close(self):
    real_close(self)
    rank = os.environ["PMI_RANK"]
    with open(os.path.join(os.environ["MPISTAGE_TEST_OUT"], rank + ".left"), "w") as f:
        f.write(str(len(self.stray) + len(self.overdue)))
relay.Relay.answer, request.RankClient.close = answer, close
from mpistage.__main__ import main
main(sys.argv[1:])
"""


def test_every_reply_is_taken_before_mpi_finalizes(tmp_path, env, stage_dir):
    """A rank that read its answer in the node's log takes the leader's
    reply too before MPI finalizes: an MPI may say so of a message never
    received (UCX: "unexpected tag-receive descriptor ... was not matched")."""
    target = write_target(tmp_path / "late.py", "import livepkg.sub\nemit(1)\n")
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(4, ["-c", LATE_REPLIES, target], env, cwd=tmp_path)
    assert result.returncode == 0, result
    assert results(env, 4) == [1] * 4
    out = Path(env["MPISTAGE_TEST_OUT"])
    left = {p.stem: p.read_text() for p in out.glob("*.left")}
    assert left == {"1": "0", "3": "0"}, left  # the ranks that are not leaders
    assert job_dirs(stage_dir) == []


MARKED = f"import os as _o\n_o.path.exists({MARK!r})\n"
TRACED = (
    MARKED
    + """
import os, numpy, numpy.linalg, livepkg.sub, importlib.metadata as md, pkgutil
import importlib.resources as res
names = [m.name for m in pkgutil.iter_modules()]
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 3:
    import only3
md.version("livepkg")
res.files("livepkg").joinpath("data", "table.txt").read_text()
emit(os.getpid())
"""
)


def test_only_the_reader_touches_the_originals(tmp_path, env, site):
    """strace: after the target starts, no rank but 0 opens or stats an original."""
    numpy = pytest.importorskip("numpy")
    if shutil.which("strace") is None:
        pytest.skip("no strace")
    target = write_target(tmp_path / "traced.py", TRACED)
    env = dict(env, MPISTAGE_EMULATE_NODES="2")
    prefix = tmp_path / "trace"
    trace = ["strace", "-f", "-ff", "-e", "trace=%file,clone,clone3", "-o", prefix]
    command = [*trace, MPIEXEC, "-n", 5, PYTHON, "-m", "mpistage", target]
    result = run(command, env=env, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result
    pids = results(env, 5)
    # a path strace shows starts after a quote; the copies hold originals inside
    originals = [f'"{site}/', f'"{Path(numpy.__file__).parent}/']
    rank0 = threads_of(prefix, pids[0])
    touched = {}
    for path in tmp_path.glob("trace.*"):
        tid = int(path.suffix[1:])
        if tid in rank0:
            continue
        lines = path.read_text(errors="replace").splitlines()
        marks = [i for i, line in enumerate(lines) if MARK in line]
        after = lines[marks[0] :] if marks else lines  # threads: all of it
        hits = [line for line in after if any(p in line for p in originals)]
        if hits:
            touched[tid] = hits[:3]
    assert touched == {}, touched
    reader = "".join(
        (prefix.parent / f"trace.{t}").read_text(errors="replace") for t in rank0
    )
    assert "only3.py" in reader  # rank 0 read what only rank 3 imported


def threads_of(prefix, pid):
    """Return the thread ids of process *pid* (its clone calls in the trace)."""
    found, todo = {pid}, [pid]
    while todo:
        text = (prefix.parent / f"trace.{todo.pop()}").read_text(errors="replace")
        for line in text.splitlines():
            if "CLONE_THREAD" in line:
                match = re.search(r"= (\d+)$", line)
                if match and int(match.group(1)) not in found:
                    found.add(int(match.group(1)))
                    todo.append(int(match.group(1)))
    return found


def test_the_report_says_what_live_imports_did(tmp_path, env):
    target = write_target(tmp_path / "one.py", ONLY_ONE)
    result, facts = replay(5, ["--report"], target, env, tmp_path / "r.json")
    facts = need_report(result, facts)
    live = facts["live"]
    assert live["mode"] == "live", live
    assert live["read_files"] >= 1 and live["read_listings"] >= 1, live
    assert live["relay_forwarded"] >= 1, live  # rank 3 asked through its leader
    assert "live imports: rank 0 read" in result.stderr
