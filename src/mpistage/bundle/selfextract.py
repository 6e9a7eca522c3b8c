"""Self-extracting environment bundles: ``mpistage pack --env --self-extracting``.

A launcher's own broadcast tree can carry an environment to every node
before the ranks start: ``srun --bcast=DIR/ env.run -- python app.py``
(``DIR`` a directory of the user's on each node, docs/stage.md) reads the
file once (srun) and spreads it along Slurm's tree,
where every node reading a bundle itself would read it once per node from
the shared file system. What the launcher broadcasts is the executable, so
the bundle must be one: ``bin/mpistage-env`` with ``PAYLOAD`` set to the
offset of the bundle appended after it. Run as ``FILE -- COMMAND``, the
script reads the bundle from itself; found in a node-local place (or a
directory of its own there), it takes itself for the launcher's copy, runs
only if it is a file of the user's alone, and goes with the launch's copy.
"""

import os as _os

from mpistage import StageError

PAYLOAD_LINE = b"PAYLOAD=0000000000000\n"  # in bin/mpistage-env: 13 digits


def script_text():
    """Return ``mpistage-env``'s text: the checkout's, else the installed one."""
    import sysconfig

    import mpistage

    package = _os.path.dirname(_os.path.abspath(mpistage.__file__))
    for folder in (
        _os.path.join(package, "..", "..", "bin"),
        sysconfig.get_path("scripts"),
    ):
        try:
            with open(_os.path.join(folder, "mpistage-env"), "rb") as f:
                return f.read()
        except OSError:
            continue
    raise StageError(
        "cannot find the mpistage-env script to make a self-extracting bundle"
    )


def attach(bundle, output):
    """Write *output*: the script, then the bundle at *bundle*; executable."""
    from mpistage.bundle.writer import make_temporary

    text = script_text()
    if text.count(PAYLOAD_LINE) != 1:
        raise StageError("the mpistage-env script found has no PAYLOAD line")
    offset = len(text)
    text = text.replace(PAYLOAD_LINE, b"PAYLOAD=%013d\n" % offset)
    fd, tmp = make_temporary(_os.path.dirname(_os.path.abspath(output)))
    try:
        with _os.fdopen(fd, "wb") as out, open(bundle, "rb") as src:
            out.write(text)
            out.flush()
            copy_rest(src.fileno(), out.fileno(), _os.fstat(src.fileno()).st_size)
            _os.fchmod(out.fileno(), 0o755)
        _os.replace(tmp, output)
    except BaseException:
        _os.unlink(tmp)
        raise


def copy_rest(src, dst, size):
    """Copy *size* bytes from *src* to *dst*, in the kernel where it can."""
    done = 0
    while done < size:
        try:
            n = _os.copy_file_range(src, dst, size - done)
        except OSError:
            n = _os.write(dst, _os.read(src, min(size - done, 64 << 20)))
        if not n:
            raise StageError("the bundle shrank while it was copied")
        done += n
