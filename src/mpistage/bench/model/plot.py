"""The model's picture: modelled start-up time against ranks, one line per mode."""

from mpistage import StageError
from mpistage.bench.model.equations import nodes_for, predict

DPI = 110


def plot(inputs, modes, ranks_list, machine, path):
    """Save time against ranks, log scales, one line per mode."""
    try:
        import matplotlib
    except ImportError:
        raise StageError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = plot_ranks(ranks_list)
    fig, axes = plt.subplots(figsize=(7, 4.5))
    for mode in modes:
        ys = [
            predict(inputs[mode], n, nodes_for(n, machine), machine)["total"]
            for n in xs
        ]
        axes.plot(xs, ys, marker=".", label=mode)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("ranks")
    axes.set_ylabel("modelled start-up time (s)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    served = machine.mds_rate * machine.mds_concurrency
    fig.suptitle(
        f"mpistage bench model: metadata server {served:,.0f} ops/s, "
        f"{machine.ranks_per_node} ranks/node",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_ranks(ranks_list):
    """Return the given rank counts and the powers of two between them."""
    low, high = min(ranks_list), max(ranks_list)
    powers = [2**k for k in range(high.bit_length() + 1) if low <= 2**k <= high]
    return sorted({*ranks_list, *powers})
