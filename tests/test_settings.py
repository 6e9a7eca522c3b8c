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
from stagetools import clean_environ, mpirun, mpirun_status, mpistage

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
    default = settings.SETTINGS["MPISTAGE_NODE_PYTHON"].default
    assert f"${{MPISTAGE_NODE_PYTHON:-{default}}}" in script
    wait = settings.SETTINGS["MPISTAGE_ENV_WAIT"]
    assert f"seconds MPISTAGE_ENV_WAIT {wait.default:g} {wait.parse.high}" in script
    assert "boolean MPISTAGE_STAGE_FALLBACK yes" in script


# Values at the edges of the one rule: above the range by a rounding error,
# a trailing newline, a quote, digits of another script, and far too long.
EDGES = ["86400.000000000000001", "5\n", "it's", "\u0665", "0" * 99999, "1e3",
         "600\t", "-0", "0" * 65]  # fmt: skip


def shell_refusal(name, value, **extra):
    """What ``bin/mpistage-env`` says of *name* set to *value*, run by hand."""
    import subprocess

    env = dict(clean_environ(), **{name: value}, **extra)
    script = ROOT / "bin" / "mpistage-env"
    done = subprocess.run(
        ["sh", script, "/nonexistent.mpistage", "--", "true"],
        env=env, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert done.returncode != 0, done
    return done.stderr


@pytest.mark.parametrize("value", EDGES, ids=range(len(EDGES)))
@pytest.mark.parametrize("name", ["MPISTAGE_ENV_WAIT", "MPISTAGE_STAGE_FALLBACK"])
def test_the_shell_and_python_judge_a_value_alike_in_one_line(name, value):
    """The same value gets the same verdict and the same line in both, at once
    (a value of 99,999 zeros is refused by its length, unread)."""
    import os

    with pytest.raises(StageError) as raised:
        settings.get(name, {name: value})
    said = shell_refusal(name, value)
    assert said == f"mpistage-env: error: on {os.uname().nodename}: {raised.value}\n"


def test_a_value_of_the_longest_length_is_read_by_both():
    value = "0" * 63 + "7"
    assert settings.get("MPISTAGE_ENV_WAIT", {"MPISTAGE_ENV_WAIT": value}) == 7.0
    said = shell_refusal("MPISTAGE_ENV_WAIT", value, MPISTAGE_NODE_PYTHON="/none")
    assert "MPISTAGE_ENV_WAIT" not in said and "no /none on this node" in said, said


@pytest.mark.parametrize("value", ["0", "5", "0" * 99999, "2\n", "\u0662"])
def test_the_shell_and_python_judge_emulated_nodes_alike(value):
    import os

    with pytest.raises(StageError) as raised:
        emulated_nodes(4, value)
    said = shell_refusal("MPISTAGE_EMULATE_NODES", value, PMI_RANK="0", PMI_SIZE="4")
    assert said == f"mpistage-env: error: on {os.uname().nodename}: {raised.value}\n"


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("MPISTAGE_BOOT", "maybe", "must be one of yes, no, on, off, true, false"),
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
        assert item.get({item.name: ""}) == item.default
        if not item.says():  # text and paths lose their outer spaces
            assert item.get({item.name: "  "}) == item.default
    assert settings.get("MPISTAGE_STAGE_DIR", {"MPISTAGE_STAGE_DIR": "/a::/b"}) == [
        "/a",
        "/b",
    ]


def test_emulated_nodes_are_read_one_way_everywhere(monkeypatch):
    from mpistage.cli.launchers import emulated

    monkeypatch.setenv("MPISTAGE_EMULATE_NODES", "02")
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
    assert "ran" not in done.stdout.splitlines()
    assert done.errors() == [
        "mpistage: error: MPISTAGE_LIVE='perhaps' must be one of yes, no, on, off, "
        "true, false, 1, 0"
    ]


# -- the one rule, shared with bin/mpistage-env ----------------------------------

WAITS = ("MPISTAGE_BOOT_WAIT", "MPISTAGE_LIVE_WAIT", "MPISTAGE_ENV_WAIT")
BOOLEANS = ("MPISTAGE_BOOT", "MPISTAGE_LIVE", "MPISTAGE_STAGE_FALLBACK")


@pytest.mark.parametrize("name", WAITS)
@pytest.mark.parametrize(
    ("value", "seconds"),
    [("0", 0.0), ("010", 10.0), ("1.5", 1.5), ("00.25", 0.25), ("86400", 86400.0)],
)
def test_seconds_are_digits_with_an_optional_fraction(name, value, seconds):
    assert settings.get(name, {name: value}) == seconds


@pytest.mark.parametrize("name", WAITS)
@pytest.mark.parametrize(
    "value",
    ["inf", "Infinity", "nan", "1e10", "1E3", "+5", "-1", " 5", "5 ", "1_000", "0x10",
     ".5", "5.", "1.2.3", "86400.5", "86401", "9" * 5000, "\u0665", "5s"],
)  # fmt: skip
def test_seconds_refuse_anything_else_with_their_range(name, value):
    with pytest.raises(StageError) as raised:
        settings.get(name, {name: value})
    assert str(raised.value) == (
        f"{name}={settings.shown(value)} must be a number of seconds from 0 to 86400"
    )


@pytest.mark.parametrize("name", BOOLEANS)
def test_booleans_are_the_six_words_and_two_digits_in_any_case(name):
    for yes in ("yes", "YES", "On", "true", "TRUE", "1"):
        assert settings.get(name, {name: yes}) is True
    for no in ("no", "No", "OFF", "false", "False", "0"):
        assert settings.get(name, {name: no}) is False
    for bad in ("y", "2", "enabled", " yes", "truee", "00"):
        with pytest.raises(StageError, match="must be one of yes, no, on, off"):
            settings.get(name, {name: bad})


def test_a_whole_number_is_digits_with_leading_zeros_meaning_nothing():
    name = "MPISTAGE_EMULATE_NODES"
    assert settings.get(name, {name: "010"}) == 10
    assert settings.get(name, {name: "4096"}) == 4096
    for bad in ("0", "4097", "+2", "2.0", "1_0", " 2", "\u0662", "9" * 5000):
        with pytest.raises(StageError) as raised:
            settings.get(name, {name: bad})
        says = "must be a whole number from 1 to 4096"
        assert str(raised.value) == f"{name}={settings.shown(bad)} {says}"


def test_the_usage_table_gives_each_settings_range():
    usage = ROOT.joinpath("docs", "usage.md").read_text()
    for name in (*WAITS, *BOOLEANS, "MPISTAGE_EMULATE_NODES"):
        row = next(r for r in settings.markdown_rows() if f"`{name}=" in r)
        assert settings.SETTINGS[name].says() in row
        assert row in usage


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("MPISTAGE_LIVE_WAIT", "inf", "a number of seconds from 0 to 86400"),
        ("MPISTAGE_LIVE_WAIT", "1e10", "a number of seconds from 0 to 86400"),
        ("MPISTAGE_BOOT", "sometimes", "one of yes, no, on, off, true, false, 1, 0"),
        ("MPISTAGE_BOOT_WAIT", "soon", "a number of seconds from 0 to 86400"),
    ],
)
@pytest.mark.parametrize("command", [["-c", "import json; print('ran')"], ["stage"]])
def test_a_bad_value_read_late_ends_the_job_at_start_with_one_line(
    tmp_path, name, value, says, command
):
    """Read in the node boot or by live imports: refused before anything runs."""
    if command == ["stage"]:
        command = [
            "stage",
            str(tmp_path / "none.mpistage"),
            "--to",
            str(tmp_path / "d"),
        ]
    env = dict(clean_environ(), MPISTAGE_EMULATE_NODES="2", **{name: value})
    done, status = mpirun_status("2", ["-m", "mpistage", *command], env, tmp_path)
    assert done.returncode == 1, done
    assert status == {0: 1, 1: 1}, done
    assert "ran" not in done.stdout.splitlines()
    assert "Traceback" not in done.stderr, done
    assert done.errors() == [f"mpistage: error: {name}={value!r} must be {says}"]
