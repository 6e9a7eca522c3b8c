"""Rows of measurements: one per cell and repeat, reduced to one per cell.

Every benchmark runs each cell (a mode at a rank count, say) one or more
times, interleaved with the other cells, and reports the median of its
repeats: one slow launch does not move the figure.
"""


def medians(rows, key, columns):
    """Return one row per distinct *key*, in the order the cells first ran.

    The row keeps its first repeat's values; each of *columns* becomes the
    median over the repeats.
    """
    import statistics

    groups = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in key), []).append(row)
    return [
        {**group[0], **{c: statistics.median(r[c] for r in group) for c in columns}}
        for group in groups.values()
    ]
