"""Progress of a tool's long step, drawn by tqdm on a terminal only.

``with shown("pack", quiet=args.quiet): pack(...)`` shows the bundle
writer's members and bytes on stderr while it writes. Nothing is drawn
when stderr is not a terminal (a job script, a pipe, a log) or with
``-q``; tqdm is imported only then, never in a rank of a job.
"""

import contextlib as _contextlib
import sys as _sys


@_contextlib.contextmanager
def shown(what, quiet=False, stream=None):
    """Draw the bundle writer's progress under *what* for the time of the block."""
    from mpistage.bundle import writer

    stream = stream if stream is not None else _sys.stderr
    if quiet or not stream.isatty() or writer.observer is not None:
        yield
        return
    bars = []
    writer.observer = lambda total: bar(bars, what, total, stream)
    try:
        yield
    finally:
        writer.observer = None
        for b in bars:
            b.close()


def bar(bars, what, total, stream):
    """Open a bar of *total* members; return the function that advances it."""
    from tqdm import tqdm

    b = tqdm(total=total, desc=what, unit=" files", file=stream, leave=False)
    bars.append(b)
    written = [0]

    def advance(size):
        written[0] += size
        b.set_postfix_str(f"{written[0] / 1e6:,.0f} MB", refresh=False)
        b.update(1)

    return advance
