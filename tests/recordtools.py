"""Helpers of the tests of ``mpistage record``, ``--auto`` and staleness.

Built on :mod:`stagetools`: every subprocess has a timeout and is killed
with its whole process group.
"""

import json
import shutil
from pathlib import Path

import pytest

from mpistage.bench.generate import GenerateError, find_compiler, generate
from stagetools import MPIEXEC, PYTHON, mpistage, run

WORKLOAD = "pynamic_ws"


def make_workload(site):
    """Generate a small Pynamic-like workload into *site* (C parts if we can)."""
    try:
        find_compiler()
        native = {"extensions": 2, "libraries": 1}
    except GenerateError:
        native = {"extensions": 0, "libraries": 0}
    generate(site, modules=20, data_files=2, name=WORKLOAD, **native)
    return Path(site)


def record(output, command, env, cwd=None, granularity=None, timeout=None):
    """Run ``mpistage record -o OUTPUT [--granularity G] -- COMMAND``."""
    args = ["record", "-o", output]
    if granularity:
        args += ["--granularity", granularity]
    kwargs = {"timeout": timeout} if timeout else {}
    return mpistage([*args, "--", *command], env=env, cwd=cwd, **kwargs)


def recorded(output, script, env, cwd=None, granularity=None):
    """Record ``python SCRIPT`` (one process) into *output*, asserting success."""
    result = record(output, [PYTHON, script], env, cwd=cwd, granularity=granularity)
    assert result.returncode == 0, result
    assert Path(output).is_file(), result
    return result


# Wraps each rank so that its stdout goes to a file of its own: the output
# that mpiexec forwards from several ranks may interleave within a line.
RANK_STDOUT = 'exec "$0" "$@" >"$MPISTAGE_TEST_STDOUT/$PMI_RANK.txt"'


def replay(ranks, options, target, env, report, nodes=2, cwd=None, args=()):
    """Run ``mpiexec -n RANKS python -m mpistage OPTIONS TARGET ARGS``.

    Emulates *nodes* nodes and writes the JSON report to *report*, which is
    removed first so that a job that wrote none is noticed. Each rank's
    stdout goes to ``<report>.stdout/RANK.txt``; ``result.stdout`` becomes
    the list of those texts, in rank order. Returns the result and the
    report (``None`` if there is none).
    """
    if MPIEXEC is None:
        pytest.skip("no mpiexec next to this Python nor on PATH")
    report = Path(report)
    report.unlink(missing_ok=True)
    outs = report.with_name(report.name + ".stdout")
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir()
    env = dict(
        env,
        MPISTAGE_EMULATE_NODES=str(nodes),
        MPISTAGE_REPORT=str(report),
        MPISTAGE_TEST_STDOUT=str(outs),
    )
    cmd = [MPIEXEC, "-n", ranks, "sh", "-c", RANK_STDOUT, PYTHON, "-m", "mpistage"]
    result = run([*cmd, *options, target, *args], env=env, cwd=cwd)
    texts = {p.stem: p.read_text() for p in outs.glob("*.txt")}
    result.stdout = [texts.get(str(r)) for r in range(ranks)]
    facts = json.loads(report.read_text()) if report.exists() else None
    return result, facts


def below(path, root):
    """Whether *path* lies below the directory *root*."""
    return str(path).startswith(str(root).rstrip("/") + "/")


def need_report(result, facts):
    """Assert the job succeeded and wrote its report; return the report."""
    assert result.returncode == 0, result
    assert facts is not None, result
    return facts
