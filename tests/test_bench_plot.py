"""The picture ``mpistage bench run`` (and ``make demo``) draws, read as a user would.

The figure is built from a small results fixture shaped like the demo's
(one workload, several modes, 1, 4 and 16 ranks) and checked on its
matplotlib objects: what the axes and the legend say, where the ticks are,
which numbers the right panel draws.
"""

import pytest

from mpistage.bench.sweep import COLUMNS

pytest.importorskip("matplotlib")

META = {"latency": "0.5ms", "nodes": 4, "layout": "realistic"}
RANKS = (1, 4, 16)
# mode: (seconds at one rank, operations of one rank, stage-step operations)
MODES = {
    "plain": (1.0, 6500, 0),
    "mpistage": (0.8, 600, 0),
    "staged-env": (0.5, 0, 40),
    "local": (0.3, 0, 0),
}


def rows():
    """One repeat per cell; the whole job's operations add up over its ranks."""
    found = []
    for mode, (seconds, per_rank, stage) in MODES.items():
        for ranks in RANKS:
            row = dict.fromkeys(COLUMNS, 0)
            row.update(workload="numpy", layout="realistic", via="site")
            row.update(mode=mode, ranks=ranks, nodes=min(ranks, 4), repeat=0)
            row.update(total_s=seconds * ranks**0.5, ops_rank_max=per_rank + 7)
            row.update(meta_ops=per_rank * ranks + stage * min(ranks, 4))
            found.append(row)
    return found


@pytest.fixture
def figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpistage.bench.results import figure

    fig = figure(rows(), META)
    yield fig
    plt.close(fig)


def test_the_picture_says_lower_is_better_and_what_each_mode_is(figure):
    left, right = figure.axes
    for axes in (left, right):
        assert "lower is better" in axes.get_title(), axes.get_title()
    assert "whole job" in right.get_ylabel(), right.get_ylabel()
    (legend,) = figure.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert "plain: every rank reads the shared FS" in texts, texts
    assert all(": " in t and not t.startswith("numpy / ") for t in texts), texts
    assert "numpy" in figure._suptitle.get_text()


def test_the_right_panel_draws_the_whole_jobs_operations(figure):
    _left, right = figure.axes
    assert right.get_yscale() == "log"
    lines = {line.get_label().split(":")[0]: line for line in right.get_lines()}
    assert list(lines["plain"].get_ydata()) == [6500, 26000, 104000]
    assert list(lines["staged-env"].get_ydata()) == [40, 160, 160]
    assert list(lines["local"].get_ydata()) == [1, 1, 1]  # 0 drawn at 1
    # Equal values stay visible: each mode's points sit a little apart.
    local, staged = lines["local"], lines["staged-env"]
    assert local.get_xdata().tolist() != staged.get_xdata().tolist()


def test_ticks_only_where_there_is_data(figure):
    for axes in figure.axes:
        assert list(axes.get_xticks()) == list(RANKS)
        assert [t.get_text() for t in axes.get_xticklabels()] == ["1", "4", "16"]
        assert list(axes.xaxis.get_minorticklocs()) == []
