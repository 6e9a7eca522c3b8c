"""The ELF dependency closure (``mpistage.elfdeps``) that ``pack --env`` uses.

Checked on real binaries (mpi4py's MPI extension and the MPICH wheel's
libmpi, the base interpreter and libpython, a generated auditwheel-style
extension) and, for the search order and ``$ORIGIN``, against what the
dynamic loader itself does with small programs built here.
"""

import fnmatch
import os
import shutil
from pathlib import Path

import pytest

from envtools import small_venv
from mpistage.bundle import elfdeps
from stagetools import PYTHON, clean_environ, run

GLIBC = ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    return small_venv(tmp_path_factory)


def mpi_extension(venv):
    """Return mpi4py's MPI extension module that links the MPICH libmpi."""
    for path in sorted((venv.site / "mpi4py").glob("MPI*.so")):
        if "libmpi.so.12" in elfdeps.dynamic(path)[0]:
            return path
    pytest.skip("no mpi4py MPI extension linked against libmpi.so.12")


def compiler():
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc) found")
    return cc


def build(*args):
    done = run(args, timeout=60)
    assert done.returncode == 0, done


def test_mpi_extension_finds_the_wheels_libmpi(venv):
    ext = mpi_extension(venv)
    lib = venv.prefix / "lib"
    found, missing = elfdeps.closure([ext], library_path=str(lib))
    assert found["libmpi.so.12"] == str(lib / "libmpi.so.12")
    # Followed in turn: libmpi's RUNPATH $ORIGIN/mpich.
    needed, _rpath, runpath = elfdeps.dynamic(lib / "libmpi.so.12")
    assert "$ORIGIN/mpich" in runpath
    for name in needed:
        if name.startswith(("libfabric", "libucp", "libucs")):
            assert found[name] == str(lib / "mpich" / name)
    # glibc and the loader are needed, but never reported.
    assert {"libc.so.6", "libm.so.6", "libpthread.so.0"} <= set(needed)
    for name in [*found, *missing]:
        assert not name.startswith(("libc.so", "libm.so", "ld-linux", "libpthread"))
        assert not elfdeps.Closure().excluded(name), name

    # Nothing points the extension at V/lib but the library path given.
    found, missing = elfdeps.closure([ext], library_path="")
    if "libmpi.so.12" not in elfdeps.ld_cache():
        assert "libmpi.so.12" in missing
        assert "libmpi.so.12" not in found


def test_base_python_finds_its_libpython(venv):
    python = venv.base_python.resolve()
    needed, rpath, runpath = elfdeps.dynamic(python)
    libpython = next((n for n in needed if n.startswith("libpython")), None)
    if libpython is None:
        pytest.skip(f"{python} is linked statically (no libpython)")
    assert "libc.so.6" in needed  # so leaving it out below is the exclusion
    found, missing = elfdeps.closure([python], library_path="")
    # Found by the RUNPATH, not a system libpython of the same soname.
    assert found[libpython] == str(venv.base / "lib" / libpython)
    assert Path(found[libpython]).is_file()
    for name in GLIBC:
        assert name not in found and name not in missing
    assert not any(name.startswith("ld-linux") for name in [*found, *missing])


def test_an_extra_exclude_pattern_is_respected(venv):
    python = venv.base_python.resolve()
    everything, _ = elfdeps.closure([python], library_path="")
    if not any(name.startswith("libpython") for name in everything):
        pytest.skip(f"{python} is linked statically (no libpython)")
    found, missing = elfdeps.closure([python], ["libpython*"], library_path="")
    assert not [n for n in [*found, *missing] if fnmatch.fnmatch(n, "libpython*")]
    # Only what libpython alone pulled in disappears with it.
    assert set(found) <= set(everything)


def test_default_exclude_covers_glibc_and_the_loader():
    closure = elfdeps.Closure()
    for name in (*GLIBC, "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"):
        assert closure.excluded(name), name
    for name in ("libmpi.so.12", "libpython3.11.so.1.0", "libcrypto.so.3"):
        assert not closure.excluded(name), name
    assert elfdeps.Closure(["libcrypto*"]).excluded("libcrypto.so.3")


def test_generated_extensions_find_their_library_via_origin(tmp_path):
    compiler()
    dest = tmp_path / "site"
    made = run(
        [
            PYTHON,
            "-m",
            "mpistage",
            "bench",
            "generate",
            dest,
            "--modules=5",
            "--extensions=2",
            "--libraries=1",
            "--data-files=0",
            "--name=elfws",
        ],
        env=clean_environ(),
        timeout=120,
    )
    if made.returncode != 0 and "Python.h" in made.stderr:
        pytest.skip(made.stderr.strip())
    assert made.returncode == 0, made
    exts = sorted((dest / "elfws").rglob("_ext*.so"))
    assert len(exts) == 2
    assert len({ext.parent for ext in exts}) == 2  # at two depths
    library = dest / "elfws.libs" / "libelfws_util0.so"
    for ext in exts:
        _needed, _rpath, runpath = elfdeps.dynamic(ext)
        assert runpath and runpath[0].startswith("$ORIGIN/")
        found, missing = elfdeps.closure([ext], library_path="")
        assert found == {"libelfws_util0.so": str(library)}, ext
        assert missing == []


def test_missing_libraries_are_reported(tmp_path):
    cc = compiler()
    (tmp_path / "gone.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "main.c").write_text(
        "int gone(void);\nint main(void) { return gone(); }\n"
    )
    build(cc, "-shared", "-fPIC", "-o", tmp_path / "libgone.so", tmp_path / "gone.c")
    build(cc, "-o", tmp_path / "prog", tmp_path / "main.c", f"-L{tmp_path}", "-lgone")
    (tmp_path / "libgone.so").unlink()
    found, missing = elfdeps.closure([tmp_path / "prog"], library_path="")
    assert missing == ["libgone.so"]
    assert found == {}


WHO_C = 'const char *who(void) {{ return "{}"; }}\n'
MAIN_C = (
    "#include <stdio.h>\nconst char *{0}(void);\nint main(void) {{ puts({0}()); }}\n"
)
MID_C = "const char *who(void);\nconst char *mid(void) { return who(); }\n"


@pytest.fixture(scope="module")
def prio(tmp_path_factory):
    """``libwho.so`` in dirs A and B saying which it is, and programs using it.

    ``runpath`` and ``rpath`` look in A through DT_RUNPATH and DT_RPATH.
    """
    cc = compiler()
    base = tmp_path_factory.mktemp("prio")
    for which in ("A", "B"):
        (base / which).mkdir()
        (base / f"{which}.c").write_text(WHO_C.format(which))
        lib = base / which / "libwho.so"
        build(
            cc,
            "-shared",
            "-fPIC",
            "-o",
            lib,
            base / f"{which}.c",
            "-Wl,-soname,libwho.so",
        )
    (base / "main.c").write_text(MAIN_C.format("who"))
    for name, tags in (
        ("runpath", "--enable-new-dtags"),
        ("rpath", "--disable-new-dtags"),
    ):
        build(
            cc,
            "-o",
            base / name,
            base / "main.c",
            f"-L{base / 'A'}",
            "-lwho",
            f"-Wl,{tags},-rpath,{base / 'A'}",
        )
    return base


def loaded(program, library_path):
    """Run *program*; return which ``libwho.so`` the real loader picked."""
    env = clean_environ()
    env["LD_LIBRARY_PATH"] = library_path
    done = run([program], env=env, timeout=30)
    assert done.returncode == 0, done
    return done.stdout.strip()


@pytest.mark.parametrize(
    "program,library_path,expected",
    [
        ("runpath", "", "A"),
        ("runpath", "B", "B"),  # LD_LIBRARY_PATH comes before DT_RUNPATH
        ("rpath", "", "A"),
        ("rpath", "B", "A"),  # DT_RPATH comes before LD_LIBRARY_PATH
    ],
)
def test_search_order_is_the_loaders(prio, program, library_path, expected):
    binary = prio / program
    _needed, rpath, runpath = elfdeps.dynamic(binary)
    tags = {"rpath": rpath, "runpath": runpath}
    assert tags.pop(program) == [str(prio / "A")]
    assert list(tags.values()) == [[]]
    lp = str(prio / library_path) if library_path else ""
    assert loaded(binary, lp) == expected
    found, missing = elfdeps.closure([binary], library_path=lp)
    assert found == {"libwho.so": str(prio / expected / "libwho.so")}
    assert missing == []


def test_origin_of_a_library_is_where_it_was_opened(tmp_path):
    """``$ORIGIN`` of a library reached through a symlink: the symlink's dir.

    ``real/sub/libmid.so`` has RUNPATH ``$ORIGIN/../dep``; the program
    finds it as ``link/sub/libmid.so``, a symlink. The loader then looks in
    ``link/dep``, not ``real/dep``; a program's own ``$ORIGIN``, though, is
    where it really is.
    """
    cc = compiler()
    for which in ("real", "link"):
        (tmp_path / which / "dep").mkdir(parents=True)
        (tmp_path / which / "sub").mkdir()
        (tmp_path / f"{which}.c").write_text(WHO_C.format(which))
        build(
            cc,
            "-shared",
            "-fPIC",
            "-o",
            tmp_path / which / "dep" / "libwho.so",
            tmp_path / f"{which}.c",
            "-Wl,-soname,libwho.so",
        )
    (tmp_path / "mid.c").write_text(MID_C)
    build(
        cc,
        "-shared",
        "-fPIC",
        "-o",
        tmp_path / "real" / "sub" / "libmid.so",
        tmp_path / "mid.c",
        f"-L{tmp_path / 'real' / 'dep'}",
        "-lwho",
        "-Wl,-soname,libmid.so,--enable-new-dtags,-rpath,$ORIGIN/../dep",
    )
    (tmp_path / "link" / "sub" / "libmid.so").symlink_to("../../real/sub/libmid.so")
    (tmp_path / "main.c").write_text(MAIN_C.format("mid"))
    program = tmp_path / "real" / "prog"
    build(
        cc,
        "-o",
        program,
        tmp_path / "main.c",
        f"-L{tmp_path / 'real' / 'sub'}",
        "-lmid",
        "-Wl,--enable-new-dtags,-rpath,$ORIGIN/../link/sub",
    )
    # The program through a symlink elsewhere: its $ORIGIN is still real/.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "prog").symlink_to(program)
    for path in (program, tmp_path / "elsewhere" / "prog"):
        assert loaded(path, "") == "link"
        found, missing = elfdeps.closure([path], library_path="")
        assert found == {
            "libmid.so": str(tmp_path / "link" / "sub" / "libmid.so"),
            "libwho.so": str(tmp_path / "link" / "dep" / "libwho.so"),
        }
        assert missing == []
