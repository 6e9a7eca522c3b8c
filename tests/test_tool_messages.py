"""What a user sees of the tools: help, one-line errors, progress, the cache.

Each test runs the command as a user types it and reads what it printed.
"""

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from stagetools import PYTHON, clean_environ, mpistage, run

SCRIPT = str(Path(PYTHON).parent / "mpistage")


def on_terminal(args, env):
    """Run *args* with stderr on a 30x100 terminal; return (status, what it drew)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(
        [str(a) for a in args], env=env, stdout=subprocess.DEVNULL, stderr=follower
    )
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    return proc.wait(timeout=120), drawn.decode(errors="replace")


def test_pack_shows_progress_on_a_terminal_only(tiny, tmp_path):
    env = clean_environ()
    env["PYTHONPATH"] = str(tiny["site"])
    out = tmp_path / "t.mpistage"
    status, drawn = on_terminal([SCRIPT, "pack", "-o", out, "tinypkg"], env)
    assert status == 0 and "pack:" in drawn and "files" in drawn, drawn
    status, drawn = on_terminal([SCRIPT, "pack", "-q", "-o", out, "tinypkg"], env)
    assert status == 0 and "pack:" not in drawn, drawn
    result = mpistage(["pack", "-o", out, "tinypkg"], env=env)
    assert result.returncode == 0 and "pack:" not in result.stderr, result


def test_inspect_into_a_closed_pipe_ends_quietly(numpy_bundle):
    read, write = os.pipe()
    os.close(read)  # `| head` that has already left
    proc = subprocess.run(
        [SCRIPT, "inspect", "--json", numpy_bundle],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write)
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def interrupted_pack(folder):
    """Start ``mpistage pack``, Ctrl-C it once it writes; return (status, stderr).

    ``None`` for the status when the pack finished first: it wrote its bundle
    before the interrupt reached it (the test saw the temporary file late).
    The pack gets Ctrl-C as from a terminal, whatever this test inherited: a
    shell starts background jobs with SIGINT ignored, and Python then keeps
    it ignored.
    """
    out = folder / "big.mpistage"
    proc = subprocess.Popen(
        [SCRIPT, "pack", "-o", out, "numpy", "--stdlib"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_environ(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Interrupt it while it writes: once its temporary bundle is there.
    deadline = time.monotonic() + 60
    while not list(folder.glob(".mpistage-*.tmp")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0 and out.exists() and not err:
        return None, err
    return proc.returncode, err


def test_ctrl_c_during_pack_is_one_line_and_leaves_nothing(tmp_path):
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        status, err = interrupted_pack(folder)
        if status is not None:
            break
    assert status == 130, err
    assert err.strip() == "mpistage: error: pack interrupted", err
    assert list(folder.iterdir()) == []


def test_help_names_the_command_as_the_user_started_it():
    env = clean_environ()
    assert run([SCRIPT, "--help"], env).stdout.startswith("usage: mpistage [opt")
    result = run([PYTHON, "-m", "mpistage", "--help"], env)
    assert result.stdout.startswith("usage: python -m mpistage [options]")
    assert "MPISTAGE_BOOT_WAIT" in result.stdout


def test_record_usage_shows_its_real_switch():
    result = mpistage(["record", "--help"], env=clean_environ())
    assert "[--no-stdlib]" in result.stdout and "[--stdlib]" not in result.stdout


USAGE_ERRORS = [
    (["run", "--env"], "run: argument --env"),
    (["run", "--env", "e.mpistage"], "run: the following arguments are required"),
    (["pack"], "pack: the following arguments are required"),
    (["inspect"], "inspect: the following arguments are required"),
    (["record", "-o"], "record: argument -o"),
    (["clean", "--bogus"], "clean: unrecognized arguments: --bogus"),
    (["bench"], "bench: no verb"),
    (["bench", "run", "--bogus"], "bench run: unrecognized arguments"),
    (["stage", "e.mpistage"], "stage: give BUNDLE and --to DIR"),
    (["--bogus", "-c", "pass"], "unknown option '--bogus'"),
    (["nonsense"], "unknown command 'nonsense'"),
]


def test_usage_errors_follow_one_rule_in_every_command():
    """docs/api.md: one ``mpistage: error:`` line first, then usage; status 2."""
    env = clean_environ()
    for args, message in USAGE_ERRORS:
        result = run([SCRIPT, *args], env)
        first, *rest = result.stderr.splitlines()
        assert result.returncode == 2, result
        assert first.startswith("mpistage: error: " + message), (args, first)
        assert "Traceback" not in result.stderr, result
        assert args == ["nonsense"] or rest[0].startswith("usage: "), result


def test_bench_help_explains_every_verb():
    result = mpistage(["bench", "--help"], env=clean_environ())
    assert result.returncode == 0, result
    for verb in ("run", "data", "model", "generate", "simfs", "unmount", "stats"):
        assert f"\n  {verb} " in result.stdout, result.stdout


def test_a_library_in_the_bundle_is_not_called_missing(tmp_path):
    from mpistage.bundle.envpack import unbundled
    from mpistage.bundle.writer import Selection

    lib = tmp_path / "numpy.libs" / "libquadmath-96973f99.so.0.0.0"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF")
    selection = Selection()
    selection.add(str(tmp_path), str(lib))
    missing = ["libquadmath-96973f99.so.0.0.0", "libnowhere.so.1"]
    assert unbundled(selection, missing) == ["libnowhere.so.1"]


def test_stage_announces_lines_only_where_they_are_seen():
    from mpistage.runtime.stager import summary

    devnull, (read, write) = os.open(os.devnull, os.O_WRONLY), os.pipe()
    try:  # mpistage run sends the stage step's stdout to /dev/null
        apart = summary("e.mpistage", "/dev/shm/x", [0, 0], out=devnull, err=write)
        together = summary("e.mpistage", "/dev/shm/x", [0, 0], out=write, err=write)
    finally:
        for fd in (devnull, read, write):
            os.close(fd)
    assert apart == "staged e.mpistage into /dev/shm/x on 2 node(s) (0 already staged)"
    assert together == apart + "; to use it:"


def test_auto_cache_errors_name_the_option(tmp_path):
    import pytest

    from mpistage import StageError
    from mpistage.runtime.auto import ensure_writable

    (tmp_path / "file").write_text("")
    with pytest.raises(StageError, match="--cache-dir DIR"):
        ensure_writable(str(tmp_path / "file" / "cache" / "a.mpistage"), "no bundle")


def make_cache(folder, ages_days_sizes):
    folder.mkdir()
    now = time.time()
    for name, (age, size) in ages_days_sizes.items():
        path = folder / f"{name}-0123456789abcdef.mpistage"
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age * 86400, now - age * 86400))
    (folder / ".mpistage-abc.tmp").write_bytes(b"partial")


def test_clean_cache_lists_sizes_and_trims_by_age_then_size(tmp_path):
    cache = tmp_path / "cache"
    make_cache(cache, {"old": (40, 3000), "mid": (5, 2000), "new": (0, 1000)})
    env = clean_environ()
    env["MPISTAGE_CACHE_DIR"] = str(cache)
    listed = mpistage(["clean", "--cache", "--dry-run"], env=env)
    assert listed.returncode == 0, listed
    assert "would remove" in listed.stdout and "0.003 MB" not in listed.stdout
    assert len(list(cache.glob("*.mpistage"))) == 3
    aged = mpistage(["clean", "--cache", "--older-than", "30"], env=env)
    assert aged.returncode == 0, aged
    assert sorted(p.name[:3] for p in cache.glob("*.mpistage")) == ["mid", "new"]
    sized = mpistage(["clean", "--cache", "--max-size", "1500B"], env=env)
    assert sized.returncode == 0, sized
    assert [p.name[:3] for p in cache.glob("*.mpistage")] == ["new"]
    assert "holds 1 bundle(s)" in sized.stdout
    assert (cache / ".mpistage-abc.tmp").exists()  # a job may be writing it


def test_clean_cache_alone_removes_every_cached_bundle(tmp_path):
    cache = tmp_path / "cache"
    make_cache(cache, {"a": (1, 10), "b": (2, 10)})
    result = mpistage(["clean", "--cache", "--cache-dir", cache], env=clean_environ())
    assert result.returncode == 0, result
    assert list(cache.glob("*.mpistage")) == []
    assert sys.executable  # the tools need no MPI launch
