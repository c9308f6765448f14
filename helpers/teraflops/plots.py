"""One home for how the course's figures look: a scale for the room they are shown in.

Every course figure is drawn by a helper (``plot_*``) with Matplotlib's defaults, which this module
sets: font sizes, line widths and marker sizes, and the resolution of the images a notebook shows.
Helpers give text sizes relative to the base font (``"small"``, ``"large"``), never in points, so one
number scales them all.

The scale ``s`` (:func:`scale`) comes from ``TERAFLOPS_FIG_SCALE``: a number between 0.5 and 4 or a
name of :data:`SCALES` (``laptop`` = 1, the default; ``room`` = 1.6, a projector seen from the back of a
meetup room). At scale ``s`` fonts, lines and markers are ``s`` times Matplotlib's defaults and images
have ``100·s`` dots per inch. Figure sizes in inches do not change: a projector shows a figure at the
width of the screen, whatever its inches, so what makes it readable from the back is text that is large
*relative to the figure* and enough pixels for that text to stay sharp.

Front ends: ``style(svg=True)`` (or ``TERAFLOPS_FIG_FORMAT=svg``) makes the notebook's inline backend
emit SVG, which JupyterLab, VS Code and nbconvert's HTML show; vector text stays sharp at any zoom.
``teraflops demo`` writes PNG and SVG files.

``import teraflops`` calls :func:`style` once Matplotlib is imported (at once if it already is, else
right after ``import matplotlib``), so a lecture needs no set-up cell; at scale 1 that leaves
Matplotlib's defaults as they are. :func:`style` can be called again with another scale.
"""

from __future__ import annotations

import os

from teraflops.errors import CourseError

__all__ = ["ENV_VAR", "FORMAT_ENV_VAR", "SCALES", "FigureScaleError", "scale", "rc", "style", "place_labels"]

ENV_VAR = "TERAFLOPS_FIG_SCALE"
FORMAT_ENV_VAR = "TERAFLOPS_FIG_FORMAT"
SCALES = {"laptop": 1.0, "room": 1.6}
LIMITS = (0.5, 4.0)
BASE_DPI = 100  # Matplotlib's default figure.dpi

# Matplotlib's defaults (matplotlib/mpl-data/matplotlibrc) that scale with the room
_BASE = {"font.size": 10.0, "lines.linewidth": 1.5, "lines.markersize": 6.0, "axes.linewidth": 0.8,
         "patch.linewidth": 1.0, "xtick.major.width": 0.8, "ytick.major.width": 0.8,
         "xtick.major.size": 3.5, "ytick.major.size": 3.5, "grid.linewidth": 0.8}


class FigureScaleError(CourseError, ValueError):
    """A figure scale that is not a number in :data:`LIMITS` nor a name of :data:`SCALES`."""


def scale(value: str | float | None = None) -> float:
    """The figure scale: ``value``, else ``TERAFLOPS_FIG_SCALE``, else 1.

    Raises:
        FigureScaleError: neither a name of :data:`SCALES` nor a number in :data:`LIMITS` (one line).
    """
    raw = value if value is not None else os.environ.get(ENV_VAR) or 1.0
    if isinstance(raw, str) and raw.strip().lower() in SCALES:
        return SCALES[raw.strip().lower()]
    try:
        s = float(raw)
    except (TypeError, ValueError):
        s = float("nan")
    if not LIMITS[0] <= s <= LIMITS[1]:
        where = f"{ENV_VAR}={raw}" if value is None else f"figure scale {raw!r}"
        raise FigureScaleError(f"{where} is not a figure scale. Hint: a number from {LIMITS[0]:g} to {LIMITS[1]:g}, "
                               f"or one of {', '.join(f'{k} ({v:g})' for k, v in SCALES.items())}")
    return s


def rc(s: float | str | None = None) -> dict:
    """The Matplotlib rcParams of scale ``s`` (default :func:`scale`): fonts, lines and markers ``s`` ×
    Matplotlib's defaults, ``100·s`` dpi for the figure and for saved images."""
    s = scale(s)
    params = {k: v * s for k, v in _BASE.items()}
    params.update({"figure.dpi": BASE_DPI * s, "savefig.dpi": BASE_DPI * s})
    return params  # at s = 1: Matplotlib's defaults, unchanged


def style(s: float | str | None = None, svg: bool | None = None) -> float:
    """Apply scale ``s`` (default :func:`scale`) to every figure drawn from now on; with ``svg`` (default:
    ``TERAFLOPS_FIG_FORMAT=svg``) make IPython's inline backend emit SVG instead of PNG. Returns the scale."""
    import matplotlib  # lazy: `import teraflops` must not pay for Matplotlib where no figure is drawn

    s = scale(s)
    matplotlib.rcParams.update(rc(s))
    svg = os.environ.get(FORMAT_ENV_VAR, "").lower() == "svg" if svg is None else svg
    if svg:
        try:
            from matplotlib_inline.backend_inline import set_matplotlib_formats  # lazy: only inside IPython
        except ImportError:
            return s
        set_matplotlib_formats("svg")
    return s


def place_labels(ax, labels, step: float | None = None, tries: int = 16) -> None:
    """Move point labels (offset-point annotations) apart: each in turn, from the lowest point up,
    steps away from its point (alternately below and above, ``step`` points further each try; default
    0.9 × the font size, so the steps grow with the figure scale of :mod:`teraflops.plots`) until its box
    overlaps no label placed before it (nor a legend inside the axes) and lies inside the axes; one
    running past the right (left) edge is turned to end (start) at its point. When no try is both, the
    first try inside the axes is kept (the lowest point's label once ran off the bottom: the last try
    was kept), and when none is inside, the label's first position. Greedy, good for the few labels of
    a roofline or a sweep's point labels."""
    import matplotlib  # lazy: see style()

    step = 0.9 * matplotlib.rcParams["font.size"] if step is None else step
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    placed = [legend.get_window_extent(renderer)] if legend is not None else []
    for t in sorted(labels, key=lambda t: (t.xy[1], t.xy[0])):
        ox, oy = t.xyann
        first = inside_first = None
        for k in range(tries):
            box = t.get_window_extent(renderer)
            if box.x1 > frame.x1 and t.get_ha() == "left":
                t.set_ha("right")
                ox = -abs(ox)
            elif box.x0 < frame.x0 and t.get_ha() == "right":
                t.set_ha("left")
                ox = abs(ox)
            t.xyann = (ox, oy + (-1) ** k * step * ((k + 1) // 2))
            first = first or (t.xyann, t.get_ha())
            box = t.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in placed):
                break
            if inside and inside_first is None:
                inside_first = (t.xyann, t.get_ha())
        else:
            t.xyann, ha = inside_first or first
            t.set_ha(ha)
        placed.append(t.get_window_extent(renderer))
