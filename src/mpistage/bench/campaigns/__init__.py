"""Campaigns: benchmarks that are programs of their own, beside ``mpistage bench``.

``mpistage bench run`` measures one cell at a time on the simulated shared
file system. These drive other things, each with its own command line:

- :mod:`.live_soak`: many live-import runs of a scipy program under CPU
  load, counting hangs (``python -m mpistage.bench.campaigns.live_soak``);
- :mod:`.slurm_run`: ``mpistage run`` against plain ``srun`` on the Slurm
  test cluster, per node;
- :mod:`.strace_startup`: file-system calls of a start-up, counted with
  ``strace`` on the local disk;
- :mod:`.bcast`: the bundle's broadcast against a plain mpi4py ``Bcast``
  of the same bytes in the same pieces, between emulated-node leaders.

docs/benchmarks.md gives each one's command and figures.
"""
