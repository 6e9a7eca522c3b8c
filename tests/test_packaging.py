"""What a user installing mpistage gets: the sdist, its metadata, the license.

The sdist is built for real (``python -m build --sdist``); the test is
skipped, with one line, only when the build backend cannot be had (no
network and no cached setuptools).
"""

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_is_an_spdx_string_with_its_file():
    meta = project()
    assert isinstance(meta["license"], str), "a TOML table is deprecated"
    assert meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "BSD 3-Clause" in text and "mpistage developers" in text


def test_metadata_names_authors_and_classifiers():
    meta = project()
    assert meta["authors"] == [{"name": "mpistage developers"}]
    versions = {c for c in meta["classifiers"] if c.startswith("Programming")}
    supported = ("3.10", "3.11", "3.12", "3.13")
    assert {f"Programming Language :: Python :: {v}" for v in supported} <= versions


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("sdist")
    cmd = [sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "Could not find a version" in proc.stdout + proc.stderr:
        pytest.skip("no setuptools for the isolated build (offline, nothing cached)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("mpistage-*.tar.gz")
    return path, proc.stdout + proc.stderr


def test_sdist_holds_the_docs_the_readme_links_to(sdist):
    path, _ = sdist
    with tarfile.open(path) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    linked = {"docs/usage.md", "docs/api.md", "docs/stage.md", "docs/data.md"}
    assert linked <= names
    assert {"LICENSE", "CONTRIBUTING.md", "docs/examples/slurm.sh"} <= names


def test_sdist_builds_without_a_license_warning(sdist):
    path, output = sdist
    assert "license" not in output.lower() or "deprecated" not in output.lower()
    with tarfile.open(path) as tar:
        top = [m for m in tar.getmembers() if m.name.count("/") == 1]
        (info,) = [m for m in top if m.name.endswith("/PKG-INFO")]
        pkg_info = tar.extractfile(info).read().decode()
    assert "License-Expression: BSD-3-Clause" in pkg_info
    assert "Author: mpistage developers" in pkg_info
