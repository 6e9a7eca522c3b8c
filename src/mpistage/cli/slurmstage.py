"""The stage step under Slurm: ``sbcast``, then a node-local extractor.

Inside a Slurm allocation, ``mpistage run`` stages the environment with no
Python started from the shared file system on any node:

1. ``/bin/sh`` on each node makes a private directory for the inputs,
   ``DIR.in`` (0700, this user's; anything else is refused);
2. ``sbcast`` copies the bundle there, and the extractor: a zip application
   of the part of mpistage that unpacks a bundle (:func:`write_extractor`).
   Slurm sends the bytes from this host along its own tree, so the shared
   file system is read once per job, by ``sbcast``, not once per node;
3. ``/bin/sh`` on each node checks the inputs and runs the extractor with the
   node's own Python (:data:`NODE_PYTHON`, part of the node image, so
   node-local), without ``site`` and ignoring ``PYTHON*`` variables; it
   unpacks the bundle into ``DIR`` as ``mpistage stage`` would
   (:func:`mpistage.runtime.stager.stage_here`). Then the inputs go.

The clean step removes ``DIR.in`` with ``DIR``. The assumption: the nodes
run a Python 3.10 or newer from their own image at :data:`NODE_PYTHON`; a
node without one (or with an older one) runs the extractor with the shared
environment's python instead, which costs that interpreter's start.

It is used when ``sbcast`` is beside ``srun``, the stage step covers every
node of the allocation (``sbcast`` writes to all of them) and the nodes
are real ones (not ``MPISTAGE_EMULATE_NODES``); otherwise the stage step is
``mpistage stage`` under ``srun``.
"""

import os as _os

NODE_PYTHON = "/usr/bin/python3"
INPUTS = ".in"  # DIR.in: the node's copies of the bundle and the extractor
BUNDLE, EXTRACTOR = "env.mpistage", "stage.pyz"
TOO_OLD = 3  # the extractor's exit status on a Python older than 3.10
MAIN = f"""\
import sys
if sys.version_info < (3, 10):
    sys.exit({TOO_OLD})
from mpistage.runtime.stager import main_here
sys.exit(main_here(sys.argv[1:]))
"""

# sh -c PREPARE mpistage-prepare DIR.in TOKEN: a new private directory, or an
# error. An existing DIR.in is never adopted: it is not this run's. The
# marker, with this run's token and the real path, makes the clean step
# (REMOVE_STAGE) take it away too.
PREPARE = r"""
node=${SLURMD_NODENAME:-$(uname -n)}
umask 077
if mkdir -m 700 -- "$1" 2>/dev/null; then
  real=$(cd -P -- "$1" && pwd -P) &&
  printf 'token=%s\npath=%s\nmade=dir\n' "$2" "$real" > "$1/.mpistage-stage" &&
  exit 0
  rm -f -- "$1/.mpistage-stage"; rmdir -- "$1" 2>/dev/null
  echo "mpistage: error: on $node: cannot prepare $1; not staged" >&2
  exit 1
fi
echo "mpistage: error: on $node: $1 exists, not made by this run; not staged" >&2
exit 1
"""

# sh -c EXTRACT mpistage-extract DIR.in DIR SHARED_PYTHON TOKEN: run the
# extractor with the node's python (the shared one if the node has none, or
# too old), then remove DIR.in if it is still the one this run made.
EXTRACT = rf"""
node=${{SLURMD_NODENAME:-$(uname -n)}}
{{MINE}}
{{DROP}}
if ! found=$(mine "$1" "$4"); then
  echo "mpistage: error: on $node: $1 is not this run's directory; not staged" >&2
  exit 1
fi
real=${{found#* }}
python={NODE_PYTHON}
[ -x "$python" ] || python=$3
"$python" -E -s -S "$real/{EXTRACTOR}" "$real/{BUNDLE}" "$2" "$4"
status=$?
if [ $status -eq {TOO_OLD} ] && [ "$python" != "$3" ]; then
  "$3" -E -s -S "$real/{EXTRACTOR}" "$real/{BUNDLE}" "$2" "$4"
  status=$?
fi
drop "$real" dir
exit $status
"""


def usable(launch, folder):
    """Whether the stage step of *launch* into *folder* can go this way."""
    from mpistage.cli.launchers import Srun, emulated

    return (
        isinstance(launch, Srun)
        and bool(_os.environ.get("SLURM_JOB_ID"))
        and not emulated()
        and not launch.words("hosts")
        and sbcast(launch) is not None
    )


def sbcast(launch):
    """Return the ``sbcast`` beside the command's ``srun`` (else on PATH), or None."""
    import shutil

    beside = _os.path.join(_os.path.dirname(launch.command[0]), "sbcast")
    return beside if _os.path.isfile(beside) else shutil.which("sbcast")


def inputs(folder):
    """The node-local directory of the stage step's inputs: ``DIR.in``."""
    return folder.rstrip("/") + INPUTS


def commands(launch, bundle, folder, extractor, token):
    """The stage step: make ``DIR.in``, ``sbcast`` both files, extract.

    *token* is the run's (:attr:`mpistage.cli.run.Plan.token`): what the
    step makes carries it, and only that is removed.
    """
    from mpistage.cli.clean import DROP, MINE

    there = inputs(folder)
    cast = sbcast(launch)
    per_node = launch.per_node()
    extract = EXTRACT.replace("{MINE}", MINE).replace("{DROP}", DROP)
    return [
        [*per_node, "/bin/sh", "-c", PREPARE, "mpistage-prepare", there, token],
        [cast, "--force", extractor, f"{there}/{EXTRACTOR}"],
        [cast, "--force", bundle, f"{there}/{BUNDLE}"],
        [*per_node, "/bin/sh", "-c", extract, "mpistage-extract", there, folder,
         launch.python, token],
    ]  # fmt: skip


def write_extractor(path):
    """Write the extractor, a zip application of mpistage's unpacking, to *path*."""
    import zipfile

    import mpistage
    from mpistage.runtime.stager import NODE_MODULES

    package = _os.path.dirname(_os.path.abspath(mpistage.__file__))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("__main__.py", MAIN)
        for name in NODE_MODULES:
            archive.write(_os.path.join(package, f"{name}.py"), f"mpistage/{name}.py")
    return path
