"""Last step: one summary of the job, on screen and as JSON.

Every rank keeps its own step timings and import counts; rank 0 gathers
them, takes the slowest rank for each step (the job waits for it), and
prints one screen (``--report``) or writes JSON (``MPISTAGE_REPORT=path``).

When a report is asked for, every rank also counts, after activation, each
access to the original of a bundled root (with live imports, of a directory
they serve): files opened for reading and directories listed, by kind
(modules, distribution metadata, other data, listings), through an audit
hook (:class:`Watch`), and names what was read beside the modules (the
files and listings most read), so that a user sees why a rank touched the
shared file system. ``stat`` calls are not audited by Python and are not
counted. And every
rank says which shared objects it mapped, from the node's copy or from the
originals (:mod:`~mpistage.runtime.libraries`): libraries are where a GPU
stack's bytes are.
"""

import os as _os
import sys as _sys

from mpistage.runtime import libraries as _libraries

STEPS = ("topology", "read", "validate", "broadcast", "stage", "activate", "run")


SHOWN = 20  # missed module names the screen report lists
KINDS = ("modules", "metadata", "data", "listings")
METADATA = (".dist-info", ".egg-info")  # a distribution's directory
BESIDE = ("data", "listings")  # what is read beside the modules, named
NAMED = 5  # paths of each kind the screen report names
KEPT = 50  # distinct paths of each kind a rank keeps for the report


class Watch:
    """Counts this rank's accesses to originals after activation; names some.

    The originals are those below *roots*: a bundle's roots, or with live
    imports the directories they serve; not the node's copy (*skip*), which
    may lie below one. Of the files read and directories listed beside the
    modules (:data:`BESIDE`), the first :data:`KEPT` distinct paths are kept
    with their counts.
    """

    def __init__(self, roots, skip=()):
        import sys

        self.prefixes = tuple(path.rstrip("/") + "/" for path in roots)
        self.skip = tuple(path.rstrip("/") + "/" for path in skip if path)
        self.counts = dict.fromkeys(KINDS, 0)
        self.paths = {kind: {} for kind in BESIDE}
        self.active = True
        sys.addaudithook(self.hook)

    def hook(self, event, args):
        """Audit hook: count opens for reading and listings below an original."""
        if not self.active:
            return
        kind, path = read_of(event, args)
        if kind not in ("open", "listing") or not path.startswith(self.prefixes):
            return
        if self.skip and path.startswith(self.skip):
            return
        kind = kind_of(kind, path)
        self.counts[kind] += 1
        named = self.paths.get(kind)
        if named is None or kind == "listings" and by_imports(_sys._getframe(1)):
            return  # the import system's own look for a module: no "beside"
        if path in named or len(named) < KEPT:
            named[path] = named.get(path, 0) + 1

    def stop(self):
        """Stop counting; return the counts, with the paths named."""
        self.active = False
        return dict(self.counts, beside=self.paths)


def by_imports(frame):
    """Whether the code that caused an audit event (*frame*) is the import system's."""
    return frame is not None and frame.f_code.co_filename.startswith("<frozen ")


def read_of(event, args):
    """Return (kind, path) of an audit event that reads a path, else (None, None).

    The kinds: ``open`` (a file opened for reading, whatever the mode's
    spelling: ``"r"``, or ``os.open`` flags without write access),
    ``listing`` (``os.listdir``, ``os.scandir``) and ``dlopen`` (a library
    ``ctypes`` loads by path). The one filter of the report and the recorder.
    """
    kind = READ_EVENTS.get(event)
    path = args[0] if kind and args else None
    if isinstance(path, bytes):
        path = _os.fsdecode(path)
    if not isinstance(path, str) or (kind == "dlopen" and _os.sep not in path):
        return None, None
    if kind == "open" and writes(args):
        return None, None
    return kind, path


READ_EVENTS = {
    "open": "open",
    "os.listdir": "listing",
    "os.scandir": "listing",
    "ctypes.dlopen": "dlopen",
}


def writes(args):
    """Whether an ``open`` audit event's (path, mode, flags) opens for writing."""
    _, mode, flags = args
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & (_os.O_WRONLY | _os.O_RDWR))


def kind_of(event, path):
    """Return the kind of an access: modules, metadata, data or listings."""
    from mpistage.runtime.roots import import_suffixes

    if path.endswith(METADATA) or ".dist-info/" in path or ".egg-info/" in path:
        return "metadata"
    if event != "open":
        return "listings"
    if path.endswith(import_suffixes() + (".pyc",)):
        return "modules"
    return "data"


def local_facts(session, seconds, watch=None, live=None):
    """Return this rank's timings, import counts, original accesses, libraries."""
    empty = {"served": [], "missed": [], "stdlib": []}
    activation = session.activation if session else None
    modules = classify(activation) if activation else empty
    root = session.staged.path if session and session.staged else None
    accesses = watch.stop() if watch else dict(dict.fromkeys(KINDS, 0), beside={})
    return {
        "seconds": seconds,
        "modules": modules,
        "stage_root": root,
        "accesses": accesses,
        "start": start_facts(),
        "libraries": _libraries.local(session, live),
    }


def start_facts():
    """Return how this rank imported mpi4py (the node boot), or None if it did not."""
    boot = _sys.modules.get("mpistage.node.boot")
    return boot.facts() if boot is not None else None


def summarize(job, ranks):
    """Combine the per-rank dicts *ranks* into the job's report."""
    seconds = {s: max(r["seconds"].get(s, 0.0) for r in ranks) for s in STEPS}
    served = sorted({m for r in ranks for m in r["modules"]["served"]})
    missed = sorted({m for r in ranks for m in r["modules"]["missed"]})
    stdlib = sorted({m for r in ranks for m in r["modules"]["stdlib"]})
    accesses = {k: sum(r["accesses"][k] for r in ranks) for k in KINDS}
    accesses["beside"] = beside([r["accesses"].get("beside") or {} for r in ranks])
    missing_ranks = [i for i, r in enumerate(ranks) if r["modules"]["missed"]]
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
            "missed_on_ranks": missing_ranks,
        },
        "original_accesses": accesses,
        "libraries": _libraries.summarize([r.get("libraries") for r in ranks]),
        "live": live_summary(job.get("live"), ranks),
        "start": starts([r.get("start") for r in ranks]),
    }


def beside(named):
    """Sum the paths each rank read beside the modules: ``{kind: [[path, n]]}``.

    Most read first (then by path), :data:`KEPT` of each kind at most.
    """
    found = {}
    for paths in named:
        for kind, counts in paths.items():
            total = found.setdefault(kind, {})
            for path, count in counts.items():
                total[path] = total.get(path, 0) + count
    return {kind: most_read(total) for kind, total in sorted(found.items()) if total}


def most_read(counts):
    """Return ``[[path, count]]`` of *counts*, most read first, :data:`KEPT` at most."""
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [[path, count] for path, count in ordered[:KEPT]]


def starts(facts):
    """Sum up how the ranks started: per rank, and the ranks of each way.

    ``first``: imported mpi4py from the originals, for its node;
    ``copy``: imported it from its node's copy; ``normal``: imported it
    as usual, for the reason given (``reasons``). ``None`` when no rank went
    through the node boot (the library API).
    """
    if not any(facts):
        return None
    found = {"first": [], "copy": [], "normal": [], "reasons": {}}
    for rank, fact in enumerate(facts):
        role = (fact or {}).get("role", "normal")
        found[role].append(rank)
        if role == "normal":
            reason = (fact or {}).get("reason") or "not through the node boot"
            found["reasons"].setdefault(reason, []).append(rank)
    found["ranks"] = facts
    return found


def live_summary(mode, ranks):
    """Sum the live-import figures of all ranks (``None`` without live imports)."""
    if mode is None:
        return None
    summary = {"mode": mode, "late_ranks": []}
    for rank, facts in enumerate(r.get("live") or {} for r in ranks):
        for key, value in facts.items():
            if key != "mode":
                summary[key] = summary.get(key, type(value)()) + value
        if facts.get("late"):
            summary["late_ranks"].append(rank)
    return summary


def render(report):
    """Return the report as one screen of text."""
    mods, sec = report["modules"], report["seconds"]
    lines = [
        "mpistage report",
        f"  ranks {report['ranks']}, nodes {report['nodes']}",
        f"  bundle {report['bundle'] or '(none)'}, {report['bundle_bytes']} bytes"
        + (f", --auto: {report['auto']}" if report.get("auto") else ""),
        "  seconds (slowest rank): " + ", ".join(f"{s} {sec[s]:.3f}" for s in STEPS),
        *start_lines(report.get("start")),
        f"  modules: {mods['served']} served from the staged copy, "
        f"{mods['missed']} missed, {mods['stdlib']} from the standard library",
    ]
    lines += _libraries.render(report.get("libraries"))
    live = report.get("live")
    if live:
        lines.append(live_line(live))
    lines += accesses_lines(report.get("original_accesses", {}))
    if mods["missed_names"]:
        names = mods["missed_names"]
        shown = ", ".join(names[:SHOWN]) + (" ..." if len(names) > SHOWN else "")
        lines.append(f"  missed: {shown}")
        lines.append(hint(mods.get("missed_on_ranks", [0]), report["ranks"]))
    return "\n".join(lines)


def accesses_lines(accesses):
    """Say how often the ranks read the originals, and what beside the modules."""
    if not any(accesses.get(k) for k in KINDS):
        return []
    counts = ", ".join(f"{accesses[k]} {k}" for k in KINDS if accesses.get(k))
    lines = [f"  originals read after activation, all ranks: {counts}"]
    named = accesses.get("beside") or {}
    for kind, verb in (("listings", "listed"), ("data", "read")):
        paths = named.get(kind) or []
        if paths:
            lines.append(f"  {verb} beside the modules, {named_paths(paths)}")
    return lines


def named_paths(paths):
    """Name the first of ``[[path, count]]``, below the directory they share."""
    shown = paths[:NAMED]
    base = _os.path.commonpath([_os.path.dirname(p) for p, _ in shown])
    names = ", ".join(f"{_os.path.relpath(p, base)} ({n})" for p, n in shown)
    more = f" and {len(paths) - NAMED} more" if len(paths) > NAMED else ""
    return f"in {base}: {names}{more}"


def live_line(live):
    """Say in one line what live imports did."""
    if live["mode"] != "live":
        return f"  live imports: none ({live['mode']})"
    return (
        f"  live imports: rank 0 read {live.get('read_files', 0)} files "
        f"({live.get('read_bytes', 0)} bytes) and {live.get('read_listings', 0)} "
        f"listings; {live.get('requests', 0)} requests, "
        f"{live.get('relay_forwarded', 0)} forwarded to rank 0, "
        f"{live.get('fallbacks', 0)} read from originals"
    ) + late_line(live)


def late_line(live):
    """Say which requests went unanswered in time, if any (a line of its own)."""
    if not live.get("late"):
        return ""
    ranks, names = live.get("late_ranks", []), live.get("late_keys", [])
    shown = ", ".join(dict.fromkeys(names[:SHOWN]))
    return (
        f"\n  live imports: {live['late']} requests unanswered in time on "
        f"ranks {ranks} (MPISTAGE_LIVE_WAIT); imported from the originals "
        f"instead: {shown}"
    )


def start_lines(start):
    """Say how the ranks imported mpi4py (lines; none without the node boot)."""
    if not start:
        return []
    lines = [
        f"  start: {len(start['first'])} rank(s) imported mpi4py for their node "
        f"({rank_list(start['first'])}), {len(start['copy'])} from their node's "
        f"copy, {len(start['normal'])} as usual"
    ]
    for reason, ranks in start["reasons"].items():
        lines.append(f"  as usual on rank(s) {rank_list(ranks)}: {reason}")
    return lines + bypassed_lines(start.get("ranks") or [])


def bypassed_lines(facts):
    """Say which ranks mapped originals although their node had copies."""
    found = {}
    for rank, fact in enumerate(facts):
        for path in (fact or {}).get("originals_mapped") or ():
            found.setdefault(path, []).append(rank)
    return [
        f"  loaded from the original on rank(s) {rank_list(ranks)}, though the "
        f"node had a copy: {path}"
        for path, ranks in sorted(found.items())
    ]


def rank_list(ranks):
    """Return ranks as short text: ``0-3, 8, 12-15`` (``none`` if empty)."""
    runs = []
    for rank in ranks:
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:SHOWN])
    return (text + (" ..." if len(runs) > SHOWN else "")) or "none"


def hint(ranks_that_missed, size):
    """Say how to get the missed modules into the bundle."""
    if ranks_that_missed and ranks_that_missed != [0]:
        return (
            "  hint: ranks other than 0 imported them: learn with --auto (it "
            "records every rank), or `mpistage record -o app.mpistage -- mpiexec "
            f"-n {min(size, 4)} python app.py`, or add them: `mpistage pack ... NAME`"
        )
    return (
        "  hint: re-record with `mpistage record -o app.mpistage -- python "
        "app.py` (--granularity package, the default, takes whole packages), "
        "or add them: `mpistage pack ... NAME`"
    )


def emit(report, show):
    """Print the report if *show*; write JSON to ``MPISTAGE_REPORT`` if set."""
    from mpistage.settings import get

    if show:
        print(render(report), file=_sys.stderr, flush=True)
    path = get("MPISTAGE_REPORT")
    if path:
        try:
            write_json(path, report)
        except OSError as exc:
            from mpistage import StageError

            raise StageError(
                f"cannot write the report MPISTAGE_REPORT={path!r}: {exc.strerror}"
            ) from None


def check_writable(path):
    """Refuse a report path whose directory this process cannot write."""
    if not path:
        return
    folder = _os.path.dirname(_os.path.abspath(path))
    if not _os.path.isdir(folder) or not _os.access(folder, _os.W_OK | _os.X_OK):
        from mpistage import StageError

        raise StageError(
            f"cannot write the report MPISTAGE_REPORT={path!r}: "
            f"{folder!r} is not a directory this user can write"
        )


def write_json(path, data):
    """Write *data* as JSON to *path* atomically (with mpistage's own modules)."""
    from mpistage import lend, own_module

    json, tempfile = own_module("json"), own_module("tempfile")

    folder = _os.path.dirname(_os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mpistage-report-")
    try:
        with _os.fdopen(fd, "w") as f, lend("json"):
            json.dump(data, f, indent=2)
        _os.replace(tmp, path)
    except BaseException:
        _os.unlink(tmp)
        raise


def classify(activation):
    """Sort modules imported since activation: served, missed, stdlib."""
    from mpistage.runtime.roots import in_stdlib

    served, missed, stdlib = [], [], []
    root = activation.root + _os.sep
    for name, module in list(_sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if name in activation.before or name.partition(".")[0] == "mpistage":
            continue
        if not origin or not _os.path.isabs(origin):
            continue
        if read_from(spec, origin).startswith(root):
            served.append(name)
        elif in_stdlib(origin):
            stdlib.append(name)
        else:
            missed.append(name)
    return {"served": served, "missed": missed, "stdlib": stdlib}


def read_from(spec, origin):
    """Where the module of *spec* was read from (a copy, for one shown as original)."""
    staged_path = getattr(spec.loader, "staged_path", None)
    return staged_path(origin) if callable(staged_path) else origin
