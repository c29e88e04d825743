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
