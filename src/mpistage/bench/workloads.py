"""The workloads ``mpistage bench run`` starts: numpy, scipy, pandas, a
generated package, or any code. Each puts its files in the source tree that
the simulated shared file system mirrors, and gives the code every rank runs.
"""

import os as _os
import shutil as _shutil

from mpistage.bench.generate.spec import NAME


class Workload:
    """What to put on the shared file system and what each rank imports."""

    name = "?"
    packages = ()
    pack_args = ()
    code = "pass"

    def build(self, site):
        """Put the workload's files into the sys.path root *site*."""


class Numpy(Workload):
    """``import numpy, numpy.linalg``, from a copy of the installed numpy."""

    name = "numpy"
    packages = ("numpy",)
    pack_args = ("--exclude", "*/**/tests")
    code = "import numpy, numpy.linalg; numpy.linalg.inv(numpy.eye(4))"

    def build(self, site):
        """Copy numpy, its metadata and numpy.libs, as `pack` would take them."""
        from mpistage.bundle.pack import add_package
        from mpistage.bundle.writer import Selection

        roots = Selection(exclude=["*/**/tests"])
        add_package(roots, "numpy")
        copy_files(roots, site)


class Generated(Workload):
    """The Pynamic-like package from ``mpistage bench generate``."""

    name = "generated"
    package = NAME

    def __init__(self, **sizes):
        self.sizes = sizes
        self.packages = (self.package,)
        self.code = f"import {self.package}.driver as d; d.main()"

    def build(self, site):
        """Generate the package into *site*."""
        from mpistage.bench.generate import generate

        generate(site, name=self.package, **self.sizes)


class Code(Workload):
    """Any code, with the named installed packages copied to the shared FS."""

    def __init__(self, code, packages, name="code"):
        self.code, self.packages, self.name = code, tuple(packages), name

    def build(self, site):
        """Copy each named package as `pack` would take it."""
        from mpistage.bundle.pack import add_package
        from mpistage.bundle.writer import Selection

        roots = Selection()
        for name in self.packages:
            add_package(roots, name)
        copy_files(roots, site)


def copy_files(roots, dest):
    """Copy the files chosen in *roots* below *dest*, keeping relative paths."""
    for root in roots.paths:
        for path in sorted(roots.taken(root)):
            target = _os.path.join(dest, _os.path.relpath(path, root))
            if _os.path.islink(path):
                _os.symlink(_os.readlink(path), target)
            elif _os.path.isdir(path):
                _os.makedirs(target, exist_ok=True)
            else:
                _os.makedirs(_os.path.dirname(target), exist_ok=True)
                _shutil.copy2(path, target)


# Installed packages every rank imports and uses: (code, packages to copy).
INSTALLED = {
    "scipy": (
        "import scipy.linalg; scipy.linalg.solve([[2.0, 0.0], [0.0, 4.0]], [1.0, 1.0])",
        ("numpy", "scipy"),
    ),
    "pandas": (
        "import pandas; pandas.DataFrame({'k': [1, 1, 2]}).groupby('k').size()",
        ("numpy", "pandas", "dateutil"),
    ),
}


def make(name, code=None, packages=(), sizes=None):
    """Return the workload *name*: numpy, scipy, pandas, generated, code."""
    from mpistage import StageError

    if name == "numpy":
        return Numpy()
    if name in INSTALLED:
        return Code(*INSTALLED[name], name=name)
    if name == "generated":
        return Generated(**(sizes or {}))
    if name == "code" and code:
        return Code(code, packages)
    raise StageError(
        f"unknown workload {name!r}: use numpy, scipy, pandas, generated or --code"
    )
