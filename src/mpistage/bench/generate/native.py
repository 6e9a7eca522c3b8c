"""The native part of a workload: utility libraries and C extensions, compiled.

The extensions link against the libraries in ``NAME.libs/`` through an
``$ORIGIN``-relative RPATH, as auditwheel lays out wheels, so the tree still
imports after it moves. Everything compiles in parallel on all cores.
"""

import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mpistage.bench.generate.sources import (
    extension_name,
    extension_source,
    library_name,
    library_source,
)
from mpistage.bench.generate.spec import GenerateError

SHARED = ("-O1", "-shared", "-fPIC")  # how every library and extension compiles


def find_compiler(cc=None):
    """Return the C compiler command as an argv list, or raise GenerateError.

    Tries *cc*, then ``$CC``, Python's configured ``CC``, ``cc``, ``gcc``
    and ``clang``.
    """
    if cc:
        argv = shlex.split(cc)
        if argv and shutil.which(argv[0]):
            return argv
        raise GenerateError(f"C compiler not found: {cc!r}")
    candidates = [
        os.environ.get("CC"),
        sysconfig.get_config_var("CC"),
        "cc",
        "gcc",
        "clang",
    ]
    for candidate in filter(None, candidates):
        argv = shlex.split(candidate)
        if argv and shutil.which(argv[0]):
            return argv
    raise GenerateError(
        "no C compiler found: install one (`apt-get install gcc`), "
        "pass --cc, or use --extensions 0"
    )


def _python_includes():
    paths = sysconfig.get_paths()
    includes = list(dict.fromkeys([paths["include"], paths["platinclude"]]))
    if not any(Path(p, "Python.h").exists() for p in includes):
        raise GenerateError(
            f"Python.h not found in {includes[0]!r}: install the "
            "Python development headers (e.g. python3-dev)"
        )
    return [f"-I{p}" for p in includes]


def _compile(command, what):
    done = subprocess.run(
        command, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        error = next((line for line in lines if "error" in line), lines[0])
        raise GenerateError(f"compiling {what} failed: {error}")


def _run_parallel(jobs):
    """Run ``(command, what)`` jobs on all cores; raise the first failure."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for future in [pool.submit(_compile, *job) for job in jobs]:
            future.result()


def _shared_object(cc, out, src, *flags):
    """Return the job that compiles *src* into the shared object *out*."""
    return [*cc, *SHARED, "-o", str(out), str(src), *flags], out.name


def _library_jobs(cc, name, libraries, functions, build, libs_dir):
    jobs = []
    for k in range(libraries):
        src = build / f"util{k}.c"
        src.write_text(library_source(name, k, functions))
        soname = f"lib{library_name(name, k)}.so"
        jobs.append(_shared_object(cc, libs_dir / soname, src, f"-Wl,-soname,{soname}"))
    return jobs


def rpath_for(name, parts):
    """The $ORIGIN-relative RPATH of an extension in package *parts*."""
    return "$ORIGIN/" + "../" * (len(parts) + 1) + f"{name}.libs"


def _extension_jobs(cc, name, placements, libraries, build, root):
    includes = _python_includes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    jobs = []
    for index, parts in enumerate(placements):
        src = build / f"ext{index}.c"
        src.write_text(extension_source(name, index, libraries))
        out = root.joinpath(name, *parts, f"{extension_name(index)}{suffix}")
        link = []
        if libraries:
            link = [
                f"-L{root / (name + '.libs')}",
                f"-l{library_name(name, index % libraries)}",
                f"-Wl,-rpath,{rpath_for(name, parts)}",
            ]
        jobs.append(_shared_object(cc, out, src, *includes, *link))
    return jobs


def build_native(cc, name, root, placements, libraries, functions):
    """Compile the utility libraries, then the extensions, in parallel."""
    libs_dir = root / f"{name}.libs"
    libs_dir.mkdir()
    with tempfile.TemporaryDirectory(prefix="mpistage-gen-") as tmp:
        build = Path(tmp)
        _run_parallel(_library_jobs(cc, name, libraries, functions, build, libs_dir))
        _run_parallel(_extension_jobs(cc, name, placements, libraries, build, root))
