"""The heat map beside a conformance report: worst error / tolerance per case (rows) and
implementation (columns), coloured on a log scale around 1 (the bar), written where matplotlib
is installed."""
from __future__ import annotations

import math
from pathlib import Path

from conformance.harness import FAIL, PASS, Result

# The colour scale spans ratios 10^-SPAN to 10^SPAN around 1: green well within the tolerance,
# yellow near it, red past it; cells without a verdict are grey.
SPAN = 2.0
NO_VERDICT = (0.85, 0.85, 0.85, 1.0)
MISSING_MATPLOTLIB = "no heat map: matplotlib is not installed (pip install matplotlib: the plots extra)"


def can_draw() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def position(result: Result | None) -> float | None:
    """Where a cell sits on the colour scale, 0 (ratio 10^-SPAN or less) to 1 (10^SPAN or more),
    0.5 at the bar; None for a cell with no verdict (not supported, error, not run)."""
    if result is None or result.status not in (PASS, FAIL) or result.worst_ratio is None:
        return None
    ratio = result.worst_ratio
    exponent = SPAN if ratio == math.inf else -SPAN if ratio <= 0 else math.log10(ratio)
    return (min(max(exponent, -SPAN), SPAN) + SPAN) / (2 * SPAN)


def label(result: Result | None) -> str:
    if result is None:
        return ""
    if result.status in (PASS, FAIL) and result.worst_ratio is not None:
        return f"{result.worst_ratio:.2f}" if result.worst_ratio < 10 else f"{result.worst_ratio:.2g}"
    return result.status


def colours(results: list[Result], cases: list[str], impls: list[str]) -> list[list[tuple]]:
    """RGBA per (case, implementation), rows in ``cases`` order, columns in ``impls`` order."""
    from matplotlib import colormaps
    scale = colormaps["RdYlGn_r"]
    by = {(r.case, r.impl): r for r in results}
    return [[NO_VERDICT if (p := position(by.get((c, i)))) is None else tuple(scale(p)) for i in impls]
            for c in cases]


def write(path: Path, results: list[Result], cases: list[str], impls: list[str], title: str) -> Path:
    """Draw the map to ``path`` (PNG) with the Agg canvas (no display, no global backend)."""
    from matplotlib.figure import Figure
    by = {(r.case, r.impl): r for r in results}
    # inches: a cell each, and room for the longest label (case names left, rotated names below)
    longest = lambda names: 0.06 * max(map(len, names))
    fig = Figure(figsize=(max(4.0, 1.2 + 0.62 * len(impls) + longest(cases)), 1.2 + 0.26 * len(cases) + longest(impls)),
                 layout="constrained")
    ax = fig.add_subplot()
    cells = colours(results, cases, impls)
    ax.imshow(cells, aspect="auto", interpolation="nearest")
    for row, case in enumerate(cases):
        for column, impl in enumerate(impls):
            r, (red, green, blue, _) = by.get((case, impl)), cells[row][column]
            dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.45  # white text where black would vanish
            ax.text(column, row, label(r), ha="center", va="center", fontsize=6, color="white" if dark else "black",
                    fontweight="bold" if r is not None and r.status == FAIL else "normal")
    ax.set_xticks(range(len(impls)), impls, rotation=50, ha="right", fontsize=7)
    ax.set_yticks(range(len(cases)), cases, fontsize=7)
    fig.suptitle(f"{title}\nworst error / tolerance (below 1 passes; grey: no verdict)", fontsize=8)
    fig.savefig(path, dpi=110)
    return path
