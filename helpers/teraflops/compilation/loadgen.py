"""Load on the real server from Triton's own load generator, ``perf_analyzer``, and the numbers it reads.

``perf_analyzer`` (https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/perf_analyzer/README.html,
shipped as a binary in the ``tritonclient`` wheel) keeps ``concurrency`` requests in flight (closed loop:
each client sends its next request when the last returns) or sends ``request_rate`` requests per second
(open loop, Poisson gaps with ``--request-distribution poisson``), measures in windows until three in a row
agree within ``--stability-percentage``, and reports client throughput, p50/p90/p95/p99 latency and the
server's own split of a request's time (queue, compute input/infer/output) from Triton's statistics API.
:func:`measure` runs it once per point (its ``-f`` CSV is parsed, times in µs there, ms here) and reads the
batch sizes Triton really executed from the metrics endpoint: the growth of ``nv_inference_count``
(requests' batch entries) over the growth of ``nv_inference_exec_count`` (executions) during the run.

On a shared 2-core machine the windows rarely agree within perf_analyzer's default 10 %: the points here
accept 100 % and say so (``stability_pct``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from teraflops.compilation.serving import SINGLE, ServingError
from teraflops.tables import table

FIX = 'pip install -e ".[serving]" (its tritonclient[all]==2.51.0 ships perf_analyzer) and apt-get install libb64-0d'


@dataclass(frozen=True)
class LoadPoint:
    """One perf_analyzer measurement (times in ms).

    Attributes:
        model: the served model (``decode_batched`` or ``decode_single``).
        concurrency: requests kept in flight (closed loop), or None. request_rate: requests/s offered (open
            loop, Poisson), or None.
        throughput_rps: requests served per second (client side). tokens_per_s: × new tokens per request.
        p50_ms, p90_ms, p99_ms: client latency percentiles. queue_ms, compute_ms: the server's mean queue time
            and compute (infer) time per request. network_ms: client send/recv + network/server hand-off.
        executed_batch: mean batch size Triton executed (metrics endpoint), over the whole run.
        requests, executions: counted on the metrics endpoint over the run.
    """

    model: str
    concurrency: int | None
    request_rate: float | None
    throughput_rps: float
    tokens_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    queue_ms: float
    compute_ms: float
    network_ms: float
    executed_batch: float
    requests: int
    executions: int


def binary() -> str | None:
    """The ``perf_analyzer`` next to this interpreter (the venv's ``bin``) or on ``PATH``, or None."""
    here = Path(sys.executable).parent / "perf_analyzer"
    return str(here) if here.exists() else shutil.which("perf_analyzer")


def _cudart_lib() -> str | None:
    """The ``nvidia-cuda-runtime-cu12`` wheel's ``lib`` folder (perf_analyzer links ``libcudart.so.12``)."""
    try:
        import nvidia.cuda_runtime as cr  # lazy: a wheel of the serving extra, only for its folder
    except ImportError:
        return None
    return str(Path(list(cr.__path__)[0]) / "lib")


def env() -> dict:
    """The environment perf_analyzer runs in: ``LD_LIBRARY_PATH`` with the CUDA runtime wheel's ``lib``."""
    lib = _cudart_lib()
    rest = os.environ.get("LD_LIBRARY_PATH", "")
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(x for x in (lib, rest) if x)}


def why_not() -> str | None:
    """One line on why perf_analyzer cannot run here (missing, or a library it links is missing), or None."""
    path = binary()
    if path is None:
        return f"perf_analyzer is not installed. Fix: {FIX}"
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=20, env=env()).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None  # no ldd: let it try
    missing = [line.split()[0] for line in out.splitlines() if "not found" in line]
    if missing:
        return f"perf_analyzer cannot load {', '.join(missing)}. Fix: {FIX}"
    return None


def check() -> None:
    """Raise :class:`ServingError` (one line, :func:`why_not`) unless perf_analyzer runs here."""
    reason = why_not()
    if reason:
        raise ServingError(reason)


def _input_file(folder: Path, server, n: int = 16, seed: int = 0) -> Path:
    """A perf_analyzer ``--input-data`` file: ``n`` prompts of token ids drawn in the vocabulary (its own random
    int64 data would be ids out of range)."""
    rng = np.random.default_rng(seed)
    vocab = server.p.decode.vocab
    data = [{"prompt": {"content": rng.integers(0, vocab, server.prompt_len).tolist(), "shape": [server.prompt_len]}}
            for _ in range(n)]
    path = folder / "prompts.json"
    path.write_text(json.dumps({"data": data}))
    return path


def parse_csv(text: str) -> dict[str, float]:
    """The first data row of perf_analyzer's ``-f`` CSV as ``{column: value}`` (µs for times)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise ServingError("perf_analyzer wrote no measurement row")
    return {k.strip(): float(v) for k, v in rows[0].items() if k and v not in (None, "")}


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def measure(server, model: str, *, concurrency: int | None = None, request_rate: float | None = None,
            interval_ms: int = 600, stability_pct: int = 100, max_trials: int = 8, timeout: float = 120,
            retries: int = 1) -> LoadPoint:
    """One perf_analyzer run against ``server`` (a started :class:`teraflops.compilation.serving.Server`) on ``model``,
    at ``concurrency`` clients or ``request_rate`` requests/s (one of them), over HTTP with the server's token.
    When its windows never agree ("Failed to obtain stable measurement", common on a busy machine) it is run again
    up to ``retries`` times with windows twice as long.

    Raises:
        ServingError: perf_analyzer missing (:func:`why_not`), neither or both load settings, or its run failed
            (its last line, e.g. "Failed to obtain stable measurement": a longer ``interval_ms``).
    """
    check()
    if (concurrency is None) == (request_rate is None):
        raise ServingError("give exactly one of concurrency= (clients) or request_rate= (requests/s)")
    for attempt in range(retries + 1):
        try:
            return _measure(server, model, concurrency, request_rate, interval_ms * 2 ** attempt, stability_pct,
                            max_trials, timeout)
        except _Unstable as e:
            if attempt == retries:
                raise ServingError(str(e)) from None
    raise AssertionError("unreachable")


class _Unstable(Exception):
    pass


def _measure(server, model, concurrency, request_rate, interval_ms, stability_pct, max_trials, timeout) -> LoadPoint:
    with tempfile.TemporaryDirectory(prefix="teraflops-perf-") as tmp:
        folder = Path(tmp)
        load = (["--concurrency-range", str(int(concurrency))] if concurrency is not None else
                ["--request-rate-range", f"{float(request_rate):g}", "--request-distribution", "poisson"])
        cmd = [binary(), "-m", model, "-u", server.url, "-i", "http", *load,
               "--measurement-interval", str(interval_ms), "--stability-percentage", str(stability_pct),
               "--max-trials", str(max_trials), "-H", f"triton-access-token:{server.token}",
               "--input-data", str(_input_file(folder, server)), "-f", str(folder / "out.csv")]
        before = server.metrics().get(model, {})
        try:
            run = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ServingError(f"perf_analyzer on {model} did not finish within {timeout:g} s") from None
        after = server.metrics().get(model, {})
        if run.returncode != 0 or not (folder / "out.csv").exists():
            last = [x for x in (run.stdout + run.stderr).splitlines() if x.strip()]
            why = (f"perf_analyzer on {model} failed (status {run.returncode}, {interval_ms} ms windows): "
                   f"{last[-1].strip() if last else 'no output'}")
            raise (_Unstable if "stable measurement" in why else ServingError)(why)
        row = parse_csv((folder / "out.csv").read_text())
    requests, executions = _delta(before, after, "nv_inference_count"), _delta(before, after, "nv_inference_exec_count")
    rps = row["Inferences/Second"]
    return LoadPoint(
        model=model, concurrency=concurrency, request_rate=request_rate, throughput_rps=rps,
        tokens_per_s=rps * server.new_tokens, p50_ms=row["p50 latency"] / 1e3, p90_ms=row["p90 latency"] / 1e3,
        p99_ms=row["p99 latency"] / 1e3, queue_ms=row["Server Queue"] / 1e3, compute_ms=row["Server Compute Infer"] / 1e3,
        network_ms=(row["Client Send"] + row["Network+Server Send/Recv"] + row["Client Recv"]) / 1e3,
        executed_batch=requests / executions if executions else float("nan"), requests=int(requests),
        executions=int(executions))


def sweep(server, model: str, concurrencies=(), rates=(), **kw) -> list[LoadPoint]:
    """:func:`measure` at each concurrency, then at each request rate."""
    return ([measure(server, model, concurrency=c, **kw) for c in concurrencies]
            + [measure(server, model, request_rate=r, **kw) for r in rates])


def knee(points: list[LoadPoint], slack: float = 0.1) -> LoadPoint:
    """The latency/throughput knee of a concurrency sweep, found from the measurement: the point of lowest p99
    among those within ``slack`` (10 %) of the highest throughput measured. Past it more clients add latency,
    not throughput (Little's law: in-flight = throughput × latency)."""
    if not points:
        raise ServingError("knee() needs measured points")
    best = max(p.throughput_rps for p in points)
    return min((p for p in points if p.throughput_rps >= (1 - slack) * best), key=lambda p: p.p99_ms)


def execution_overhead(point: LoadPoint, latency) -> float:
    """Seconds the server adds to each execution beyond the model's own work, from one closed-loop point of
    the model served without batching (``decode_single``, ``concurrency >= 2``).

    With two or more clients in a closed loop the server is never idle and runs one request per execution,
    so each execution lasts ``1 / throughput``; the model's work in it is ``latency(1)``, timed inside the
    server process (:attr:`teraflops.compilation.serving.Server.latency`). The difference is what Triton
    spends per execution around the model: reading the request, handing it to the Python backend's
    process over shared memory and back, writing the response. Clamped at 0 (a noisy point can read
    faster than the in-process time). Calibrated on this one point, it is then a fixed cost per
    execution in the queueing model (:meth:`~teraflops.compilation.batching.BatchLatency.plus`).

    Raises:
        ServingError: the point is not a closed loop of ``decode_single`` with at least 2 clients.
    """
    if point.model != SINGLE or point.concurrency is None or point.concurrency < 2 or not point.throughput_rps > 0:
        raise ServingError(f"execution_overhead() needs a closed-loop point of {SINGLE} with >= 2 clients and a "
                           f"throughput; got {point.model} at concurrency {point.concurrency}, "
                           f"{point.throughput_rps} req/s. Hint: loadgen.sweep(server, serving.SINGLE, concurrencies=(16,))")
    return max(0.0, 1.0 / point.throughput_rps - latency(1))


def rate_knee(points: list[LoadPoint], keep_up: float = 0.9) -> LoadPoint | None:
    """The knee of a request-rate sweep (open loop), found from the measurement: the highest offered rate the
    server still serves, ``throughput_rps >= keep_up × request_rate`` (90 %: a Poisson stream's count over a
    few seconds varies by several %). Past it requests arrive faster than they leave, the queue grows for as
    long as they arrive, and latency grows with it (an M/G/1-like queue at utilisation ≥ 1). ``None`` when no
    measured rate kept up; closed-loop points (``request_rate`` None) are ignored."""
    kept = [p for p in points if p.request_rate is not None and p.throughput_rps >= keep_up * p.request_rate]
    return max(kept, key=lambda p: p.request_rate) if kept else None


def load_table(points: list[LoadPoint]) -> str:
    """The points as a text table (the load, served requests/s, tokens/s, latency percentiles, the server's split, the
    executed batch)."""
    return table([(p.model, p.concurrency if p.concurrency is not None else f"{p.request_rate:g}/s", p.throughput_rps,
                   p.tokens_per_s, p.p50_ms, p.p99_ms, p.queue_ms, p.compute_ms, p.executed_batch) for p in points],
                 ["model", "load", "req/s", "tokens/s", "p50 ms", "p99 ms", "queue ms", "compute ms", "exec batch"])
