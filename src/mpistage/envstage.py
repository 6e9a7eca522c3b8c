"""``mpistage stage``: unpack an environment bundle on every node.

Run under the launcher with any number of ranks per node, for example
``mpiexec -n NODES -ppn 1 mpistage stage env.mpistage --to /dev/shm/env``
or ``srun --ntasks-per-node=1 mpistage stage ...``. As in the runner, rank 0
reads the bundle once, the bytes go to one leader per node, and each leader
unpacks them into ``DIR`` (``{node}`` in ``DIR`` becomes the node's index,
for emulated nodes on one machine). Then ``DIR/bin/python`` runs with
everything node-local.

``DIR`` follows the staging roots' rules: created with mode 0700 without
following symlinks; a symlink, someone else's directory or one others can
write to is refused; so is a non-empty directory that is not a previous
stage of the same bundle (that one is reused as it is).
"""

import os as _os

from mpistage.errors import StageError

MARKER = ".mpistage-stage.json"


def env_lines(folder, manifest):
    """Return the shell lines that put the staged environment to use."""
    folder = _os.path.abspath(folder)
    lines = [f'export PATH="{folder}/bin:$PATH"']
    if manifest.get("env", {}).get("libraries"):
        keep = "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        lines.append(f'export LD_LIBRARY_PATH="{folder}/lib{keep}"')
    lines += ["export PYTHONNOUSERSITE=1", "unset PYTHONHOME PYTHONPATH"]
    return lines


def marker_of(folder):
    """Return the stage marker in *folder*, or ``None``."""
    import json

    try:
        with open(_os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def prepare(folder, digest, need):
    """Make *folder* ready: return ``True`` to unpack, ``False`` if already staged."""
    from mpistage.stage import check_owned, room

    if _os.path.islink(folder):
        raise StageError(f"{folder!r} is a symlink")
    try:
        _os.makedirs(_os.path.dirname(folder), exist_ok=True)
        _os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StageError(f"cannot create {folder!r}: {exc.strerror}") from None
    fd = _os.open(folder, _os.O_RDONLY | _os.O_DIRECTORY | _os.O_NOFOLLOW)
    try:
        check_owned(_os.fstat(fd), folder)
    finally:
        _os.close(fd)
    if _os.listdir(folder):
        marker = marker_of(folder)
        if marker and marker.get("bundle_sha256") == digest:
            return False
        raise StageError(
            f"{folder!r} is not empty and is not a stage of this bundle; "
            "choose an empty or new directory (`mpistage clean DIR` removes an "
            "earlier stage)"
        )
    room(folder, need)
    return True


def unpack(folder, buf, name):
    """Verify and write the bundle *buf* into *folder*; write the marker last."""
    import hashlib

    from mpistage.bundle import HEADER_SIZE, manifest_of
    from mpistage.report import write_json
    from mpistage.stage import write_tree

    manifest = manifest_of(buf, name)
    digest = hashlib.sha256(bytes(buf[:HEADER_SIZE])).hexdigest()
    if not prepare(folder, digest, len(buf)):
        return manifest, False
    try:
        write_tree(folder, buf, manifest, name)
    except BaseException:
        clear(folder)
        raise
    write_json(_os.path.join(folder, MARKER), {"bundle": name, "bundle_sha256": digest})
    return manifest, True


def clear(folder):
    """Empty *folder* after a failed unpack (it was empty before)."""
    import shutil

    for entry in _os.listdir(folder):
        path = _os.path.join(folder, entry)
        if _os.path.isdir(path) and not _os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _os.unlink(path)


def node_dir(template, index):
    """Return the directory for node *index* (``{node}`` replaced)."""
    return _os.path.abspath(template.replace("{node}", str(index)))
