"""Tests of the Pynamic-like workload generator."""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

from mpistage.bench.generate import GenerateError, cli_generate, find_compiler, generate
from mpistage.bench.generate.native import rpath_for
from mpistage.bench.generate.tree import package_paths


def _compiler_reason():
    try:
        find_compiler()
    except GenerateError as exc:
        return str(exc)
    return None


CC_REASON = _compiler_reason()
requires_cc = pytest.mark.skipif(CC_REASON is not None, reason=str(CC_REASON))
NAME = "ws_test"
SMALL = dict(
    modules=12, packages=3, depth=2, extensions=2, libraries=1, data_files=2, name=NAME
)


def run_driver(root, name=NAME):
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", f"{name}.driver"],
        env=env,
        capture_output=True,
        text=True,
        cwd="/",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def dynamic_tags(path):
    with open(path, "rb") as f:
        elf = ELFFile(f)
        tags = {}
        for section in elf.iter_sections():
            if isinstance(section, DynamicSection):
                for tag in section.iter_tags():
                    if tag.entry.d_tag == "DT_NEEDED":
                        tags.setdefault("needed", []).append(tag.needed)
                    elif tag.entry.d_tag == "DT_RUNPATH":
                        tags["path"] = tag.runpath
                    elif tag.entry.d_tag == "DT_RPATH":
                        tags["path"] = tag.rpath
        return tags


def extensions(root):
    return sorted(root.rglob("_ext*" + sysconfig.get_config_var("EXT_SUFFIX")))


@pytest.fixture
def small(tmp_path):
    if CC_REASON:
        pytest.skip(CC_REASON)
    return generate(tmp_path / "site", **SMALL)


@requires_cc
def test_driver_summary(small):
    summary = run_driver(small)
    assert summary["ok"] is True
    assert summary["checksum"] == summary["expected_checksum"]
    assert (summary["modules"], summary["extensions"], summary["data_files"]) == (
        12,
        2,
        2,
    )


@requires_cc
def test_layout(small):
    pkg = small / NAME
    assert len(list(pkg.rglob("mod*.py"))) == 12
    assert (pkg / "sub00" / "sub01" / "__init__.py").exists()
    assert (pkg / "sub02" / "__init__.py").exists()
    data_files = sorted(p.name for p in (pkg / "data").iterdir())
    assert data_files == ["data0.txt", "data1.txt"]
    assert [p.name for p in (small / f"{NAME}.libs").iterdir()] == [
        f"lib{NAME}_util0.so"
    ]
    assert list(pkg.rglob("*.pyc")), "modules are byte-compiled"
    assert len(extensions(small)) == 2


@requires_cc
def test_extensions_link_through_origin(small):
    libs = small / f"{NAME}.libs"
    for ext in extensions(small):
        tags = dynamic_tags(ext)
        assert f"lib{NAME}_util0.so" in tags["needed"]
        assert tags["path"].startswith("$ORIGIN/")
        resolved = tags["path"].replace("$ORIGIN", str(ext.parent))
        assert Path(os.path.normpath(resolved)) == libs


@requires_cc
def test_moved_tree_still_imports(small, tmp_path):
    moved = tmp_path / "elsewhere" / "deeper" / "site"
    moved.parent.mkdir(parents=True)
    shutil.move(small, moved)
    assert not small.exists()
    summary = run_driver(moved)
    assert summary["ok"] is True and summary["extensions"] == 2


@requires_cc
def test_dist_info_record(small):
    info = small / f"{NAME}-1.0.dist-info"
    assert (info / "top_level.txt").read_text() == f"{NAME}\n"
    assert f"Name: {NAME}\n" in (info / "METADATA").read_text()
    rows = [line.split(",") for line in (info / "RECORD").read_text().splitlines()]
    paths = {row[0] for row in rows}
    assert f"{NAME}.libs/lib{NAME}_util0.so" in paths
    assert f"{NAME}/driver.py" in paths
    assert f"{NAME}-1.0.dist-info/RECORD" in paths
    files = {p.relative_to(small).as_posix() for p in small.rglob("*") if p.is_file()}
    assert paths == files
    for path, digest, size in rows:
        if digest:
            data = (small / path).read_bytes()
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            assert digest == "sha256=" + expected.rstrip(b"=").decode()
            assert int(size) == len(data)


@requires_cc
def test_default_size_builds_quickly(tmp_path):
    start = time.monotonic()
    root = generate(tmp_path / "site")
    assert time.monotonic() - start < 60
    summary = run_driver(root, "pynamic_ws")
    assert summary["ok"] is True
    assert (summary["modules"], summary["extensions"], summary["data_files"]) == (
        200,
        8,
        4,
    )


def test_pure_python_needs_no_compiler(tmp_path):
    root = generate(
        tmp_path / "site",
        modules=5,
        packages=0,
        extensions=0,
        libraries=0,
        data_files=0,
        name="pure",
        cc="/nonexistent/cc",
    )
    summary = run_driver(root, "pure")
    assert summary["ok"] is True and summary["modules"] == 5
    assert summary["extensions"] == 0 and summary["data_files"] == 0


@requires_cc
def test_extensions_without_libraries(tmp_path):
    root = generate(
        tmp_path / "site",
        modules=2,
        packages=1,
        extensions=2,
        libraries=0,
        data_files=1,
        name="nolibs",
    )
    assert run_driver(root, "nolibs")["ok"] is True
    assert "path" not in dynamic_tags(extensions(root)[0])


def test_missing_compiler_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(GenerateError, match="C compiler not found: 'no-such-cc'"):
        generate(tmp_path / "site", extensions=1, cc="no-such-cc")
    assert cli_generate([str(tmp_path / "x"), "--cc", "no-such-cc"]) == 1
    assert capsys.readouterr().err == (
        "mpistage: error: C compiler not found: 'no-such-cc'\n"
    )


def test_existing_workload_needs_force(tmp_path, capsys):
    options = dict(modules=1, packages=0, extensions=0, data_files=0, name="again")
    generate(tmp_path, **options)
    with pytest.raises(GenerateError, match="already exists"):
        generate(tmp_path, **options)
    generate(tmp_path, overwrite=True, **options)
    argv = [str(tmp_path), "--modules", "1", "--extensions", "0", "--name", "again"]
    assert cli_generate(argv) == 1
    assert "already exists (remove it or use --force)" in capsys.readouterr().err
    assert cli_generate([*argv, "--force"]) == 0
    assert "-m again.driver" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--name", "not-valid"], "invalid name: 'not-valid'"),
        (["--modules", "-1"], "modules must be a non-negative integer"),
        (["--modules", "many"], "argument --modules: invalid int value: 'many'"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    assert cli_generate([str(tmp_path), "--extensions", "0", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mpistage: error: ") and message in err
    assert err.count("\n") == 1


def test_package_paths_nest_up_to_depth():
    assert package_paths(5, 2) == [
        ("sub00",),
        ("sub00", "sub01"),
        ("sub02",),
        ("sub02", "sub03"),
        ("sub04",),
    ]
    assert package_paths(2, 0) == [("sub00",), ("sub01",)]
    assert rpath_for("ws", ("a", "b")) == "$ORIGIN/../../../ws.libs"
