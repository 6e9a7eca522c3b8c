"""One home for every ``MPISTAGE_*`` setting (``mpistage.settings``).

A setting read anywhere must be listed there with its parser; what users
set is shown by ``mpistage --help`` and docs/usage.md from that list; a bad
value is one line naming the variable, wherever it is read.
"""

import re
from pathlib import Path

import pytest

from mpistage import StageError, settings
from mpistage.node.launch import emulated_nodes
from stagetools import clean_environ, mpirun, mpistage

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bMPISTAGE_[A-Z_]*[A-Z]\b")


def names_in(paths):
    """Every ``MPISTAGE_*`` name written in the files *paths*."""
    found = {}
    for path in paths:
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, path.relative_to(ROOT))
    return found


def test_every_setting_the_code_reads_is_in_the_one_list():
    code = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("bin").iterdir()]
    unlisted = {n: p for n, p in names_in(code).items() if n not in settings.SETTINGS}
    assert unlisted == {}


def test_no_module_but_settings_parses_a_setting():
    """``os.environ.get("MPISTAGE_...")`` outside the one home: a second parser."""
    reads = re.compile(r'environ(?:\.get\(\s*"MPISTAGE_|\["MPISTAGE_\w+"\](?!\s*=))')
    found = [
        str(p.relative_to(ROOT))
        for p in ROOT.joinpath("src").rglob("*.py")
        if reads.search(p.read_text()) and p.name != "settings.py"
    ]
    assert found == []


def test_the_usage_table_is_the_list():
    usage = ROOT.joinpath("docs", "usage.md").read_text()
    rows = "\n".join(settings.markdown_rows())
    assert rows in usage
    assert len(settings.markdown_rows()) == len(
        [s for s in settings.SETTINGS.values() if not s.internal]
    )


def test_help_lists_every_setting_users_set():
    done = mpistage(["--help"], env=clean_environ(), timeout=60)
    assert done.returncode == 0, done
    shown = set(NAME.findall(done.stdout.split("environment:")[1]))
    users = {n for n, s in settings.SETTINGS.items() if not s.internal}
    assert shown == users
    assert max(len(line) for line in done.stdout.splitlines()) <= 79


def test_the_launch_script_reads_its_settings_with_the_listed_defaults():
    script = ROOT.joinpath("bin", "mpistage-env").read_text()
    for name in ("MPISTAGE_ENV_WAIT", "MPISTAGE_NODE_PYTHON"):
        default = settings.SETTINGS[name].default
        assert f"${{{name}:-{default}}}" in script, name


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("MPISTAGE_BOOT", "maybe", "must be one of yes/no"),
        ("MPISTAGE_LIVE_WAIT", "-1", "must be a number of seconds"),
        ("MPISTAGE_BOOT_WAIT", "nan", "must be a number of seconds"),
        ("MPISTAGE_EMULATE_NODES", "two", "must be a whole number"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(name, value, words):
    with pytest.raises(StageError) as raised:
        settings.get(name, {name: value})
    assert str(raised.value).startswith(f"{name}={value!r}")
    assert words in str(raised.value)


def test_unset_and_empty_give_the_default():
    for item in settings.SETTINGS.values():
        assert item.get({}) == item.default
        assert item.get({item.name: "  "}) == item.default
    assert settings.get("MPISTAGE_STAGE_DIR", {"MPISTAGE_STAGE_DIR": "/a::/b"}) == [
        "/a",
        "/b",
    ]


def test_emulated_nodes_are_read_one_way_everywhere(monkeypatch):
    from mpistage.cli.launchers import emulated

    monkeypatch.setenv("MPISTAGE_EMULATE_NODES", " 2 ")
    assert emulated() == 2 == emulated_nodes(4)
    monkeypatch.setenv("MPISTAGE_EMULATE_NODES", "2x")
    for read in (emulated, lambda: emulated_nodes(4)):
        with pytest.raises(StageError, match="MPISTAGE_EMULATE_NODES='2x'"):
            read()
    with pytest.raises(StageError, match="from 1 to the number of ranks"):
        emulated_nodes(4, "8")


def test_a_bad_setting_ends_a_job_with_one_line(tmp_path):
    env = dict(clean_environ(), MPISTAGE_LIVE="perhaps")
    done = mpirun("2", ["-m", "mpistage", "-c", "print('ran')"], env=env, cwd=tmp_path)
    assert done.returncode != 0
    assert "ran" not in done.stdout
    assert done.errors() == [
        "mpistage: error: MPISTAGE_LIVE='perhaps' must be one of yes/no/on/off/1/0"
    ]
