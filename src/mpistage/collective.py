"""How ranks agree, and how they wait for each other without burning CPU.

Every cross-rank decision goes through :func:`agree`: each rank says whether
it succeeded, and either all ranks go on or all raise the same error. No rank
branches alone, so a failure ends the job and never hangs it.

Waiting ranks poll a nonblocking collective and sleep in between
(:func:`wait`) instead of spinning inside MPI: a rank waiting for its node
leader to stage must not take CPU from that leader, which matters when ranks
outnumber cores, as in emulated-node tests and benchmarks on one machine.
"""

import time as _time

from mpistage.errors import StageError

POLL_MAX = 0.002


def wait(request):
    """Complete *request*, sleeping between polls (50 µs growing to 2 ms)."""
    pause = 0.00005
    while not request.Test():
        _time.sleep(pause)
        pause = min(pause * 2, POLL_MAX)


def barrier(comm):
    """A barrier on *comm* that sleeps while it waits."""
    wait(comm.Ibarrier())


def agree(comm, error=None):
    """Raise the lowest failing rank's error on every rank of *comm*, or return.

    *error* is this rank's exception (or ``None`` for success). The message of
    the lowest-ranked failure is broadcast, so every rank raises the same
    :class:`StageError` and the job takes one branch.
    """
    from array import array

    from mpi4py import MPI

    mine = array("i", [comm.rank if error is not None else comm.size])
    first = array("i", [0])
    wait(comm.Iallreduce([mine, MPI.INT], [first, MPI.INT], op=MPI.MIN))
    if first[0] == comm.size:
        return
    message = comm.bcast(str(error) if comm.rank == first[0] else None, root=first[0])
    raise StageError(message)


def attempt(comm, step, *args):
    """Run ``step(*args)`` on this rank and :func:`agree` on the outcome.

    Returns the step's result. A :class:`StageError` or ``OSError`` on any
    rank becomes the same :class:`StageError` on all ranks; anything else is a
    bug and propagates (the runner turns it into an MPI abort).
    """
    try:
        result = step(*args)
    except (StageError, OSError) as exc:
        agree(comm, exc)
        raise AssertionError("unreachable") from exc
    agree(comm)
    return result
