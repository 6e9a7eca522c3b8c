"""How ranks agree, and how they wait for each other without burning CPU.

Every cross-rank decision goes through :func:`agree`: each rank says whether
it succeeded, and either all ranks go on or all raise the same
:class:`~mpistage.StageError`. No rank branches alone, so a failure ends the
job and never hangs it. :func:`attempt` runs one step and agrees on it,
whatever the step raised: a broken manifest, a full disk and an exhausted
memory all become one agreed error.

Waiting ranks poll a nonblocking collective and sleep in between
(:func:`wait`) instead of spinning inside MPI: a rank waiting for its node
leader to stage must not take CPU from that leader, which matters when ranks
outnumber cores, as in emulated-node tests and benchmarks on one machine.
"""

from mpistage import Backoff, StageError, describe

POLL_MIN = 0.00005  # seconds between the first polls: a fast step loses little
POLL_MAX = 0.002  # seconds between later polls: a waiting rank takes no CPU


def wait(request):
    """Complete *request*, sleeping between polls (50 µs growing to 2 ms)."""
    pauses = Backoff(POLL_MIN, POLL_MAX)
    while not request.Test():
        pauses.sleep()


def barrier(comm):
    """A barrier on *comm* that sleeps while it waits."""
    wait(comm.Ibarrier())


def int_buffer(value):
    """Return a one-element C int buffer holding *value*."""
    buf = memoryview(bytearray(4)).cast("i")
    buf[0] = value
    return buf


def first_failure(comm, failed):
    """Return the lowest rank of *comm* that *failed*, or ``None``."""
    from mpi4py import MPI

    mine, first = int_buffer(comm.rank if failed else comm.size), int_buffer(0)
    wait(comm.Iallreduce([mine, MPI.INT], [first, MPI.INT], op=MPI.MIN))
    return None if first[0] == comm.size else first[0]


def agree(comm, error=None):
    """Raise the lowest failing rank's error on every rank of *comm*, or return.

    *error* is this rank's exception (or ``None`` for success). The message of
    the lowest-ranked failure is broadcast, so every rank raises the same
    :class:`StageError` and the job takes one branch.
    """
    rank = first_failure(comm, error is not None)
    if rank is None:
        return
    message = comm.bcast(describe(error) if comm.rank == rank else None, root=rank)
    raise StageError(message)


def attempt(comm, step, *args):
    """Run ``step(*args)`` on this rank and :func:`agree` on the outcome.

    Returns the step's result. Any exception on any rank (but a
    ``KeyboardInterrupt`` or ``SystemExit``, which end the process) becomes
    the same :class:`StageError` on all ranks.
    """
    try:
        result = step(*args)
    except Exception as exc:
        agree(comm, exc)
        raise AssertionError("unreachable") from exc
    agree(comm)
    return result


def abort(comm, status=1):
    """End the whole job now: ``MPI_Abort`` on *comm*, if MPI still runs."""
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        comm.Abort(status)
    import os

    os._exit(status)
