"""What runs on one node, before MPI and without it.

The node boot (:mod:`.boot`): the first rank of a node imports mpi4py and
records it (:mod:`.copy`, :mod:`.elf`), the node's other ranks import from
that copy (:mod:`.imports`); the launch and the node are named from what
the launcher says (:mod:`.launch`). The node-local rules every copy on a
node follows are here too: where a copy may be made, per user and 0700,
opened relative to directory descriptors (:mod:`.place`), and how it is
removed on every exit path, or by the next job if this one was killed
(:mod:`.cleanup`).

:mod:`mpistage.runtime` is what runs collectively, once MPI exists. Every
rank reads :data:`mpistage.NODE` of this package before MPI, relative to
the package's directory (:func:`mpistage.load_local`): nothing here may
import more than the standard library's built-in modules and mpistage's
own package before MPI.
"""
