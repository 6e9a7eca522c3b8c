"""Last step: one summary of the job, on screen and as JSON.

Every rank keeps its own step timings and import counts; rank 0 gathers
them, takes the slowest rank for each step (the job waits for it), and
prints one screen (``--report``) or writes JSON (``MPISTAGE_REPORT=path``).
"""

import os as _os
import sys as _sys

STEPS = ("topology", "read", "validate", "broadcast", "stage", "activate", "run")


def local_facts(session, seconds):
    """Return this rank's timings and import counts."""
    from mpistage.runtime.activate import classify

    empty = {"served": [], "missed": [], "stdlib": []}
    activation = session.activation if session else None
    modules = classify(activation) if activation else empty
    root = session.staged.path if session and session.staged else None
    return {"seconds": seconds, "modules": modules, "stage_root": root}


def summarize(job, ranks):
    """Combine the per-rank dicts *ranks* into the job's report."""
    seconds = {s: max(r["seconds"].get(s, 0.0) for r in ranks) for s in STEPS}
    served = sorted({m for r in ranks for m in r["modules"]["served"]})
    missed = sorted({m for r in ranks for m in r["modules"]["missed"]})
    stdlib = sorted({m for r in ranks for m in r["modules"]["stdlib"]})
    return {
        "ranks": len(ranks),
        "nodes": job["nodes"],
        "bundle": job["bundle"],
        "bundle_bytes": job["bundle_bytes"],
        "auto": job["auto"],
        "stage_roots": sorted({r["stage_root"] for r in ranks if r["stage_root"]}),
        "seconds": {k: round(v, 6) for k, v in seconds.items()},
        "modules": {
            "served": len(served),
            "missed": len(missed),
            "stdlib": len(stdlib),
            "missed_names": missed,
        },
    }


def render(report):
    """Return the report as one screen of text."""
    mods, sec = report["modules"], report["seconds"]
    lines = [
        "mpistage report",
        f"  ranks {report['ranks']}, nodes {report['nodes']}",
        f"  bundle {report['bundle'] or '(none)'}, {report['bundle_bytes']} bytes"
        + (f", --auto: {report['auto']}" if report.get("auto") else ""),
        "  seconds (slowest rank): " + ", ".join(f"{s} {sec[s]:.3f}" for s in STEPS),
        f"  modules: {mods['served']} served from the staged copy, "
        f"{mods['missed']} missed, {mods['stdlib']} from the standard library",
    ]
    if mods["missed_names"]:
        names = mods["missed_names"]
        shown = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
        lines.append(f"  missed: {shown}")
        lines.append(
            "  hint: re-record with `mpistage record -o app.mpistage -- python "
            "app.py` (--granularity package, the default, takes whole packages), "
            "or add them: `mpistage pack ... NAME`"
        )
    return "\n".join(lines)


def emit(report, show):
    """Print the report if *show*; write JSON to ``MPISTAGE_REPORT`` if set."""
    if show:
        print(render(report), file=_sys.stderr, flush=True)
    path = _os.environ.get("MPISTAGE_REPORT")
    if path:
        try:
            write_json(path, report)
        except OSError as exc:
            from mpistage import StageError

            raise StageError(
                f"cannot write the report MPISTAGE_REPORT={path!r}: {exc.strerror}"
            ) from None


def write_json(path, data):
    """Write *data* as JSON to *path* atomically."""
    import json
    import tempfile

    folder = _os.path.dirname(_os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mpistage-report-")
    try:
        with _os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        _os.replace(tmp, path)
    except BaseException:
        _os.unlink(tmp)
        raise
