"""What every plot shares (benchmarks, evaluations, the demo): one colour per attention method, integer
layer-count axes and the 1x line of speedup panels."""
from __future__ import annotations

import zlib

# The bundled methods keep these colours (matplotlib's tab10) in every panel and plot; exact attention
# (and the unpatched model, 0 replaced layers) is grey.
METHOD_COLORS = {"exact": "#7f7f7f", "hyper": "#1f77b4", "moba": "#ff7f0e", "nsa": "#2ca02c", "sparse": "#d62728",
                 "linear": "#9467bd", "performer": "#8c564b"}
_OTHER_COLORS = ("#e377c2", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173")


def method_color(method: str | None) -> str:
    """The colour of `method` (None: the unpatched model, drawn as exact). A method not bundled gets one
    picked by its name, the same in every plot and run."""
    method = method or "exact"
    return METHOD_COLORS.get(method) or _OTHER_COLORS[zlib.crc32(method.encode()) % len(_OTHER_COLORS)]


def layers_axis(ax, label: str = "number of replaced final layers") -> None:
    """An x axis of layer counts: integer ticks only."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def speedup_line(ax) -> None:
    """The 1x line of a speedup panel: above it faster than exact attention, below it slower."""
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")


def annotated_heatmap(data, xlabels: list[str], ylabels: list[str], path, title: str, *, vmax: float,
                      colorbar: str, fmt: str, xlabel: str, ylabel: str | None = None, width: float,
                      row_height: float, min_height: float = 0.0, rule_above_last: bool = False) -> None:
    """A grid of scores (rows x columns, NaN = no cell) as a red-yellow-green heatmap with each cell's value
    written in it, the title wrapped to the figure's width (the evaluations' heatmaps: needle, RULER).
    rule_above_last: a line above the last row (an average row)."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.asarray(data, dtype=float)
    title = textwrap.fill(title, width=int(width * 72 / (9 * 0.62)))
    height = max(min_height, 1.0 + row_height * len(ylabels)) + 0.15 * title.count("\n")
    fig, ax = plt.subplots(figsize=(width, height))
    im = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(xlabels)), xlabels)
    ax.set_yticks(range(len(ylabels)), ylabels)
    for i in range(len(ylabels)):
        for j in range(len(xlabels)):
            if not np.isnan(data[i, j]):
                ax.text(j, i, format(data[i, j], fmt), ha="center", va="center", fontsize=7)
    if rule_above_last:
        ax.axhline(len(ylabels) - 1.5, color="black", lw=0.8)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=colorbar)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
