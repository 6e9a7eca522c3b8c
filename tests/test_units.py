"""The quantities of the bench's command lines: times, sizes, bandwidths, counts."""

import pytest

from mpistage import StageError
from mpistage.bench.units import (
    UnitError,
    format_bandwidth,
    format_time,
    parse_bandwidth,
    parse_counts,
    parse_size,
    parse_time,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0.5ms", 0.0005),
        ("500us", 0.0005),
        ("0.001s", 0.001),
        ("0", 0.0),
        ("2", 2.0),
        ("1e-3", 0.001),
        ("250 µs", 0.00025),
        ("1e-05s", 0.00001),  # as simfs's client writes its latency
    ],
)
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)
    assert parse_time(format_time(seconds)) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4MiB", 4 * 2**20),
        ("256MiB", 256 * 2**20),
        ("35GB/s", 35e9),
        ("1.5kB", 1500),
        ("4096", 4096),
        ("2G", 2e9),
        ("1TiB", 2**40),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("100MB/s", 100e6),
        ("1GiB/s", 2**30),
        ("1.5kB/s", 1500),
        ("4096", 4096),
        ("2G", 2e9),
        ("0", None),
        ("none", None),
        ("unlimited", None),
    ],
)
def test_parse_bandwidth(text, rate):
    assert parse_bandwidth(text) == rate
    if rate:  # printed to four digits
        assert parse_bandwidth(format_bandwidth(rate)) == pytest.approx(rate, rel=1e-3)


@pytest.mark.parametrize("text", ["fast", "1 parsec", "ms", "-1ms", "", "0.5ms/s"])
def test_a_bad_time_is_one_clear_error(text):
    with pytest.raises(UnitError, match=f"invalid latency: {text!r}") as caught:
        parse_time(text, "latency")
    # the command lines print a StageError; argparse's type= catches ValueError
    assert isinstance(caught.value, StageError)
    assert isinstance(caught.value, ValueError)


def test_a_bad_size_names_its_flag():
    with pytest.raises(UnitError, match=r"invalid --fs-bw: '5xs' \(use e.g. '4MiB'"):
        parse_size("5xs", "--fs-bw")
    with pytest.raises(UnitError, match="invalid bandwidth: '1.2.3MB/s'"):
        parse_bandwidth("1.2.3MB/s")


def test_parse_counts():
    assert parse_counts("1,4,16") == [1, 4, 16]
    for bad in ("0", "1,,4", "many", "1,-2", ""):
        with pytest.raises(UnitError, match=f"--readers {bad!r} must be positive"):
            parse_counts(bad, "--readers")
