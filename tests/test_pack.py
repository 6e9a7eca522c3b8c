"""``mpistage pack`` and ``mpistage inspect``."""

import json
import os
import py_compile
import re
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from mpistage import StageError
from mpistage.runtime import bundlefile
from mpistage.runtime.read import read_manifest
from stagetools import clean_environ, mpistage, pack, sha256


def files_of(manifest, prefix=""):
    return {
        m["rel"]: m
        for m in manifest["members"]
        if m["type"] == "file" and m["rel"].startswith(prefix)
    }


def held_roots(manifest):
    """The roots the bundle holds members of (the others are listings only)."""
    held = {m["root"] for m in manifest["members"]}
    return [r["path"] for i, r in enumerate(manifest["roots"]) if i in held]


def test_numpy_bundle_contents(numpy_bundle):
    import numpy

    manifest = read_manifest(numpy_bundle)
    site = Path(numpy.__file__).parent.parent
    assert held_roots(manifest) == [str(site)]
    assert manifest["packages"] == ["numpy"]
    assert manifest["python"] == bundlefile.python_tag()

    rels = {m["rel"] for m in manifest["members"]}
    dist = metadata.distribution("numpy")
    info = f"numpy-{dist.version}.dist-info"
    metadata_files = {
        str(p.relative_to(site)) for p in (site / info).rglob("*") if p.is_file()
    }
    assert {f"{info}/METADATA", f"{info}/RECORD"} <= metadata_files <= rels
    # auditwheel's numpy.libs, which the extensions reach through $ORIGIN
    libs = sorted(os.listdir(site / "numpy.libs"))
    assert libs, "this numpy wheel has no numpy.libs"
    assert {f"numpy.libs/{name}" for name in libs} <= rels

    # every file of the package but its tests, byte for byte
    originals = [p for p in (site / "numpy").rglob("*") if p.is_file()]
    kept = [p for p in originals if "tests" not in p.relative_to(site).parts]
    bundled = files_of(manifest, "numpy/")
    assert len(bundled) == len(kept) < len(originals)
    umath = next(iter((site / "numpy" / "_core").glob("_multiarray_umath*.so")))
    member = bundled[str(umath.relative_to(site))]
    assert member["size"] == umath.stat().st_size
    assert member["sha256"] == sha256(umath)

    # nothing of other distributions in the same site-packages
    tops = {rel.split("/")[0] for rel in rels}
    assert all(re.match(r"numpy([-.]|$)", top) for top in tops), tops


def test_inspect_summarizes(numpy_bundle):
    result = mpistage(["inspect", numpy_bundle], env=clean_environ())
    assert result.returncode == 0, result
    manifest = read_manifest(numpy_bundle)
    files = [m for m in manifest["members"] if m["type"] == "file"]
    lines = result.stdout.splitlines()

    assert lines[0] == f"bundle: {numpy_bundle}"
    py = bundlefile.python_tag()
    assert (
        f"python: {py['implementation']} {py['version']} ({py['ext_suffix']})" in lines
    )
    assert "packages: numpy" in lines
    root = manifest["roots"][0]["path"]
    assert lines[lines.index("roots:") + 1] == f"  r0 {root}"
    assert f"files: {len(files)}, bytes: {sum(m['size'] for m in files)}" in lines

    largest = lines[lines.index("largest:") + 1 :]
    assert len(largest) == 10
    sizes = [int(line.split()[0]) for line in largest]
    assert sizes == sorted((m["size"] for m in files), reverse=True)[:10]
    biggest = max(files, key=lambda m: m["size"])
    assert largest[0].split()[1] == os.path.join(root, biggest["rel"])


def test_inspect_json_is_the_manifest(tiny):
    result = mpistage(["inspect", "--json", tiny["bundle"]], env=clean_environ())
    assert result.returncode == 0, result
    assert json.loads(result.stdout) == read_manifest(tiny["bundle"])


@pytest.mark.parametrize(
    "content,cause",
    [
        (None, "No such file or directory"),
        (b"PK\x03\x04" + bytes(100), "not an mpistage bundle"),
        (b"MPISTAGE", "truncated"),
    ],
)
def test_inspect_bad_input(tmp_path, content, cause):
    path = tmp_path / "x.mpistage"
    if content is not None:
        path.write_bytes(content)
    result = mpistage(["inspect", path], env=clean_environ())
    assert result.returncode == 1, result
    assert result.stderr.splitlines() == [result.errors()[0]]
    assert cause in result.errors()[0]


def test_pack_directory_and_symlink(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "pkg" / "__init__.py").write_text("X = 1\n")
    (lib / "pkg" / "data.txt").write_bytes(b"\x00\x01" * 100)
    (lib / "alias.py").symlink_to("pkg/__init__.py")
    out = pack(tmp_path / "lib.mpistage", "--path", lib, cwd=tmp_path)
    manifest = read_manifest(out)
    assert held_roots(manifest) == [str(lib)]
    assert manifest["roots"][0]["listing"] == ["alias.py", "pkg/"]
    members = {m["rel"]: m for m in manifest["members"]}
    assert members["alias.py"]["type"] == "link"
    assert members["alias.py"]["target"] == "pkg/__init__.py"
    assert members["pkg"]["type"] == "dir"
    data = out.read_bytes()
    m = members["pkg/data.txt"]
    assert data[m["offset"] : m["offset"] + m["size"]] == b"\x00\x01" * 100


def test_links_out_of_their_root_are_left_to_the_originals(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg" / "bin").mkdir(parents=True)
    (lib / "pkg" / "__init__.py").write_text("X = 1\n")
    (lib / "pkg" / "bin" / "python3").symlink_to("/usr/bin/env")  # absolute
    (lib / "pkg" / "bin" / "python").symlink_to("python3")  # through it
    (lib / "pkg" / "up").symlink_to("../../elsewhere")  # climbs out
    (lib / "pkg" / "alias.py").symlink_to("__init__.py")  # stays inside
    out = pack(tmp_path / "lib.mpistage", "--path", lib, cwd=tmp_path)
    manifest = read_manifest(out)  # the reader's checks accept it
    members = {m["rel"]: m for m in manifest["members"]}
    assert members["pkg/alias.py"]["type"] == "link"
    for rel in ("pkg/bin/python3", "pkg/bin/python", "pkg/up"):
        assert rel not in members
    assert members["pkg/bin"]["partial"]  # the names left out go to the original


def test_single_module_takes_only_its_own_pyc(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    for name in ("mod_a", "mod_b"):
        source = site / f"{name}.py"
        source.write_text(f"NAME = {name!r}\n")
        py_compile.compile(str(source), cfile=_cached(source))
    env = clean_environ()
    env["PYTHONPATH"] = str(site)
    out = pack(tmp_path / "a.mpistage", "mod_a", env=env)
    files = set(files_of(read_manifest(out)))
    assert files == {"mod_a.py", os.path.relpath(_cached(site / "mod_a.py"), site)}


def _cached(source):
    from importlib.util import cache_from_source

    return cache_from_source(str(source))


def listing(folder):
    return sorted(p.name for p in Path(folder).iterdir())


@pytest.mark.parametrize(
    "args,cause",
    [
        (["no_such_package_zz"], "no importable package or module named"),
        (["os.path"], "is not a top-level module name"),
        (["--path", "missing-dir"], "is not a directory"),
        ([], "nothing to pack"),
    ],
)
def test_pack_errors_leave_nothing(tmp_path, args, cause):
    before = listing(tmp_path)
    result = mpistage(
        ["pack", "-o", "out.mpistage", *args], env=clean_environ(), cwd=tmp_path
    )
    assert result.returncode == 1, result
    assert result.stderr.splitlines() == result.errors(), result
    assert len(result.errors()) == 1 and cause in result.errors()[0]
    assert listing(tmp_path) == before  # no output, no temporary file


def test_pack_refuses_other_suffix(tmp_path):
    result = mpistage(
        ["pack", "-o", "out.zip", "json"], env=clean_environ(), cwd=tmp_path
    )
    assert result.returncode == 1, result
    assert result.errors() == [
        "mpistage: error: bundle name 'out.zip' must end in '.mpistage'"
    ]
    assert listing(tmp_path) == []


def test_pack_into_missing_directory(tmp_path):
    out = tmp_path / "nowhere" / "out.mpistage"
    result = mpistage(["pack", "-o", out, "json"], env=clean_environ())
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    assert result.errors() == [
        f"mpistage: error: cannot write bundle {str(out)!r}: No such file or directory"
    ]


def test_failed_pack_keeps_the_old_bundle(tmp_path, tiny):
    out = tmp_path / "app.mpistage"
    out.write_bytes(tiny["bundle"].read_bytes())
    result = mpistage(["pack", "-o", out, "no_such_package_zz"], env=clean_environ())
    assert result.returncode == 1
    assert out.read_bytes() == tiny["bundle"].read_bytes()
    assert listing(tmp_path) == ["app.mpistage"]


def test_write_is_atomic_when_interrupted(tmp_path, tiny, monkeypatch):
    import mpistage
    from mpistage.bundle import writer

    out = tmp_path / "app.mpistage"
    out.write_bytes(b"old contents")
    calls = []

    def failing_add(self, root, rel, path, *args):
        calls.append(rel)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original_add(self, root, rel, path, *args)

    original_add = writer.Writer.add
    monkeypatch.setattr(writer.Writer, "add", failing_add)
    monkeypatch.syspath_prepend(str(tiny["site"]))
    with pytest.raises(KeyboardInterrupt):
        mpistage.pack(str(out), ["tinypkg"])
    assert len(calls) == 3
    assert out.read_bytes() == b"old contents"
    assert listing(tmp_path) == ["app.mpistage"]


def test_pack_api_rejects_bad_names():
    import mpistage

    with pytest.raises(StageError, match="not a top-level module name"):
        mpistage.pack("x.mpistage", ["a-b"])


def test_bundle_python_tag_matches_this_python():
    tag = bundlefile.python_tag()
    assert tag["ext_suffix"] == sysconfig.get_config_var("EXT_SUFFIX")
    assert bundlefile.python_mismatch({"python": tag}) is None
    other = dict(tag, version="2.7")
    assert "built for Python '2.7'" in bundlefile.python_mismatch({"python": other})


def test_pack_path_dot_leaves_bundles_out(tmp_path, stage_env):
    from stagetools import mpirun, results, write_target

    project = tmp_path / "project"
    project.mkdir()
    (project / "helper.py").write_text("H = 'helped'\n")
    script = write_target(project / "main.py", "import helper\nemit(helper.H)\n")
    (project / "other.mpistage").write_bytes(b"another bundle, not a module")
    out = project / "app.mpistage"
    for _ in range(2):  # the second pack finds the first bundle in "."
        pack(out, "--path", ".", cwd=project)
    rels = {m["rel"] for m in read_manifest(out)["members"]}
    assert "helper.py" in rels and "main.py" in rels, rels
    assert not [r for r in rels if ".mpistage" in r], rels
    env = dict(stage_env, MPISTAGE_EMULATE_NODES="2")
    result = mpirun(2, ["-m", "mpistage", "--bundle", out, script], env, cwd=project)
    assert result.returncode == 0, result  # not stale
    assert results(env, 2) == ["helped", "helped"]


# -- exclusions match path components ------------------------------------------------

GLOBS = [
    # (pattern, path below the root, left out?)
    ("lib/python3.*/test", "lib/python3.11/test", True),
    ("lib/python3.*/test", "lib/python3.11/test/test_os.py", True),
    ("lib/python3.*/test", "lib/python3.11/site-packages/tf/_api/test", False),
    ("lib/python3.*/test", "lib/python3.11/site-packages/tf/_api/test/x.py", False),
    ("lib/python3.*/config-*", "lib/python3.11/config-3.11-x86_64/Makefile", True),
    ("lib/python3.*/config-*", "lib/python3.11/site-packages/a/config-x/m.py", False),
    ("*/**/tests", "numpy/tests/test_a.py", True),
    ("*/**/tests", "numpy/_core/tests/test_a.py", True),
    ("*/**/tests", "tests/test_a.py", False),
    ("**/__pycache__/*.opt-1.pyc", "__pycache__/os.cpython-311.opt-1.pyc", True),
    ("**/__pycache__/*.opt-1.pyc", "email/mime/__pycache__/t.opt-1.pyc", True),
    ("*.so", "pkg/sub/_ext.so", True),
    ("*.so", "pkg/sub/_ext.so.py", False),
    ("/test", "test/x.py", True),
    ("/test", "pkg/test/x.py", False),
    ("pkg/*", "pkg/sub/x.py", True),
    ("pkg/*", "other/pkg/x.py", False),
]


@pytest.mark.parametrize(("pattern", "rel", "out"), GLOBS)
def test_exclusions_match_path_components(pattern, rel, out):
    from mpistage.bundle.writer import Selection

    assert Selection(exclude=[pattern]).excluded(rel) == out


def test_pack_env_keeps_packages_named_test(tmp_path):
    """``pack --env`` leaves out the standard library's ``test``, no package's."""
    from mpistage.bundle.envpack import DEFAULT_EXCLUDE
    from mpistage.bundle.writer import Selection

    version = "python{}.{}".format(*sysconfig.get_python_version().split("."))
    lib = tmp_path / "prefix" / "lib" / version
    site = lib / "site-packages"
    api = site / "tfish" / "_api" / "v2" / "__internal__" / "test"
    for d in (lib / "test", lib / "config-x", api, site / "c" / "config-y"):
        d.mkdir(parents=True)
        (d / "m.py").write_text("")
    prefix = tmp_path / "prefix"
    selection = Selection(exclude=DEFAULT_EXCLUDE)
    selection.take(prefix, str(prefix))
    rels = {m.rel for _, _, m in selection.records()}
    stdlib = f"lib/{version}"
    assert f"{stdlib}/site-packages/tfish/_api/v2/__internal__/test/m.py" in rels
    assert f"{stdlib}/site-packages/c/config-y/m.py" in rels
    assert f"{stdlib}/test/m.py" not in rels and f"{stdlib}/config-x/m.py" not in rels
