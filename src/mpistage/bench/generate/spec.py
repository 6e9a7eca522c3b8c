"""What a generated workload is: its sizes, their defaults, its version, its error."""

from mpistage import StageError

VERSION = "1.0"
NAME = "pynamic_ws"
SIZES = {
    "modules": 200,  # pure-Python modules
    "packages": 10,  # subpackages they are spread over
    "depth": 3,  # how deep the subpackages nest
    "extensions": 8,  # C extensions
    "libraries": 2,  # shared libraries the extensions link against
    "data_files": 4,  # files read through importlib.resources
    "functions": 10,  # functions per module (and per library)
}


class GenerateError(StageError):
    """A user-facing generator error: printed as one line, no traceback."""


def check_name(name):
    """Refuse a package name that is not a Python identifier."""
    import keyword

    if not name.isidentifier() or keyword.iskeyword(name):
        raise GenerateError(f"invalid name: {name!r} (must be a Python identifier)")


def check_sizes(sizes):
    """Refuse a size that is not a whole number >= 0."""
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 0:
            raise GenerateError(f"{key} must be a non-negative integer, not {value!r}")
