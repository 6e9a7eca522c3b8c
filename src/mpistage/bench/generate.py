"""Generate a Pynamic-like Python workload for startup benchmarks.

Why: LLNL's Pynamic showed that what makes Python start slowly at scale is
not computation but the file system traffic of importing many modules and
loading many shared libraries. This generator builds such a workload, sized
on the command line, with nothing to download: pure-Python modules, real
CPython C extensions and the shared libraries they link against, data files
read through ``importlib.resources``, and dist-info metadata.

What: ``generate(DIR)`` makes DIR a ``sys.path`` root (like site-packages)::

    DIR/NAME/__init__.py, driver.py
    DIR/NAME/sub00/sub01/.../modNNNN.py        pure-Python modules, spread over
                                               nested subpackages
    DIR/NAME/.../_extNNN<EXT_SUFFIX>           C extensions, each calling one of
    DIR/NAME.libs/libNAME_utilK.so             the utility libraries, found via
                                               an $ORIGIN-relative RPATH (as
                                               auditwheel lays out wheels)
    DIR/NAME/data/dataN.txt                    data files
    DIR/NAME-1.0.dist-info/                    METADATA, RECORD, top_level.txt

``python -m NAME.driver`` (with DIR on ``PYTHONPATH``) imports every module
and extension, calls one function in each, reads every data file and prints a
JSON summary whose ``checksum`` must equal ``expected_checksum``. Modules are
byte-compiled by the generating interpreter, as an installer would, so run
the benchmark with that same interpreter.
"""

import argparse
import base64
import compileall
import hashlib
import keyword
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mpistage import StageError

VERSION = "1.0"
MODULUS = 1000003
_PROG = "mpistage"


class GenerateError(StageError):
    """A user-facing generator error: printed as one line, no traceback."""


# -- layout ------------------------------------------------------------------


def package_paths(packages, depth):
    """Relative paths of *packages* subpackages nested up to *depth* deep.

    Package ``j`` sits at level ``j % depth`` below the most recent package
    one level up, so ``depth=3`` gives ``sub00``, ``sub00/sub01``,
    ``sub00/sub01/sub02``, ``sub03``, ...
    """
    paths, chain = [], []
    for j in range(packages):
        level = j % max(depth, 1)
        chain = chain[:level] + [f"sub{j:02d}"]
        paths.append(tuple(chain))
    return paths


def _spread(count, slots):
    """Assign *count* items round-robin to *slots*: a list of slots."""
    return [slots[i % len(slots)] for i in range(count)]


def _dotted(name, parts, leaf):
    return ".".join([name, *parts, leaf])


# -- sources -----------------------------------------------------------------


def module_source(dotted, index, functions):
    """Source of pure-Python module number *index* with *functions* functions."""
    weights = ", ".join(str((index * 7 + j * 13) % 101) for j in range(8))
    names = ", ".join(repr(f"{dotted}.item{j}") for j in range(4))
    funcs = "\n\n".join(
        f'def f{j}(x):\n    """Mix *x* (step {j})."""\n'
        f"    return (x * {3 + (index + j) % 29} + {j + 1}) % {MODULUS}\n"
        for j in range(functions)
    )
    chain = "".join(f"f{j}, " for j in range(functions))
    return f'''\
"""Generated module {dotted} of a Pynamic-like workload."""

SEED = {1 + index * 37 % 9973}
LABEL = {dotted!r}
WEIGHTS = ({weights},)
NAMES = ({names},)


{funcs}

class Record:
    """A small record type."""

    def __init__(self, value):
        self.value = value

    def scaled(self, factor=3):
        """Return the value scaled and folded into the modulus."""
        return (self.value * factor + len(LABEL)) % {MODULUS}


def entry():
    """Return this module's contribution to the workload checksum."""
    x = SEED
    for func in ({chain}):
        x = func(x)
    return Record(x + sum(WEIGHTS)).scaled()
'''


def module_value(source):
    """The value ``entry()`` of a generated module returns."""
    namespace = {}
    exec(compile(source, "<generated>", "exec"), namespace)
    return namespace["entry"]()


def _library_params(k):
    return 31 + 2 * k, 7 + k


def library_source(name, k, functions):
    """C source of utility library *k*."""
    mul, add = _library_params(k)
    extra = "\n".join(
        f"long {name}_util{k}_f{j}(long x) "
        f"{{ return (x * {j + 2} + {k}) % {MODULUS}; }}"
        for j in range(functions)
    )
    return f"""\
/* Generated utility library {k} of workload {name}. */
long {name}_util{k}_mix(long x) {{ return (x * {mul} + {add}) % {MODULUS}; }}
{extra}
"""


def _extension_seed(index):
    return 1000 + 17 * index


def extension_value(index, libraries):
    """The value ``entry()`` of extension *index* returns."""
    if not libraries:
        return (_extension_seed(index) * 5 + 1) % MODULUS
    mul, add = _library_params(index % libraries)
    return (_extension_seed(index) * mul + add) % MODULUS


def extension_source(name, index, libraries):
    """C source of extension *index* (``_extNNN``), calling its library."""
    module = f"_ext{index:03d}"
    if libraries:
        func = f"{name}_util{index % libraries}_mix"
        decl = f"extern long {func}(long x);"
    else:
        func = "local_mix"
        decl = f"static long {func}(long x) {{ return (x * 5 + 1) % {MODULUS}; }}"
    return f"""\
/* Generated extension {module} of workload {name}. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

{decl}

static PyObject *entry(PyObject *self, PyObject *unused) {{
    return PyLong_FromLong({func}({_extension_seed(index)}L));
}}

static PyObject *mix(PyObject *self, PyObject *arg) {{
    long x = PyLong_AsLong(arg);
    if (x == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong({func}(x));
}}

static PyMethodDef methods[] = {{
    {{"entry", entry, METH_NOARGS, "Contribution to the workload checksum."}},
    {{"mix", mix, METH_O, "Mix an integer through the utility library."}},
    {{NULL, NULL, 0, NULL}}
}};

static struct PyModuleDef moduledef = {{
    PyModuleDef_HEAD_INIT, "{module}", "Generated extension.", -1, methods
}};

PyMODINIT_FUNC PyInit_{module}(void) {{
    PyObject *m = PyModule_Create(&moduledef);
    if (m != NULL && PyModule_AddIntConstant(m, "INDEX", {index}) < 0) {{
        Py_DECREF(m);
        return NULL;
    }}
    return m;
}}
"""


def data_content(index):
    """Bytes of data file *index*: a few KiB of deterministic text."""
    lines = (
        f"{index} {j} {(index * 131 + j * 71) % 10007}" for j in range(200 + index)
    )
    return ("\n".join(lines) + "\n").encode()


def driver_source(name, modules, extensions, data_files, expected):
    """Source of ``NAME/driver.py``."""

    def _tuple(items):
        body = "".join(f"    {item!r},\n" for item in items)
        return f"(\n{body})" if items else "()"

    return f'''\
"""Driver of the generated workload {name}: import and touch everything."""

import importlib
import json
import zlib
from importlib import resources

PACKAGE = {name!r}
MODULES = {_tuple(modules)}
EXTENSIONS = {_tuple(extensions)}
DATA_FILES = {_tuple(data_files)}
EXPECTED_CHECKSUM = {expected}


def main():
    """Import every module and extension, read every data file; summarize."""
    checksum = 0
    for dotted in MODULES + EXTENSIONS:
        checksum = (checksum + importlib.import_module(dotted).entry()) % 2**32
    data = resources.files(PACKAGE).joinpath("data")
    for filename in DATA_FILES:
        crc = zlib.crc32(data.joinpath(filename).read_bytes())
        checksum = (checksum + crc) % 2**32
    return {{
        "package": PACKAGE,
        "modules": len(MODULES),
        "extensions": len(EXTENSIONS),
        "data_files": len(DATA_FILES),
        "checksum": checksum,
        "expected_checksum": EXPECTED_CHECKSUM,
        "ok": checksum == EXPECTED_CHECKSUM,
    }}


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))
'''


# -- compiling -----------------------------------------------------------------


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


def _library_jobs(cc, name, libraries, functions, build, libs_dir):
    jobs = []
    for k in range(libraries):
        src = build / f"util{k}.c"
        src.write_text(library_source(name, k, functions))
        soname = f"lib{name}_util{k}.so"
        jobs.append(
            (
                [
                    *cc,
                    "-O1",
                    "-shared",
                    "-fPIC",
                    "-o",
                    str(libs_dir / soname),
                    str(src),
                    f"-Wl,-soname,{soname}",
                ],
                soname,
            )
        )
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
        out = root.joinpath(name, *parts, f"_ext{index:03d}{suffix}")
        link = []
        if libraries:
            link = [
                f"-L{root / (name + '.libs')}",
                f"-l{name}_util{index % libraries}",
                f"-Wl,-rpath,{rpath_for(name, parts)}",
            ]
        jobs.append(
            (
                [
                    *cc,
                    "-O1",
                    "-shared",
                    "-fPIC",
                    *includes,
                    "-o",
                    str(out),
                    str(src),
                    *link,
                ],
                out.name,
            )
        )
    return jobs


def _build_native(cc, name, root, placements, libraries, functions):
    """Compile the utility libraries, then the extensions, in parallel."""
    libs_dir = root / f"{name}.libs"
    libs_dir.mkdir()
    with tempfile.TemporaryDirectory(prefix="mpistage-gen-") as tmp:
        build = Path(tmp)
        _run_parallel(_library_jobs(cc, name, libraries, functions, build, libs_dir))
        _run_parallel(_extension_jobs(cc, name, placements, libraries, build, root))


# -- writing -----------------------------------------------------------------


def _write_packages(pkg, name, paths):
    (pkg / "__init__.py").write_text(
        f'"""Generated Pynamic-like workload {name}."""\n\n__version__ = "{VERSION}"\n'
    )
    for parts in paths:
        sub = pkg.joinpath(*parts)
        sub.mkdir()
        (sub / "__init__.py").write_text(
            f'"""Generated subpackage {_dotted(name, parts[:-1], parts[-1])}."""\n'
        )


def _write_modules(pkg, name, placements, functions):
    """Write the modules; return ``(dotted names, checksum contribution)``."""
    dotted_names, total = [], 0
    for index, parts in enumerate(placements):
        dotted = _dotted(name, parts, f"mod{index:04d}")
        source = module_source(dotted, index, functions)
        pkg.joinpath(*parts, f"mod{index:04d}.py").write_text(source)
        dotted_names.append(dotted)
        total += module_value(source)
    return dotted_names, total


def _write_data(pkg, count):
    """Write the data files; return ``(file names, checksum contribution)``."""
    if not count:
        return [], 0
    data = pkg / "data"
    data.mkdir()
    names, total = [], 0
    for index in range(count):
        content = data_content(index)
        (data / f"data{index}.txt").write_bytes(content)
        names.append(f"data{index}.txt")
        total += zlib.crc32(content)
    return names, total


def _record_line(root, path):
    digest = hashlib.sha256(path.read_bytes()).digest()
    encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={encoded},{path.stat().st_size}"


def _write_dist_info(root, name):
    """Write ``NAME-1.0.dist-info`` with a RECORD of every installed file."""
    info = root / f"{name}-{VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {VERSION}\n"
        "Summary: Pynamic-like workload generated by mpistage bench generate\n"
    )
    (info / "INSTALLER").write_text("mpistage\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    files = [
        p
        for top in (name, f"{name}.libs", info.name)
        for p in sorted((root / top).rglob("*"))
        if p.is_file()
    ]
    lines = [_record_line(root, p) for p in files]
    lines.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(lines) + "\n")


def _prepare(root, name, overwrite):
    """Create *root*; refuse (or with *overwrite* remove) an earlier workload."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise GenerateError(f"invalid name: {name!r} (must be a Python identifier)")
    if root.exists() and not root.is_dir():
        raise GenerateError(f"not a directory: {str(root)!r}")
    old = [root / n for n in (name, f"{name}.libs", f"{name}-{VERSION}.dist-info")]
    old = [p for p in old if p.exists()]
    if old and not overwrite:
        raise GenerateError(
            f"{str(old[0])!r} already exists (remove it or use --force)"
        )
    for path in old:
        shutil.rmtree(path)
    root.mkdir(parents=True, exist_ok=True)


def _check_counts(**counts):
    for key, value in counts.items():
        if not isinstance(value, int) or value < 0:
            raise GenerateError(f"{key} must be a non-negative integer, not {value!r}")


def generate(
    dest,
    *,
    modules=200,
    packages=10,
    depth=3,
    extensions=8,
    libraries=2,
    data_files=4,
    name="pynamic_ws",
    cc=None,
    functions=10,
    bytecode=True,
    overwrite=False,
):
    """Generate the workload into *dest* (a sys.path root); return its path.

    *modules* pure-Python modules with *functions* functions each are spread
    over *packages* subpackages nested up to *depth* deep; *extensions* C
    extensions call into *libraries* shared libraries in ``NAME.libs``;
    *data_files* files go to ``NAME/data``. *cc* is the C compiler (default:
    found on PATH). With *bytecode* the modules are byte-compiled. An existing
    workload of the same *name* is replaced only with *overwrite*. Raises
    :class:`GenerateError`.
    """
    _check_counts(
        modules=modules,
        packages=packages,
        depth=depth,
        extensions=extensions,
        libraries=libraries,
        data_files=data_files,
        functions=functions,
    )
    compiler = find_compiler(cc) if extensions else None
    root = Path(dest).absolute()
    _prepare(root, name, overwrite)
    pkg = root / name
    pkg.mkdir()
    paths = package_paths(packages, depth)
    _write_packages(pkg, name, paths)
    mod_names, mod_total = _write_modules(
        pkg, name, _spread(modules, paths or [()]), functions
    )
    ext_places = _spread(extensions, [(), *paths])
    if extensions:
        _build_native(compiler, name, root, ext_places, libraries, functions)
    ext_names = [
        _dotted(name, parts, f"_ext{i:03d}") for i, parts in enumerate(ext_places)
    ]
    ext_total = sum(extension_value(i, libraries) for i in range(extensions))
    data_names, data_total = _write_data(pkg, data_files)
    expected = (mod_total + ext_total + data_total) % 2**32
    (pkg / "driver.py").write_text(
        driver_source(name, mod_names, ext_names, data_names, expected)
    )
    if bytecode:
        compileall.compile_dir(str(pkg), quiet=2)
    _write_dist_info(root, name)
    return root


# -- command line --------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors become :class:`GenerateError`."""

    def error(self, message):
        raise GenerateError(message)


def _parser():
    parser = _Parser(
        prog="mpistage bench generate",
        description="Generate a Pynamic-like workload into DIR (a sys.path root).",
    )
    parser.add_argument("dest", metavar="DIR")
    add = parser.add_argument
    add("--modules", type=int, default=200, metavar="N", help="pure-Python modules")
    add("--packages", type=int, default=10, help="subpackages (default: 10)")
    add("--depth", type=int, default=3, help="subpackage nesting depth (default: 3)")
    add("--extensions", type=int, default=8, metavar="M", help="C extensions")
    add(
        "--libraries",
        type=int,
        default=2,
        metavar="K",
        help="shared libraries the extensions link against",
    )
    add("--data-files", type=int, default=4, metavar="D", help="data files")
    add("--functions", type=int, default=10, help="functions per module")
    add("--name", default="pynamic_ws", help="package name (default: pynamic_ws)")
    add("--cc", default=None, help="C compiler (default: $CC, cc, gcc or clang)")
    add(
        "--no-bytecode",
        dest="bytecode",
        action="store_false",
        help="do not byte-compile the modules",
    )
    add("--force", action="store_true", help="replace an existing workload")
    return parser


def _generate_action(args):
    start = time.monotonic()
    root = generate(
        args.dest,
        modules=args.modules,
        packages=args.packages,
        depth=args.depth,
        extensions=args.extensions,
        libraries=args.libraries,
        data_files=args.data_files,
        name=args.name,
        cc=args.cc,
        functions=args.functions,
        bytecode=args.bytecode,
        overwrite=args.force,
    )
    print(
        f"generated {args.name!r} in {str(root)!r}: {args.modules} modules, "
        f"{args.extensions} extensions, {args.libraries} libraries, "
        f"{args.data_files} data files ({time.monotonic() - start:.1f} s)"
    )
    print(
        f"  run: PYTHONPATH={shlex.quote(str(root))} {sys.executable} "
        f"-m {args.name}.driver"
    )
    return 0


def cli_generate(argv):
    """``mpistage bench generate DIR [--modules N] [--extensions M] ...``.

    Returns the exit status; user errors are one line on stderr, status 1.
    """
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else 0
        return _generate_action(args)
    except GenerateError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli_generate(sys.argv[1:]))
