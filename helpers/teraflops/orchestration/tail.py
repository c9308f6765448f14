"""The tail at scale: why one slow rank in N hurts more as N grows.

A synchronous step ends when the *last* of N ranks arrives, so its expected time is the expected
maximum of N draws from the per-rank time distribution, not the mean. Two estimates:

* **Empirical** (:func:`expected_max`): the measured per-rank times ``x_(1) <= ... <= x_(m)``
  as the distribution; the maximum of N independent draws from it has

      E[max] = sum_i x_(i) [(i/m)^N - ((i-1)/m)^N]

  (the CDF of a maximum of N iid draws is F^N; David & Nagaraja, *Order Statistics*, 3rd ed.,
  Wiley 2003, §2.1). It cannot exceed the largest sample, so for N much larger than m it only
  says "at least this bad": :func:`tail_rows` marks those rows.
* **Hiccup model** (:func:`hiccup_step`): each rank independently suffers a hiccup of ``delay``
  seconds with probability p per step. The step is slowed when any rank is, with probability
  1 - (1 - p)^N, so E[step] = base + delay (1 - (1 - p)^N). Dean and Barroso's example ("The Tail
  at Scale", CACM 56(2), 2013): a 1-in-100 slow server makes 63 % of requests that touch 100
  servers slow.

Published figures from jobs at this scale are in :data:`PUBLISHED`, each with its source.
"""

from __future__ import annotations

import numpy as np

from teraflops.tables import table

RANKS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

PUBLISHED = (
    {"what": "Llama 3 405B pre-training: 466 job interruptions (47 planned, 419 unexpected, ~78 % of those "
             "confirmed or suspected hardware) in a 54-day snapshot on up to 16,384 H100 GPUs; >90 % "
             "effective training time",
     "source": "Llama Team, AI @ Meta, \"The Llama 3 Herd of Models\", arXiv:2407.21783 (2024), §3.3.4"},
    {"what": "MegaScale: 55.2 % MFU training a 175B model on 12,288 GPUs; per-rank timing of critical code "
             "segments (CUDA events) to find and remove stragglers",
     "source": "Jiang et al., \"MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs\", "
               "NSDI 2024 (arXiv:2402.15627)"},
    {"what": "1-in-100 slow servers make 63 % of 100-server requests slow: the tail of one machine becomes "
             "the common case of many",
     "source": "Dean & Barroso, \"The Tail at Scale\", Communications of the ACM 56(2):74-80, 2013"},
)


def hours_between_interruptions(interruptions: int = 419, days: float = 54) -> float:
    """Mean hours between unexpected interruptions of one job: ``days × 24 / interruptions``
    (default: Llama 3's 419 unexpected interruptions in 54 days, :data:`PUBLISHED`)."""
    return days * 24 / interruptions


def expected_max(samples, n: int) -> float:
    """Expected maximum of ``n`` independent draws from the empirical distribution of ``samples``.

    Args:
        samples: 1-D measured times (any unit; the result has the same unit).
        n: number of ranks (draws), >= 1.

    Raises:
        ValueError: empty ``samples`` or ``n < 1``.
    """
    x = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    if x.size == 0 or n < 1:
        raise ValueError(f"need at least one sample and n >= 1, got {x.size} samples and n={n}")
    cdf = np.arange(x.size + 1) / x.size
    return float(np.sum(x * np.diff(cdf ** n)))


def hiccup_step(base_s: float, delay_s: float, p: float, n) -> np.ndarray:
    """Expected step time of ``n`` ranks (int or array) when each rank independently adds
    ``delay_s`` with probability ``p`` per step: ``base_s + delay_s (1 - (1 - p)^n)`` (module
    docstring). Units: those of ``base_s`` and ``delay_s``."""
    if not 0 <= p <= 1:
        raise ValueError(f"p is a probability per rank and step, got {p}")
    return base_s + delay_s * (1 - (1 - p) ** np.asarray(n, dtype=np.float64))


def tail_rows(samples, base_s: float, delay_s: float, p: float, ranks=RANKS) -> list[dict]:
    """For each N in ``ranks``: the empirical expected step (from ``samples``, s), its slowdown over
    the median sample, whether N exceeds the number of samples (a lower bound then), the hiccup
    model's expected step and the probability that some rank hiccups."""
    x = np.asarray(samples, dtype=np.float64).ravel()
    med = float(np.median(x)) if x.size else 0.0
    if not med > 0:
        raise ValueError(f"samples must be positive times (got {x.size} samples, median {med}); hint: pass busy times in s")
    rows = []
    for n in ranks:
        emp = expected_max(x, n)
        rows.append({"ranks": int(n), "empirical_ms": emp * 1e3, "slowdown": emp / med, "lower_bound": n > x.size,
                     "hiccup_ms": float(hiccup_step(base_s, delay_s, p, n)) * 1e3,
                     "p_any_hiccup": float(1 - (1 - p) ** n)})
    return rows


def tail_table(rows: list[dict]) -> str:
    """:func:`tail_rows` as text (``>=`` marks empirical values capped by the sample maximum)."""
    return table([(r["ranks"], (">= " if r["lower_bound"] else "") + f"{r['empirical_ms']:.1f}",
                   f"{r['slowdown']:.2f}x", f"{r['hiccup_ms']:.1f}", f"{r['p_any_hiccup']:.1%}") for r in rows],
                 ["ranks N", "E[max busy] measured dist. (ms)", "vs median", "E[max busy] hiccup model (ms)",
                  "P(some rank hiccups)"])


def plot_tail(rows: list[dict], p: float | None = None):
    """Expected step time against N (log axis): empirical and hiccup model. Returns the Figure."""
    import matplotlib.pyplot as plt

    n = [r["ranks"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(n, [r["empirical_ms"] for r in rows], "o-", label="measured per-rank distribution (E[max])")
    capped = [r for r in rows if r["lower_bound"]]
    if capped:
        ax.plot([r["ranks"] for r in capped], [r["empirical_ms"] for r in capped], "o", mfc="white", color="C0",
                label="N > samples: lower bound")
    ax.plot(n, [r["hiccup_ms"] for r in rows], "s--", color="C3",
            label="hiccup model" + (f" (p = {p:g} per rank-step)" if p is not None else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("expected slowest busy time (ms)")
    ax.set_title("A synchronous step waits for the slowest of N ranks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
