"""Unit 5: saturation under contention — k transfers sharing one link.

One copy stream alone does not use all of a link (a CPU core cannot issue enough memory requests to
fill the memory bus; one CUDA stream may not fill a copy engine). Add streams and the **aggregate**
bandwidth (all bytes moved / the wall time of the round) rises until the link is full, then stays
flat: from there on every new stream takes its share from the others, and the **per-transfer**
bandwidth (one stream's bytes / its own time) falls roughly as ``aggregate / k``. This is why eight
data-loader workers do not copy eight times faster than one, and why the gradients of eight GPUs
sharing one PCIe switch arrive slower than one GPU's.

:func:`sweep` measures it, one round per ``k``:

* **CPU**: ``k`` threads, each repeating ``dst.copy_(src)`` on its own pair of float32 buffers of
  ``nbytes`` (default the preset's ``copies.contention_bytes``, :mod:`teraflops.sizing`: 64 MiB on CPU, twice
  the 32 MiB last-level cache of the course's CPU machine, so the copies go to DRAM), with one torch
  thread each (``torch.set_num_threads(1)`` for the round: one copy = one core's stream). Threads, not
  processes: torch releases the GIL inside ``copy_`` (its Python bindings drop it around every ATen
  call), so k threads copy at once — measured here, 2 threads move 1.6–1.8× the bytes of one, which
  a GIL-bound loop could not; while 8 spawned worker processes each importing torch took 19 s to
  start on this 2-core machine, 4× a whole sweep.
  The link shared is the memory bus. **On the 2-core course machine, k > 2 streams also share the
  two cores**: from k = 3 the operating system time-slices the streams, so the plateau is set by
  cores and memory bus together (each core alone reaches ~10 GB/s of the ~16 GB/s the two reach
  together). The shape is the same: the aggregate flattens, the per-transfer share falls.
* **GPU**: ``k`` CUDA streams in this process, each copying its own ``nbytes`` buffer: pinned host to
  device (``kind="h2d"``, the default: the streams share PCIe and the GPU's host-to-device copy
  engine) or device to device (``kind="d2d"``: they share HBM). A gate kernel
  (``torch.cuda._sleep``) holds every stream until all copies are queued, so they start together;
  CUDA events time each stream and the round.

Timing (CPU): every stream waits at a common barrier (``threading.Barrier``), then copies until
``seconds`` have passed since *its* start; it reports the bytes it copied and its start and end
times (``time.perf_counter``, one clock for all threads). aggregate = Σ bytes / (latest end −
earliest start); per-transfer = a stream's bytes / (its end − its start). ``repeats`` rounds per k;
the row kept is the round with the highest aggregate (the best rate observed, as for the ceilings of
:mod:`teraflops.ceilings`: a busy moment on a shared machine only lowers rates).

Bytes are counted as STREAM counts a copy (McCalpin, https://www.cs.virginia.edu/stream/ref.html):
read + write, ``2 × nbytes`` per copy, for CPU and device-to-device copies, so that the numbers
compare with :func:`teraflops.ceilings.measure_copy_bandwidth`; a host-to-device copy counts
``nbytes`` once (the bytes that cross PCIe), as :func:`teraflops.ceilings.measure_host_device_copy`.
Units: bytes/s in rows, GB/s (GB = 1e9 bytes) in tables and plots.

Measured on the 2-core CPU machine (64 MiB per stream, 0.8 s per round, best of 2; five sweeps on a
machine shared with other work, so the level moved between sweeps while the shape held): aggregate
10.7–13.1 GB/s at k = 1, 17–23 GB/s at k = 2, and at k = 4 and 8 between 0.92× and 1.2× the k = 2
figure; per-transfer 8.5–11.6, 4.0–5.9 and 2.1–2.9 GB/s at k = 2, 4, 8 (about aggregate / k). A sweep
takes ~8 s after the import.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from teraflops.ceilings import measure_copy_bandwidth
from teraflops.errors import CourseError
from teraflops.machine import detect
from teraflops.sizing import preset
from teraflops.tables import GB, table
from teraflops.timing import benchmark

KS = (1, 2, 4, 8)  # concurrent streams per round
# Per-stream buffer and round length: the preset's copies.contention_bytes and copies.contention_seconds
# (teraflops.sizing), read when sweep() is called, so importing this module probes no hardware.
KINDS = ("copy", "h2d", "d2d")  # copy: CPU memory copy; h2d: pinned host to GPU; d2d: GPU to GPU


class ContentionError(CourseError, ValueError):
    """A bad argument to :func:`sweep` (ks, sizes, kind), or a GPU kind asked for on a CPU machine."""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check(ks, nbytes, seconds, repeats, kind, device) -> tuple[int, ...]:
    if _is_int(ks):
        raise ContentionError(f"ks must be an iterable of stream counts, got the single number {ks!r}. "
                              f"Hint: ks=({int(ks)},) for one round of {int(ks)} streams")
    try:
        ks = tuple(ks)
    except TypeError:
        raise ContentionError(f"ks must be an iterable of stream counts (ints >= 1), got {ks!r}. "
                              "Hint: ks=(1, 2, 4, 8)") from None
    if not ks or not all(_is_int(k) and k >= 1 for k in ks):
        raise ContentionError(f"ks must be stream counts (ints >= 1), got {ks!r}. Hint: ks=(1, 2, 4, 8)")
    if not _is_int(nbytes) or nbytes < 4:
        raise ContentionError(f"nbytes must be an int >= 4 (bytes per stream's buffer), got {nbytes!r}. "
                              "Hint: well beyond the last-level cache, e.g. the preset's copies.contention_bytes "
                              "(64 MiB on CPU, 256 MiB on a GPU)")
    if isinstance(seconds, (bool, np.bool_)) or not isinstance(seconds, (int, float, np.integer, np.floating)) \
            or not (0 < seconds < float("inf")):
        raise ContentionError(f"seconds must be a finite number > 0 (length of one round), got {seconds!r}. "
                              "Hint: the preset's copies.contention_seconds (0.8 s on CPU, 0.5 s on a GPU)")
    if not _is_int(repeats) or repeats < 1:
        raise ContentionError(f"repeats must be an int >= 1 (rounds per k), got {repeats!r}. Hint: repeats=2")
    if kind not in KINDS:
        raise ContentionError(f"kind must be one of {KINDS}, got {kind!r}. Hint: 'copy' on a CPU, 'h2d' or 'd2d' on a GPU")
    if kind != "copy" and device != "cuda":
        raise ContentionError(f"kind={kind!r} needs a CUDA GPU (torch.cuda.is_available() is False): there is no "
                              "PCIe link or device memory to share here. Hint: kind='copy' shares this CPU's memory bus")
    return tuple(int(k) for k in ks)


# ---- CPU: k threads share the memory bus -------------------------------------------------------------


def _cpu_round(pairs, seconds: float) -> list[dict]:
    """One round: ``len(pairs)`` threads copy ``dst.copy_(src)`` for ``seconds`` after a common barrier.

    Returns one dict per stream: ``bytes`` (2 × nbytes per copy), ``start``, ``end`` (perf_counter s).
    Every thread is stopped and joined before returning, also on an error or KeyboardInterrupt.
    """
    k = len(pairs)
    barrier, stop = threading.Barrier(k), threading.Event()
    out: list = [None] * k
    errors: list = []

    def stream(i: int) -> None:
        src, dst = pairs[i]
        per_copy = 2 * src.numel() * src.element_size()
        try:
            barrier.wait(timeout=30)
            start = now = time.perf_counter()
            moved = 0
            while now - start < seconds and not stop.is_set():
                dst.copy_(src)  # the GIL is released inside: the k copies run at once
                moved += per_copy
                now = time.perf_counter()
            out[i] = {"bytes": moved, "start": start, "end": now}
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True, name=f"copy-stream-{i}") for i in range(k)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.1)  # short joins: Ctrl-C reaches the main thread
    finally:
        stop.set()
        barrier.abort()
        for t in threads:
            t.join()
    if errors or any(o is None for o in out):
        raise ContentionError(f"a copy stream failed: {errors[0] if errors else 'no result'!r}. "
                              "Hint: lower nbytes if memory ran out (each stream holds 2 × nbytes)")
    return out


# ---- GPU: k CUDA streams share PCIe (h2d) or HBM (d2d) -------------------------------------------------


def _gpu_round(pairs, seconds: float, single_copy_s: float, count_once: bool) -> list[dict]:
    """One round on ``len(pairs)`` CUDA streams, held by a gate kernel until every copy is queued.

    Each stream makes ``iters`` copies, sized so that the round lasts ~``seconds`` if the streams share
    the link fairly. Times come from CUDA events; ``start``/``end`` are seconds after the gate opens.
    """
    k = len(pairs)
    nbytes = pairs[0][0].numel() * pairs[0][0].element_size()
    per_copy = nbytes if count_once else 2 * nbytes
    iters = max(2, round(seconds / (k * single_copy_s)))
    streams = [torch.cuda.Stream() for _ in range(k)]
    gate_stream = torch.cuda.Stream()
    gate = torch.cuda.Event(enable_timing=True)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(k)]
    torch.cuda.synchronize()
    with torch.cuda.stream(gate_stream):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles: time to queue every copy
        gate.record()
    for s, (src, dst), e0, e1 in zip(streams, pairs, starts, ends):
        s.wait_event(gate)
        with torch.cuda.stream(s):
            e0.record()
            for _ in range(iters):
                dst.copy_(src, non_blocking=True)
            e1.record()
    torch.cuda.synchronize()
    return [{"bytes": iters * per_copy, "start": gate.elapsed_time(e0) / 1e3, "end": gate.elapsed_time(e1) / 1e3}
            for e0, e1 in zip(starts, ends)]


def _buffers(kind: str, k: int, nbytes: int):
    """``k`` (src, dst) pairs of ``nbytes`` each: float32 in CPU memory (copy), pinned host → device
    uint8 (h2d) or device → device uint8 (d2d)."""
    if kind == "copy":
        return [(torch.ones(nbytes // 4), torch.zeros(nbytes // 4)) for _ in range(k)]
    if kind == "h2d":
        return [(torch.ones(nbytes, dtype=torch.uint8, pin_memory=True),
                 torch.zeros(nbytes, dtype=torch.uint8, device="cuda")) for _ in range(k)]
    return [(torch.ones(nbytes, dtype=torch.uint8, device="cuda"),
             torch.zeros(nbytes, dtype=torch.uint8, device="cuda")) for _ in range(k)]


def _row(k: int, streams: list[dict]) -> dict:
    per = [s["bytes"] / (s["end"] - s["start"]) for s in streams]
    wall = max(s["end"] for s in streams) - min(s["start"] for s in streams)
    return {"k": k, "aggregate": sum(s["bytes"] for s in streams) / wall, "per_mean": float(np.mean(per)),
            "per_min": float(np.min(per)), "per_max": float(np.max(per)), "wall_s": wall,
            "bytes": sum(s["bytes"] for s in streams)}


def sweep(ks=KS, nbytes: int | None = None, seconds: float | None = None, *, kind: str | None = None,
          repeats: int = 2) -> list[dict]:
    """Aggregate and per-transfer bandwidth of ``k`` concurrent copy streams sharing one link, per k.

    Args:
        ks: an iterable of stream counts (ints >= 1), one round each (default ``(1, 2, 4, 8)``).
        nbytes: bytes of each stream's buffer (default :func:`teraflops.sizing.preset`'s
            ``copies.contention_bytes``: 64 MiB on CPU, 256 MiB on a GPU, 4 MiB at ``tiny``). Memory used:
            ``2 × nbytes × max(ks)`` (pinned host memory for ``kind="h2d"``).
        seconds: length of one round (default the preset's ``copies.contention_seconds``: 0.8 s on CPU, 0.5 s
            on a GPU, 0.1 s at ``tiny``).
        kind: ``"copy"`` (CPU memory copies; the default on CPU), ``"h2d"`` (pinned host → GPU over
            PCIe; the default on a GPU) or ``"d2d"`` (GPU memory copies). See the module doc.
        repeats: rounds per k; the one with the highest aggregate is kept.

    Returns:
        One dict per k, in the order of ``ks``: ``k``; ``aggregate``, ``per_mean``, ``per_min``,
        ``per_max`` (bytes/s); ``wall_s`` (s), ``bytes`` (moved in the kept round); ``single`` (bytes/s
        of one stream timed alone by :func:`teraflops.timing.benchmark`: the reference line of
        :func:`plot_contention`; with one torch thread on CPU); ``kind``, ``nbytes``, ``device``,
        ``cores`` (CPU cores of this machine).
        On CPU ~``len(ks) × repeats × seconds`` + ~2 s (buffers and the reference): ~9 s by default.

    Raises:
        ContentionError: bad ``ks``/``nbytes``/``seconds``/``repeats``/``kind``, ``"h2d"``/``"d2d"``
            without a GPU, or a copy stream that failed.
    """
    machine = detect()
    kind = kind or ("h2d" if machine.device == "cuda" else "copy")
    if nbytes is None or seconds is None:
        p = preset()
        nbytes = p.copies.contention_bytes if nbytes is None else nbytes
        seconds = p.copies.contention_seconds if seconds is None else seconds
    ks = _check(ks, nbytes, seconds, repeats, kind, machine.device)
    threads = torch.get_num_threads()
    pairs = _buffers(kind, max(ks), nbytes)
    rows = []
    try:
        if kind == "copy":
            torch.set_num_threads(1)  # one core per copy stream, as a process would have it
            single = measure_copy_bandwidth(nbytes, "cpu", min_run_time=0.3)
        else:
            src, dst = pairs[0]
            t1 = benchmark(lambda: dst.copy_(src, non_blocking=True), min_run_time=0.2).median
            single = (nbytes if kind == "h2d" else 2 * nbytes) / t1
        for k in ks:
            rounds = [_row(k, _cpu_round(pairs[:k], seconds) if kind == "copy"
                           else _gpu_round(pairs[:k], seconds, t1, kind == "h2d")) for _ in range(repeats)]
            rows.append(max(rounds, key=lambda r: r["aggregate"]))
    finally:
        torch.set_num_threads(threads)
        del pairs
    extra = {"single": single, "kind": kind, "nbytes": nbytes, "device": machine.device, "cores": machine.cpu_cores}
    return [{**r, **extra} for r in rows]


# ---- showing it ----------------------------------------------------------------------------------------

_LINK = {"copy": "the memory bus", "h2d": "PCIe (pinned host → GPU)", "d2d": "GPU memory (HBM)"}


def contention_table(rows: list[dict]) -> str:
    """One line per k: aggregate GB/s, its ratio to one stream alone, per-transfer GB/s mean / min / max.
    A header names the link and the byte counting; on CPU, a note when k exceeds the cores.

    Raises:
        ContentionError: no rows.
    """
    if not rows:
        raise ContentionError("contention_table got no rows. Hint: pass the list that sweep() returns")
    r0 = rows[0]
    counting = "bytes crossing PCIe" if r0["kind"] == "h2d" else "read + write, 2 × bytes per copy"
    head = (f"# {max(r['k'] for r in rows)} streams at most sharing {_LINK[r0['kind']]}; {r0['nbytes'] / 2**20:g} MiB "
            f"per copy; GB/s with GB = 1e9 bytes ({counting}); one stream alone: {r0['single'] / GB:.3g} GB/s")
    body = table([(r["k"], r["aggregate"] / GB, r["aggregate"] / r0["single"], r["per_mean"] / GB, r["per_min"] / GB,
                   r["per_max"] / GB) for r in rows],
                 ["k streams", "aggregate (GB/s)", "× one stream", "per-transfer mean", "min", "max"])
    notes = []
    if r0["device"] == "cpu" and any(r["k"] > r0["cores"] for r in rows):
        notes.append(f"# note: this machine has {r0['cores']} cores: with k > {r0['cores']} the streams share the cores "
                     "too (time-sliced), so cores and memory bus together set the plateau")
    return "\n".join([head, body] + notes)


def plot_contention(rows: list[dict], ax=None):
    """Aggregate and per-transfer (mean, with min-max bars) GB/s against k, with the single-stream copy
    bandwidth as a dashed reference line; x logarithmic in base 2. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 4.2))
    k = [r["k"] for r in rows]
    mean = np.array([r["per_mean"] for r in rows]) / GB
    lo, hi = mean - np.array([r["per_min"] for r in rows]) / GB, np.array([r["per_max"] for r in rows]) / GB - mean
    ax.plot(k, [r["aggregate"] / GB for r in rows], "o-", label="aggregate (all streams' bytes / wall time)")
    ax.errorbar(k, mean, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], fmt="s-", capsize=3,
                label="per transfer (one stream's bytes / its time; bars: min-max)")
    ax.axhline(rows[0]["single"] / GB, color="gray", ls="--", lw=1,
               label=f"one stream alone: {rows[0]['single'] / GB:.3g} GB/s")
    if rows[0]["device"] == "cpu" and max(k) > rows[0]["cores"]:
        ax.axvline(rows[0]["cores"], color="gray", ls=":", lw=1)
        ax.annotate(f"{rows[0]['cores']} cores", (rows[0]["cores"], 0), xycoords=("data", "axes fraction"),
                    xytext=(3, 5), textcoords="offset points", fontsize="small", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_xticks(k, [str(x) for x in k])
    ax.set_ylim(bottom=0)
    ax.set(xlabel="k concurrent copy streams", ylabel="bandwidth (GB/s)",
           title=f"Contention for {_LINK[rows[0]['kind']]}: the total plateaus, each stream's share falls")
    ax.legend(fontsize="small", loc="center right")
    fig.tight_layout()
    return fig
