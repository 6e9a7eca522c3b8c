"""What ``pack --env`` puts in an environment bundle for ``mpistage-env``.

``mpistage-env`` extracts a bundle on each node with the node's own
Python, which must not read mpistage from the shared file system. So the
bundle carries the code that unpacks it: the manifest's ``launch`` field
holds the sources of the modules :mod:`mpistage.runtime.envlaunch` needs,
as JSON ``{dotted name: [source, is a package]}``, compressed with zlib
and in base64. Before any of it runs, ``bin/mpistage-env``'s boot code
checks the manifest against the header's SHA-256, then the code itself
against the SHA-256 the script carries (``LAUNCH_SHA256``, the
:func:`launch_digest` of the sources it was installed with): a bundle
runs only the unpacking code of the mpistage-env that reads it, never
code another user put in it.
"""

import os as _os

FORMAT = 1  # of the ``launch`` field


def modules():
    """The modules the node's extraction imports, as paths below the package."""
    from mpistage.runtime.stager import NODE_MODULES

    return (*NODE_MODULES, "runtime/envlaunch")


def launch_field():
    """Return the manifest's ``launch`` field: the extraction's own code."""
    import base64
    import zlib

    packed = zlib.compress(launch_code(), 9)
    return {"format": FORMAT, "modules": base64.b64encode(packed).decode("ascii")}


def launch_code():
    """The extraction's sources, as the JSON bytes the ``launch`` field packs."""
    import json

    import mpistage

    package = _os.path.dirname(_os.path.abspath(mpistage.__file__))
    sources = {}
    for name in modules():
        with open(_os.path.join(package, f"{name}.py"), encoding="utf-8") as f:
            sources[dotted(name)] = [f.read(), name.endswith("__init__")]
    return json.dumps(sources, sort_keys=True).encode()


def launch_digest():
    """The SHA-256 of :func:`launch_code`: the script's ``LAUNCH_SHA256``."""
    import hashlib

    return hashlib.sha256(launch_code()).hexdigest()


def dotted(name):
    """Return the module name of the package path *name* (``runtime/read``)."""
    parts = ["mpistage", *name.split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
