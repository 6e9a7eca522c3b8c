"""What runs in every rank at start-up: the standard library and mpi4py only.

The steps of a job, one module each, in the order data flows:

    topology   world -> node communicator -> leaders communicator
    read       rank 0 reads the bundle once and checks it (format)
    validate   rank 0 checks the bundle against the originals (staleness)
    broadcast  the bytes go to one leader per node as raw MPI buffers
    (place)    each leader makes a safe, private directory for its node
               (mpistage.node.place: the node-local rules)
    extract    each leader writes the members into it
    activate   every rank serves the bundled roots from the node's copy
    report     rank 0 sums up the job

``stage`` strings read, broadcast, place and extract into the one
distribution pipeline; ``session`` adds activation and the end of it;
``launch`` (the runner) and ``stager`` (``mpistage stage``) are the two
entry points; ``collective`` is how ranks agree and wait (and
``mpistage.node.cleanup`` how every exit path removes the copy), ``roots``
the shared vocabulary, and
``auto`` the ``--auto`` cache.

Every rank gets this package from rank 0 by broadcast
(:func:`mpistage.load_runtime`), so its modules cost no file-system
operations on the other ranks. Its imports of the standard library are
limited to what the interpreter and mpi4py have already loaded; anything
else is imported inside the function that needs it, on the rank that needs
it.
"""
