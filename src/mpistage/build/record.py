"""Learn what a program uses, and turn that into a bundle.

A :class:`Recorder` runs inside the program. An audit hook notes every file
it opens (``open``, ``importlib.resources``, ``importlib.metadata``,
``get_data``) and every library ``ctypes`` loads; at the end, the modules in
``sys.modules`` and the files mapped into the process (``/proc/self/maps``:
extension modules and the shared libraries they link) are added.

:func:`build` groups the used files by sys.path root and writes a bundle:

- ``package`` granularity takes whole top-level packages, with their
  distribution metadata and ``.libs`` directories, so that a submodule that
  only some ranks import later is present too;
- ``file`` granularity takes only the files that were used.

The interpreter's own standard library is left out (see ``mpistage stage``),
and so is mpistage itself. Top-level ``.pth`` files of each used root are
always taken: the interpreter reads them before any recorder can start.
"""

import os as _os
import sys as _sys

GRANULARITIES = ("package", "file")
_EVENTS = ("open", "ctypes.dlopen")


class Recorder:
    """Notes the files this process uses; see the module docstring."""

    def __init__(self):
        self.paths = set()
        self.active = True
        # Loaded before any runner can act (.pth hooks, the runner itself):
        # staging them would not help, so they are not recorded.
        self.preloaded = set(_sys.modules)
        _sys.addaudithook(self.hook)

    def hook(self, event, args):
        """Audit hook: remember paths opened for reading, and dlopened ones."""
        if not self.active or event not in _EVENTS:
            return
        if event == "open" and writes(args):
            return
        path = args[0]
        if isinstance(path, bytes):
            path = _os.fsdecode(path)
        if isinstance(path, str) and (event == "open" or _os.sep in path):
            self.paths.add(path if _os.path.isabs(path) else _os.path.abspath(path))

    def usage(self):
        """Stop recording; return what was used, as JSON-ready data."""
        from mpistage.bundle import python_tag

        self.active = False
        paths = self.paths | module_files(self.preloaded) | mapped_files()
        entries = [_os.path.abspath(p or ".") for p in _sys.path]
        return {"python": python_tag(), "sys_path": entries, "files": sorted(paths)}


def writes(args):
    """Whether an ``open`` audit event's (path, mode, flags) opens for writing."""
    _, mode, flags = args
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(isinstance(flags, int) and flags & (_os.O_WRONLY | _os.O_RDWR))


def module_files(skip=()):
    """Return the source, bytecode and extension files of loaded modules.

    Modules named in *skip* are left out.
    """
    found = set()
    for name, module in list(_sys.modules.items()):
        if name in skip:
            continue
        spec = getattr(module, "__spec__", None)
        for path in (getattr(spec, "origin", None), getattr(spec, "cached", None)):
            if path and _os.path.isabs(path) and _os.path.isfile(path):
                found.add(path)
    return found


def mapped_files():
    """Return the files mapped into this process (shared libraries)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    found.add(fields[5].strip())
    except OSError:
        pass
    return found


def usable_roots(usages):
    """Return the sys.path directories of *usages* but the stdlib, deepest first."""
    from mpistage.activate import in_stdlib, stdlib_dir

    roots = {p for u in usages for p in u["sys_path"] if _os.path.isdir(p)}
    keep = [r for r in roots if r != stdlib_dir() and not in_stdlib(r)]
    return sorted(keep, key=len, reverse=True)


def split(path, roots):
    """Return (root, first component, rel) of *path*, or ``None``."""
    for root in roots:
        if path.startswith(root + _os.sep):
            rel = path[len(root) + 1 :]
            return root, rel.split(_os.sep, 1)[0], rel
    return None


def choose(roots_obj, path, roots, granularity, done):
    """Add the member(s) that a use of *path* calls for.

    *done* holds the (root, name) packages already added whole.
    """
    from mpistage.pack import add_top, top_name

    found = split(path, roots)
    if found is None or not _os.path.exists(path):
        return
    root, top, _ = found
    if top == "mpistage" or top.startswith("mpistage."):
        return
    name = top_name(top)
    if granularity == "file" or top == "__pycache__":
        roots_obj.take(root, path)
    elif top.endswith((".dist-info", ".egg-info", ".libs")):
        roots_obj.take(root, _os.path.join(root, top))
    elif name.isidentifier() and not top.endswith(".pth"):
        if (root, name) not in done:
            done.add((root, name))
            add_top(roots_obj, root, name, top_locations(root, name))
    else:
        roots_obj.take(root, path)


def top_locations(root, name):
    """Return the entries of *root* that make up the top-level module *name*."""
    from mpistage.pack import top_name

    entries = []
    for entry in _os.listdir(root):
        if top_name(entry) == name and not entry.endswith((".dist-info", ".egg-info")):
            entries.append(_os.path.join(root, entry))
    cache = _os.path.join(root, "__pycache__")
    if _os.path.isdir(cache):
        for entry in _os.listdir(cache):
            if top_name(entry) == name:
                entries.append(_os.path.join(cache, entry))
    return entries


def build(output, usages, granularity="package", created_by="record", extra=None):
    """Write the bundle of what *usages* used; return its manifest."""
    from mpistage.errors import StageError
    from mpistage.pack import Roots, write

    check_same_python(usages)
    roots, chosen, done = usable_roots(usages), Roots(), set()
    for path in sorted({p for u in usages for p in u["files"]}):
        choose(chosen, path, roots, granularity, done)
    for root in list(chosen.paths):
        for entry in _os.listdir(root):
            if entry.endswith(".pth"):
                chosen.take(root, _os.path.join(root, entry))
    if not chosen.paths:
        raise StageError("the program used no files outside the standard library")
    names = sorted({top_of(p, r) for r in chosen.paths for p in chosen.files[r]} - {""})
    info = dict(extra or {}, granularity=granularity)
    return write(
        output,
        chosen,
        names,
        created_by,
        python=usages[0]["python"],
        extra={"recorded": info},
    )


def top_of(path, root):
    """Return the importable top-level name *path* belongs to, or ''."""
    rel = _os.path.relpath(path, root).split(_os.sep)[0]
    name = rel.split(".", 1)[0]
    return (
        name
        if name.isidentifier()
        and not rel.endswith((".dist-info", ".egg-info", ".pth", ".libs"))
        else ""
    )


def check_same_python(usages):
    """Refuse usages recorded by different Pythons."""
    from mpistage.errors import StageError

    if not usages:
        raise StageError("no Python process was recorded")
    tags = {tuple(sorted(u["python"].items())) for u in usages}
    if len(tags) > 1:
        raise StageError("the recorded processes ran different Pythons")


def start_child(folder):
    """Record this process; write its usage to *folder* at exit."""
    import atexit

    recorder = Recorder()
    atexit.register(save_usage, recorder, folder)
    return recorder


def save_usage(recorder, folder):
    """Write *recorder*'s usage as ``usage.<pid>.json`` in *folder*."""
    from mpistage.report import write_json

    usage = recorder.usage()
    write_json(_os.path.join(folder, f"usage.{_os.getpid()}.json"), usage)
