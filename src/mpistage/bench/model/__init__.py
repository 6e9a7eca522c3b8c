"""``mpistage bench model``: what start-up costs at 1k-128k ranks.

A small analytic model. It turns counts one measures at one or a few ranks
(shared-FS metadata operations and bytes per rank, per node and per job, the
bundle's size, the local CPU time of start-up) into the seconds each step
takes at P ranks on N nodes. The modes differ only in those counts:

- ``plain``: every rank imports everything from the shared file system;
- ``mpistage``: the runner; every rank still starts its interpreter and
  mpi4py from the shared FS (F operations), rank 0 also reads the bundle and
  checks it for staleness, the leaders get it by broadcast and write one copy
  per node, then every rank imports locally;
- ``mpistage-trust``: the runner without the staleness check;
- ``staged-env``: a stage step (one process per node) copies the whole
  environment to every node; the run step makes no shared-FS operation;
- ``env-launch``: one launch; one process per node reads the environment
  bundle from the shared FS and unpacks it;
- ``env-launch-bcast``: one launch; the launcher (``srun --bcast``) reads
  the bundle once and its tree carries it to every node.

Every mode also pays the launcher's start and MPI_Init.

One module per job: :mod:`.equations` (the machine, a mode's inputs and the
seconds of each step; docs/scale.md has the same equations), :mod:`.inputs`
(the built-in inputs and the ones given by hand), :mod:`.measured` (a
``mpistage bench run`` results file, one row per cell), :mod:`.fit` (a mode's
local costs fitted from its 1-rank cell), :mod:`.tables` (the printed
tables), :mod:`.weights` (a checkpoint onto every node, ``--weights``),
:mod:`.validation` (the model against measured totals),
:mod:`.seeds` (the model against published figures), :mod:`.plot` and
:mod:`.cli` (``mpistage bench model``). Standard library only; matplotlib is
imported for ``--plot`` alone.
"""

from mpistage.bench.model.equations import Inputs, Machine, nodes_for, predict

__all__ = ["Inputs", "Machine", "nodes_for", "predict"]
