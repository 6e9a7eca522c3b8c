"""The bench's workloads lay out installed packages as `pack` would take them."""

from mpistage.bench.workloads import Code


def test_named_packages_are_copied_with_their_metadata(tmp_path):
    Code("import mpi4py", ["mpi4py"]).build(tmp_path)
    assert (tmp_path / "mpi4py" / "__init__.py").is_file()
    assert list(tmp_path.glob("mpi4py-*.dist-info/RECORD"))
    assert not list(tmp_path.rglob("*.mpistage"))
