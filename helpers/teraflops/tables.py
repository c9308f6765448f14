"""Plain-text tables that read at a glance (and survive nbval, logs and CI output)."""

from __future__ import annotations

from typing import Iterable, Sequence

GB = 1e9  # bytes: the course's GB (bandwidths in GB/s); binary multiples are KiB, MiB, GiB


def fmt(x, digits: int = 3) -> str:
    """Format a number with ``digits`` significant digits; strings pass through."""
    if isinstance(x, str):
        return x
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if x != x:  # NaN
        return "nan"
    if x == 0:
        return "0"
    if 1000 <= abs(x) < 1e7:
        return f"{x:,.0f}"  # 2,039 rather than 2.04e+03
    return f"{x:.{digits}g}"


def fmt_bytes(n: float) -> str:
    """A byte count with a binary prefix, e.g. ``"64 MiB"`` for 2**26 (message and buffer sizes, which
    are powers of two, as nccl-tests' ``-b 1K -e 64M`` counts them; GB = 1e9 is kept for bandwidths)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def fmt_count(n: float) -> str:
    """A count with the short-scale suffix model sizes are quoted in, e.g. ``"7.5 B"`` for 7.5e9 and
    ``"125 M"`` (``"1 T"`` for 1e12; below a thousand, the number itself)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g}"


def fmt_seconds(t: float) -> str:
    """A time in µs below 1 ms, in ms below 1 s, else in s, e.g. ``"5.47 ms"`` (``"5,830 s"``, not ``"5.83e+03 s"``)."""
    if t >= 1000:
        return f"{t:,.0f} s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e6:.3g} µs"


def table(rows: Iterable[Sequence], headers: Sequence[str], digits: int = 3) -> str:
    """Render ``rows`` under ``headers`` with right-aligned numbers and left-aligned text."""
    rows = [list(r) for r in rows]  # a generator can be read only once
    body = [[fmt(c, digits) for c in r] for r in rows]
    numeric = [all(not isinstance(r[i], str) for r in rows) if body else False for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in body]
    return "\n".join(out)
