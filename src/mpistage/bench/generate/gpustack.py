"""A crafted GPU-shaped stack: ``fakegpu`` and its CUDA-like libraries.

What a CUDA wheel stack looks like to a loader, at a size of our choosing:

- ``fakegpu/``: a package whose C extension ``_core`` is linked
  (``DT_NEEDED``) to ``libfakecu1.so.1``, ``libfakecu2.so.1`` and
  ``libfakecu3.so.1``, found through a ``DT_RUNPATH`` of
  ``$ORIGIN/../nvidia/fakecuN/lib``, as torch and jax's CUDA plugins find
  ``nvidia-*`` wheels;
- ``nvidia/fakecuN/lib/``: each library in a sibling distribution
  (``nvidia-fakecuN``) of the same site-packages, padded with a section
  the loader never maps (``.pad``, not allocated) of pseudo-random bytes,
  so that the file is big, its pages are real and nothing compresses it.

The stack is built once per size and kept in
``${MPISTAGE_CI_CACHE:-~/.cache/mpistage-ci}/gpustack/KEY/site``, KEY a
hash of this file, the size and the Python tag, so a session (or a fresh
clone) only builds it once. ``python -m mpistage.bench.generate.gpustack
SIZE`` builds it and prints the site directory.

The test tier (tests/test_gpusize.py) and the benchmark campaign
(``python -m mpistage.bench.campaigns.gpusize``) use it.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

LIBRARIES = 3
PACKAGE = "fakegpu"
NAMES = ("_core", *(f"libfakecu{i}" for i in range(1, LIBRARIES + 1)))
CHUNK = 64 << 20

LIBRARY_C = """\
int fakecu{i}_value(void) {{ return {i} * 100 + {i}; }}
"""

CORE_C = """\
#define PY_SSIZE_T_CLEAN
#include <Python.h>
{decls}
static PyObject *compute(PyObject *self, PyObject *args) {{
    return PyLong_FromLong({calls});
}}
static PyMethodDef methods[] = {{
    {{"compute", compute, METH_NOARGS, "Call every library once."}},
    {{NULL, NULL, 0, NULL}}
}};
static struct PyModuleDef module = {{
    PyModuleDef_HEAD_INIT, "fakegpu._core", NULL, -1, methods
}};
PyMODINIT_FUNC PyInit__core(void) {{ return PyModule_Create(&module); }}
"""

# 101 + 202 + 303: what compute() returns when every library was loaded.
EXPECTED = sum(i * 100 + i for i in range(1, LIBRARIES + 1))

INIT_PY = '''\
"""A GPU-shaped package: an extension linked to big sibling libraries."""

import os as _os

from fakegpu._core import compute

NAMES = {names!r}


def mapped():
    """Return {{name: path}} of the extension and libraries this process maps."""
    found = {{}}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            base = _os.path.basename(path)
            for name in NAMES:
                if base.startswith(name + ".") or base.startswith(name + "-"):
                    found[name] = path
    return found
'''


def parse_size(text):
    """Return the bytes of a size such as ``300MB``, ``2.5GB`` or ``1GiB``."""
    from mpistage.bench.units import parse_size as parse

    return int(parse(text, "stack size"))


def cache_root():
    """The directory of built stacks, shared with scripts/source-venv's cache."""
    from mpistage.settings import get

    base = get("MPISTAGE_CI_CACHE") or Path.home() / ".cache/mpistage-ci"
    return Path(base) / "gpustack"


def key(size):
    """The cache key of a stack of *size* bytes: this generator, size, Python."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"{size} {sys.implementation.cache_tag}".encode())
    return digest.hexdigest()[:16]


def stack(size):
    """Return the site directory of the stack of *size* bytes, built if needed."""
    folder = cache_root() / key(size)
    site = folder / "site"
    if not site.is_dir():
        building = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        build(building / "site", size, building / "work")
        shutil.rmtree(building / "work")
        try:
            building.rename(folder)
        except OSError:  # another session built it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    return site


def cc(*args):
    """Run the C compiler; raise with its message if it fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
    done = subprocess.run([compiler, *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{compiler} failed:\n{done.stderr}")


def build(site, size, work):
    """Build the stack into *site*: libraries padded to *size* bytes in all."""
    work.mkdir(parents=True)
    pads = [size // LIBRARIES] * LIBRARIES
    pads[-1] += size - sum(pads)
    for i in range(1, LIBRARIES + 1):
        library(site, work, i, pads[i - 1])
    extension(site, work)
    dist_info(site, PACKAGE, "1.0", [PACKAGE], PACKAGE_REQUIRES)
    for i in range(1, LIBRARIES + 1):
        dist_info(site, f"nvidia_fakecu{i}", "12.0", [f"nvidia/fakecu{i}"], [])


PACKAGE_REQUIRES = [f"nvidia-fakecu{i}" for i in range(1, LIBRARIES + 1)]


def library(site, work, i, pad):
    """Build ``libfakecuI.so.1`` in its distribution, padded to about *pad* bytes."""
    source = work / f"fakecu{i}.c"
    source.write_text(LIBRARY_C.format(i=i))
    linked = work / f"libfakecu{i}.so"  # what the extension links against
    cc(
        "-shared",
        "-fPIC",
        "-O1",
        f"-Wl,-soname,libfakecu{i}.so.1",
        source,
        "-o",
        linked,
    )
    folder = site / "nvidia" / f"fakecu{i}" / "lib"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    (folder / "__init__.py").write_text("")
    fill = work / f"pad{i}"
    random_file(fill, max(pad - linked.stat().st_size, 0), seed=i)
    done = subprocess.run(
        [
            "objcopy",
            f"--add-section=.pad={fill}",
            "--set-section-flags=.pad=noload,readonly",
            linked,
            folder / f"libfakecu{i}.so.1",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"objcopy failed:\n{done.stderr}")
    fill.unlink()


def random_file(path, size, seed):
    """Write *size* pseudo-random bytes to *path* (no holes, nothing to compress)."""
    import random

    rng = random.Random(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, CHUNK)
            f.write(rng.randbytes(n))
            left -= n


def extension(site, work):
    """Build ``fakegpu/_core`` linked to the libraries, with its RUNPATH."""
    package = site / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text(INIT_PY.format(names=NAMES))
    decls = "".join(f"int fakecu{i}_value(void);\n" for i in range(1, 4))
    calls = " + ".join(f"fakecu{i}_value()" for i in range(1, LIBRARIES + 1))
    source = work / "core.c"
    source.write_text(CORE_C.format(decls=decls, calls=calls))
    runpath = ":".join(
        f"$ORIGIN/../nvidia/fakecu{i}/lib" for i in range(1, LIBRARIES + 1)
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    include = sysconfig.get_paths()["include"]
    libs = [f"-lfakecu{i}" for i in range(1, LIBRARIES + 1)]
    cc(
        "-shared",
        "-fPIC",
        "-O1",
        f"-I{include}",
        source,
        f"-L{work}",
        *libs,
        "-Wl,--enable-new-dtags",
        f"-Wl,-rpath,{runpath}",
        "-o",
        package / f"_core{suffix}",
    )


def dist_info(site, name, version, trees, requires):
    """Make *trees* of *site* the files of an installed distribution *name*."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    meta = f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\n"
    meta += f"Version: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(meta)
    files = sorted(p for t in trees for p in (site / t).rglob("*") if p.is_file())
    lines = [f"{p.relative_to(site)},," for p in files]
    lines += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(lines) + "\n")


def size_of(site):
    """Return the bytes of the stack's files below *site*."""
    return sum(p.stat().st_size for p in Path(site).rglob("*") if p.is_file())


def link_tree(src, dst):
    """Copy the stack's entries of *src* into *dst*, hard links where possible."""

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    for entry in Path(src).iterdir():
        target = Path(dst) / entry.name
        if entry.is_dir():
            shutil.copytree(entry, target, copy_function=link, dirs_exist_ok=True)
        else:
            link(entry, target)


if __name__ == "__main__":
    print(stack(parse_size(sys.argv[1] if len(sys.argv) > 1 else "300MB")))
