"""The text of every generated file, and the value each one returns.

A module's ``entry()``, an extension's ``entry()`` and a data file's CRC add
up to the checksum the driver must reproduce; the generator computes the
same sum here, without importing anything it wrote. The small numbers inside
the sources (7, 13, 101, ...) only make each module's values differ: any
would do.
"""

MODULUS = 1000003  # a prime: the generated functions mix values below it
CHECKSUM_MODULUS = 2**32  # the driver's checksum is a 32-bit sum
DATA_LINES = 200  # lines of data file 0; file N has N more
EXTENSION_SEED = 1000  # extension N mixes EXTENSION_SEED + 17 * N


def extension_name(index):
    """Return the module name of extension *index*: ``_extNNN``."""
    return f"_ext{index:03d}"


def library_name(name, k):
    """Return the name of utility library *k* (``libNAME.so`` without the affixes)."""
    return f"{name}_util{k}"


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
        f"long {library_name(name, k)}_f{j}(long x) "
        f"{{ return (x * {j + 2} + {k}) % {MODULUS}; }}"
        for j in range(functions)
    )
    return f"""\
/* Generated utility library {k} of workload {name}. */
long {library_name(name, k)}_mix(long x) {{ return (x * {mul} + {add}) % {MODULUS}; }}
{extra}
"""


def _extension_seed(index):
    return EXTENSION_SEED + 17 * index


def extension_value(index, libraries):
    """The value ``entry()`` of extension *index* returns."""
    if not libraries:
        return (_extension_seed(index) * 5 + 1) % MODULUS
    mul, add = _library_params(index % libraries)
    return (_extension_seed(index) * mul + add) % MODULUS


def extension_source(name, index, libraries):
    """C source of extension *index* (``_extNNN``), calling its library."""
    module = extension_name(index)
    if libraries:
        func = f"{library_name(name, index % libraries)}_mix"
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
        f"{index} {j} {(index * 131 + j * 71) % 10007}"
        for j in range(DATA_LINES + index)
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
CHECKSUM_MODULUS = {CHECKSUM_MODULUS}


def main():
    """Import every module and extension, read every data file; summarize."""
    checksum = 0
    for dotted in MODULES + EXTENSIONS:
        value = importlib.import_module(dotted).entry()
        checksum = (checksum + value) % CHECKSUM_MODULUS
    data = resources.files(PACKAGE).joinpath("data")
    for filename in DATA_FILES:
        crc = zlib.crc32(data.joinpath(filename).read_bytes())
        checksum = (checksum + crc) % CHECKSUM_MODULUS
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
