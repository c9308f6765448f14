"""Dynamic batching: a model server as a discrete-event simulation driven by measured latencies.

A GPU runs a batch of B requests in much less than B times the time of one, because a small
forward pass is bound by reading the weights, not by arithmetic: batching is how a server turns
spare FLOPs into throughput. But a request that arrives to an idle server must either go alone
(wasting that capacity) or wait for company (adding latency). Dynamic batching, as in NVIDIA
Triton Inference Server's dynamic batcher
(https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/user_guide/model_configuration.html#dynamic-batcher)
or TorchServe's ``maxBatchDelay``, bounds both: a batch starts when ``max_batch`` requests wait,
or when the oldest has waited ``max_wait`` seconds, whichever comes first.

The model (times in seconds):

* **Latency** of one call on a batch of B comes from measurement: :func:`measure_batch_latency`
  times the model at a few batch sizes, and :class:`BatchLatency` interpolates piecewise
  linearly between the measured sizes (no extrapolation beyond them). Any callable
  ``latency(B) -> seconds`` works too (the tests use hand-written ones).
* **Requests** arrive as a Poisson process of ``rate`` per second (exponential gaps from a seeded
  NumPy generator), or evenly spaced with ``arrivals="uniform"``, for ``duration`` seconds. Each
  request needs **one call** of the model (e.g. one forward pass over its prompt, or one step of a
  classifier or embedding model) and yields ``tokens_per_request`` tokens for the throughput and
  cost numbers. Generating many tokens per request needs the batch to change between decode steps
  (continuous batching), which this simple server does not do.
* **One server** (one GPU) runs one batch at a time, first come first served. When it is free it
  takes ``min(queue, max_batch)`` requests as soon as ``max_batch`` wait or the oldest has waited
  ``max_wait``; otherwise it waits for whichever happens first. The batch then takes
  ``latency(B)`` seconds, and all its requests finish together.
* A request's **latency** is finish − arrival: queueing (waiting for company and for the
  server) plus service. Percentiles use NumPy's default (linear) interpolation.

SimPy (https://simpy.readthedocs.io) keeps the clock and the events; the batcher and the
statistics are the course's code.
"""

from __future__ import annotations

import bisect
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import simpy
import torch

from teraflops import plots, widgets
from teraflops.errors import CourseError
from teraflops.models import GPT
from teraflops.tables import table
from teraflops.timing import benchmark, format_seconds

__all__ = ["BatchingError", "BatchLatency", "measure_batch_latency", "ServerResult", "simulate_server", "simulate_clients", "sweep",
           "batching_table", "plot_tradeoff", "cost_per_million_tokens", "dynamic_batch_policy"]


class BatchingError(CourseError, ValueError):
    """A bad setting for the batching server, explained in one line with a hint."""


# --------------------------------------------------------------------------- measured latency

@dataclass(frozen=True)
class BatchLatency:
    """Measured seconds per call at a few batch sizes, and a piecewise-linear model between them.

    Attributes:
        batch_sizes: strictly increasing batch sizes, the first 1.
        seconds: median seconds per call at each batch size (measured).
        spread: interquartile range / median of each measurement (0.05 = ±5 % noise).
        label: what was measured (model, input shape, device).

    ``latency(b)`` for an integer ``1 <= b <= max(batch_sizes)``: the measured time where ``b`` was
    measured, else the straight line between the two measured sizes either side. Raises
    :class:`BatchingError` outside the measured range: measure the sizes you simulate.
    """

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    spread: tuple[float, ...] = ()
    label: str = ""

    def __post_init__(self):
        bs, s = tuple(int(b) for b in self.batch_sizes), tuple(float(x) for x in self.seconds)
        if not bs or len(bs) != len(s):
            raise BatchingError(f"BatchLatency needs one time per batch size; got {len(bs)} sizes and {len(s)} "
                                "times. Hint: measure_batch_latency() builds one")
        if bs[0] != 1 or any(b >= c for b, c in zip(bs, bs[1:])):
            raise BatchingError(f"batch sizes must be strictly increasing and start at 1; got {bs}. "
                                "Hint: e.g. (1, 2, 4, 8, 16, 32)")
        if any(not x > 0 for x in s):
            raise BatchingError(f"latencies must be > 0 seconds; got {s}")
        object.__setattr__(self, "batch_sizes", bs)
        object.__setattr__(self, "seconds", s)

    @property
    def max_batch(self) -> int:
        """The largest measured batch size: the largest ``max_batch`` a simulation may use."""
        return self.batch_sizes[-1]

    def __call__(self, b: int) -> float:
        if not 1 <= b <= self.max_batch:
            raise BatchingError(f"batch size {b} is outside the measured range 1..{self.max_batch}. "
                                f"Hint: measure_batch_latency(batch_sizes=...) up to {b}")
        i = bisect.bisect_left(self.batch_sizes, b)
        if self.batch_sizes[i] == b:
            return self.seconds[i]
        (b0, t0), (b1, t1) = (self.batch_sizes[i - 1], self.seconds[i - 1]), (self.batch_sizes[i], self.seconds[i])
        return t0 + (t1 - t0) * (b - b0) / (b1 - b0)

    def plus(self, overhead_s: float, what: str = "per call") -> "BatchLatency":
        """The same latencies with ``overhead_s`` seconds (>= 0) added to every call: a server's fixed cost
        per execution (request handling, the hand-off to the model's process) on top of the model's work."""
        if isinstance(overhead_s, bool) or not isinstance(overhead_s, (int, float)) or not 0 <= overhead_s < 60:
            raise BatchingError(f"overhead_s must be seconds in [0, 60); got {overhead_s!r}")
        return BatchLatency(self.batch_sizes, tuple(t + overhead_s for t in self.seconds), self.spread,
                            f"{self.label} + {format_seconds(overhead_s)} {what}".strip(" +"))

    def rows(self) -> list[tuple]:
        """``(batch, seconds per call, requests/s at that batch, seconds per request)`` per measured size."""
        return [(b, t, b / t, t / b) for b, t in zip(self.batch_sizes, self.seconds)]

    def __str__(self) -> str:
        head = f"{self.label}\n" if self.label else ""
        return head + table([(b, format_seconds(t), r, format_seconds(p)) for b, t, r, p in self.rows()],
                            ["batch", "time/call", "requests/s", "time/request"])


def _default_model(seq_len: int):
    torch.manual_seed(0)
    model = GPT(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=max(64, seq_len)).eval()
    return model


def measure_batch_latency(model_fn: Callable | None = None, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), *,
                          make_input: Callable[[int], object] | None = None, seq_len: int = 16,
                          device: str | torch.device = "cpu", min_run_time: float = 0.1,
                          threads: int | None = None, label: str | None = None) -> BatchLatency:
    """Measure seconds per call of ``model_fn`` at each batch size (torch.utils.benchmark via
    :func:`teraflops.timing.benchmark`: warm-up, median of repeated blocks, CUDA synchronised).

    Args:
        model_fn: called as ``model_fn(make_input(b))`` under ``torch.inference_mode()``. Default: a
            small :class:`teraflops.models.GPT` (d_model 128, 2 layers, 4 heads, vocabulary 256,
            random weights) in eval mode on ``device``, a full forward pass returning logits.
        batch_sizes: strictly increasing, starting at 1.
        make_input: ``b -> input``; default int64 token ids of shape ``(b, seq_len)`` on ``device``.
            For a decode step pass ``seq_len=1`` (no KV cache here: the step sees one token).
        seq_len: tokens per request for the default input.
        device: where the default model and inputs live.
        min_run_time: seconds of measurement per batch size.
        threads: CPU threads torch uses while measuring (restored afterwards); None keeps the
            current setting. On a busy 2-core machine 2 threads can be far slower than 1
            (oversubscription: a GPT forward measured 150 ms with 2 threads, 2 ms with 1).
        label: describes the measurement in printouts; a default is made up for the default model.

    Returns:
        a :class:`BatchLatency` (callable: ``latency(b)`` in seconds).
    """
    sizes = tuple(int(b) for b in batch_sizes)
    if not sizes or sizes[0] != 1 or any(b >= c for b, c in zip(sizes, sizes[1:])):
        raise BatchingError(f"batch_sizes must be strictly increasing and start at 1; got {sizes}. "
                            "Hint: e.g. (1, 2, 4, 8, 16, 32)")

    if model_fn is None:
        model_fn = _default_model(seq_len).to(device)
        label = label or f"GPT(d_model=128, 2 layers) forward on [B, {seq_len}] tokens, {torch.device(device)}"
    if make_input is None:
        def make_input(b):
            g = torch.Generator().manual_seed(b)
            return torch.randint(0, 256, (b, seq_len), generator=g).to(device)
    seconds, spread = [], []
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        with torch.inference_mode():
            for b in sizes:
                inp = make_input(b)
                t = benchmark(lambda: model_fn(inp), min_run_time=min_run_time)
                seconds.append(t.median)
                spread.append(t.spread)
    finally:
        torch.set_num_threads(old_threads)
    return BatchLatency(sizes, tuple(seconds), tuple(spread), label or getattr(model_fn, "__name__", "model_fn"))


# --------------------------------------------------------------------------- the server

@dataclass(frozen=True)
class ServerResult:
    """What :func:`simulate_server` measured. Times in seconds.

    Attributes:
        requests: requests served (all that arrived; the simulation runs until the queue drains).
        makespan_s: first arrival to last finish.
        throughput_rps: requests / makespan_s.
        tokens_per_s: throughput_rps × tokens_per_request.
        p50_s, p99_s, mean_s: latency (finish − arrival) percentiles and mean.
        mean_queue_s: mean time from arrival to the start of the request's batch.
        mean_batch: mean batch size over batches.
        batches: number of batches run.
        utilisation: fraction of the makespan the server was busy.
        latencies: per request latency, in arrival order.
        batch_sizes: size of each batch, in order.
    """

    requests: int
    makespan_s: float
    throughput_rps: float
    tokens_per_s: float
    p50_s: float
    p99_s: float
    mean_s: float
    mean_queue_s: float
    mean_batch: float
    batches: int
    utilisation: float
    latencies: tuple[float, ...]
    batch_sizes: tuple[int, ...]


def _arrival_times(rate: float, duration: float, seed: int, arrivals: str) -> np.ndarray:
    if arrivals == "uniform":
        return np.arange(0.0, duration, 1.0 / rate)
    rng = np.random.default_rng(seed)
    n = int(rate * duration * 1.5 + 20)  # enough gaps; extended below if not
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    while t[-1] < duration:
        t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return t[t < duration]


def _real(x) -> float | None:
    """``x`` as a float if it is a real number (Python, NumPy or a one-element tensor), else None."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        return None
    return float(x)


def _check(rate, max_batch, max_wait, duration, arrivals, latency):
    if isinstance(max_batch, (bool, np.bool_)) or not (isinstance(max_batch, (int, np.integer)) and max_batch >= 1):
        raise BatchingError(f"max_batch must be an integer >= 1; got {max_batch!r}")
    r, w, d = _real(rate), _real(max_wait), _real(duration)
    if r is None or not 0 < r < float("inf"):
        raise BatchingError(f"rate must be a number > 0 (requests per second); got {rate!r}")
    if w is None or not 0 <= w < float("inf"):
        raise BatchingError(f"max_wait must be a number >= 0 (seconds); got {max_wait!r}. Hint: 0 = never wait for company")
    if d is None or not 0 < d < float("inf"):
        raise BatchingError(f"duration must be a number > 0 (seconds); got {duration!r}")
    if arrivals not in ("poisson", "uniform"):
        raise BatchingError(f"arrivals must be 'poisson' or 'uniform'; got {arrivals!r}")
    if not callable(latency):
        raise BatchingError(f"latency must be a callable batch size -> seconds (e.g. a BatchLatency); "
                            f"got {type(latency).__name__}")
    if isinstance(latency, BatchLatency) and max_batch > latency.max_batch:
        raise BatchingError(f"max_batch={max_batch} is larger than the largest measured batch "
                            f"({latency.max_batch}). Hint: measure_batch_latency(batch_sizes=...) up to {max_batch}")


def dynamic_batch_policy(waiting: Sequence[float], now: float, max_batch: int, max_wait: float) -> int:
    """The dynamic batcher's decision when the server is free: how many waiting requests to start now.

    Args:
        waiting: arrival times (seconds) of the requests in the queue, oldest first (non-empty).
        now: the current time (seconds, same clock).
        max_batch: the largest batch the server runs.
        max_wait: seconds the oldest request may wait for company.

    Returns:
        ``min(len(waiting), max_batch)`` if at least ``max_batch`` wait or the oldest has waited
        ``max_wait`` (``now - waiting[0] >= max_wait``); else 0 (wait for the next arrival or the
        deadline ``waiting[0] + max_wait``, whichever comes first). The rule of Triton Inference
        Server's dynamic batcher (``max_queue_delay_microseconds``; see the module docstring).
    """
    if len(waiting) >= max_batch or now - waiting[0] >= max_wait:
        return min(len(waiting), max_batch)
    return 0


def _ask(policy, waiting: np.ndarray, now: float, max_batch: int, max_wait: float) -> int:
    """The policy's answer, validated: an int in [0, min(len(waiting), max_batch)]."""
    n = policy(waiting.tolist(), float(now), int(max_batch), float(max_wait))
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise BatchingError(f"the policy returned {n!r} ({type(n).__name__}); it must return an int, the number "
                            "of waiting requests to start now (0 = keep waiting)")
    if not 0 <= n <= min(len(waiting), max_batch):
        raise BatchingError(f"the policy returned {n} with {len(waiting)} waiting and max_batch={max_batch}; it "
                            f"must be between 0 and min(len(waiting), max_batch) = {min(len(waiting), max_batch)}")
    return int(n)


def simulate_server(latency: Callable[[int], float], rate: float, max_batch: int, max_wait: float,
                    duration: float = 10.0, seed: int = 0, *, tokens_per_request: int = 1,
                    arrivals: str = "poisson", arrival_times: Sequence[float] | None = None,
                    policy: Callable[[Sequence[float], float, int, float], int] = dynamic_batch_policy) -> ServerResult:
    """Simulate one dynamic-batching server; see the module docstring for the model.

    Args:
        latency: ``latency(B) -> seconds`` for one call on a batch of B (a :class:`BatchLatency`).
        rate: requests per second offered.
        max_batch: start a batch as soon as this many requests wait (and never run a bigger one).
        max_wait: seconds the oldest waiting request may wait for company before its batch starts
            anyway (0: start whatever waits as soon as the server is free).
        duration: seconds during which requests arrive; the simulation then drains the queue.
        seed: seeds the Poisson arrivals (same seed, same arrivals, same result).
        tokens_per_request: tokens one request's call produces or processes (for tokens/s).
        arrivals: ``"poisson"`` (exponential gaps) or ``"uniform"`` (every 1/rate s, from t=0).
        arrival_times: explicit arrival times in seconds (overrides rate, arrivals and duration's
            role in making arrivals; ``rate`` is still validated). Useful for hand-made cases.
        policy: ``policy(waiting, now, max_batch, max_wait) -> n``, asked whenever the server is free
            and a request waits (on every arrival and at the oldest request's deadline
            ``waiting[0] + max_wait``): start the ``n`` oldest now, or 0 to keep waiting. Default
            :func:`dynamic_batch_policy`; the lab's exercise writes one.

    Returns:
        a :class:`ServerResult`.

    Raises:
        BatchingError: a setting out of range, ``max_batch`` beyond the measured batch sizes, or a
            ``policy`` answer that is not an integer in ``[0, min(len(waiting), max_batch)]``, or 0
            once the oldest request's deadline has passed (it would wait forever).
    """
    _check(rate, max_batch, max_wait, duration, arrivals, latency)
    if not callable(policy):
        raise BatchingError(f"policy must be a function (waiting, now, max_batch, max_wait) -> int; "
                            f"got {type(policy).__name__}")
    rate, max_wait, duration, max_batch = _real(rate), _real(max_wait), _real(duration), int(max_batch)
    if arrival_times is not None:
        times = np.sort(np.asarray(arrival_times, dtype=float))
        if times.size and not (times[0] >= 0 and np.isfinite(times[-1])):
            raise BatchingError("arrival_times must be finite numbers >= 0 (seconds)")
    else:
        times = _arrival_times(float(rate), float(duration), seed, arrivals)
    if times.size == 0:
        raise BatchingError(f"no request arrived in {duration} s at {rate} requests/s. Hint: a longer duration")

    env = simpy.Environment()
    queue: list[int] = []  # indices of waiting requests, oldest first
    start = np.zeros(times.size)
    finish = np.zeros(times.size)
    sizes: list[int] = []
    busy = [0.0]
    state = {"arrived": env.event()}

    def arrive():
        for i, t in enumerate(times):
            yield env.timeout(t - env.now)
            queue.append(i)
            ev, state["arrived"] = state["arrived"], env.event()
            ev.succeed()

    def server():
        served = 0
        while served < times.size:
            if not queue:
                yield state["arrived"]
                continue
            deadline = times[queue[0]] + max_wait
            # (a tolerance: now + (deadline - now) can round to just below deadline)
            now = env.now if env.now < deadline - 1e-12 * max(1.0, deadline) else max(env.now, deadline)
            while now >= deadline and now - times[queue[0]] < max_wait:  # so both ways of asking agree
                now = float(np.nextafter(now, np.inf))
            n = _ask(policy, times[queue], now, max_batch, max_wait)
            if n == 0:
                if now >= deadline:
                    raise BatchingError(f"the policy started nothing although the oldest request has waited "
                                        f"max_wait={max_wait} s: it would wait forever. Hint: once "
                                        "now - waiting[0] >= max_wait, start the batch")
                yield state["arrived"] | env.timeout(deadline - env.now)
                continue
            batch, queue[:] = queue[:n], queue[n:]
            b = len(batch)
            service = _real(latency(b))
            if service is None or not service > 0:
                raise BatchingError(f"latency({b}) returned {service!r}; it must be > 0 seconds")
            start[batch] = env.now
            yield env.timeout(service)
            finish[batch] = env.now
            busy[0] += service
            sizes.append(b)
            served += b

    env.process(arrive())
    env.process(server())
    env.run()

    lat = finish - times
    span = float(finish.max() - times.min())
    n = int(times.size)
    rps = n / span if span > 0 else float("inf")
    return ServerResult(
        requests=n, makespan_s=span, throughput_rps=rps, tokens_per_s=rps * tokens_per_request,
        p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)), mean_s=float(lat.mean()),
        mean_queue_s=float((start - times).mean()), mean_batch=float(np.mean(sizes)), batches=len(sizes),
        utilisation=busy[0] / span if span > 0 else 1.0, latencies=tuple(lat.tolist()), batch_sizes=tuple(sizes))


def simulate_clients(latency: Callable[[int], float], clients: int, max_batch: int, max_wait: float,
                     duration: float = 10.0, *, overhead_s: float = 0.0, tokens_per_request: int = 1) -> ServerResult:
    """Closed-loop load, as ``perf_analyzer --concurrency-range N`` makes it: ``clients`` clients each send a
    request, wait for its answer and send the next at once, for ``duration`` seconds of simulated time; one
    dynamic-batching server (:func:`dynamic_batch_policy`) runs ``latency(B) + overhead_s`` per batch
    (``overhead_s``: a fixed cost per execution the latency model leaves out, e.g. a server's hand-off).

    Returns a :class:`ServerResult` over the requests that finished (``throughput_rps`` = finished / duration).

    Raises:
        BatchingError: ``clients`` not an integer >= 1, or a setting :func:`simulate_server` refuses.
    """
    if isinstance(clients, bool) or not isinstance(clients, (int, np.integer)) or clients < 1:
        raise BatchingError(f"clients must be an integer >= 1; got {clients!r}")
    _check(1.0, max_batch, max_wait, duration, "poisson", latency)
    env = simpy.Environment()
    queue: list[tuple[float, simpy.Event]] = []
    arrived = [env.event()]
    done: list[tuple[float, float, float]] = []  # arrival, start, finish
    sizes: list[int] = []
    busy = [0.0]

    def client():
        while env.now < duration:
            answer = env.event()
            queue.append((env.now, answer))
            ev, arrived[0] = arrived[0], env.event()
            ev.succeed()
            yield answer

    def server():
        while True:
            if not queue:
                yield arrived[0]
                continue
            deadline = queue[0][0] + max_wait  # dynamic_batch_policy's rule, on this clock's deadline
            if len(queue) < max_batch and env.now < deadline:
                yield arrived[0] | env.timeout(deadline - env.now)
                continue
            n = min(len(queue), max_batch)
            batch, queue[:] = queue[:n], queue[n:]
            start, service = env.now, float(latency(len(batch))) + overhead_s
            yield env.timeout(service)
            busy[0] += service
            sizes.append(len(batch))
            for t, answer in batch:
                done.append((t, start, env.now))
                answer.succeed()

    for _ in range(int(clients)):
        env.process(client())
    env.process(server())
    env.run(until=duration)
    if not done:
        raise BatchingError(f"no request finished in {duration} s. Hint: a longer duration")
    arr, st, fin = (np.array(x) for x in zip(*done))
    lat = fin - arr
    rps = len(done) / duration
    return ServerResult(requests=len(done), makespan_s=duration, throughput_rps=rps, tokens_per_s=rps * tokens_per_request,
                        p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)), mean_s=float(lat.mean()),
                        mean_queue_s=float((st - arr).mean()), mean_batch=float(np.mean(sizes)), batches=len(sizes),
                        utilisation=min(1.0, busy[0] / duration), latencies=tuple(lat.tolist()), batch_sizes=tuple(sizes))


# --------------------------------------------------------------------------- sweeps, cost, showing

def cost_per_million_tokens(tokens_per_s: float, price_per_hour: float) -> float:
    """Dollars (or the price's currency) per million tokens for a GPU rented at ``price_per_hour``
    that sustains ``tokens_per_s``: ``price_per_hour / (tokens_per_s × 3600) × 1e6``.

    Assumes the GPU is paid for every hour and kept this busy; idle hours raise the real cost.

    Example:
        >>> cost_per_million_tokens(1000, 3.6)  # 3.6 M tokens an hour for $3.60
        1.0
    """
    if not (tokens_per_s > 0 and price_per_hour >= 0):
        raise BatchingError(f"need tokens_per_s > 0 and price_per_hour >= 0; got {tokens_per_s}, {price_per_hour}")
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


def sweep(latency: Callable[[int], float], rate: float, max_batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
          max_waits: Sequence[float] = (0.0, 0.002, 0.01, 0.05), duration: float = 10.0, seed: int = 0, *,
          tokens_per_request: int = 1, price_per_hour: float | None = None, arrivals: str = "poisson") -> list[dict]:
    """Run :func:`simulate_server` for every ``max_batch`` × ``max_wait`` at one ``rate``, same seed
    (same arrivals) for all, so the rows differ only by the batching policy.

    Returns:
        one dict per setting: ``max_batch``, ``max_wait_s``, ``rate``, ``throughput_rps``,
        ``tokens_per_s``, ``p50_s``, ``p99_s``, ``mean_batch``, ``utilisation``, ``cost_per_m``
        (per million tokens, None without ``price_per_hour``) and the :class:`ServerResult` under
        ``"result"``.
    """
    rows = []
    for mb in max_batches:
        for mw in max_waits:
            r = simulate_server(latency, rate, mb, mw, duration, seed, tokens_per_request=tokens_per_request,
                                arrivals=arrivals)
            cost = None if price_per_hour is None else cost_per_million_tokens(r.tokens_per_s, price_per_hour)
            rows.append(dict(max_batch=mb, max_wait_s=mw, rate=rate, throughput_rps=r.throughput_rps,
                             tokens_per_s=r.tokens_per_s, p50_s=r.p50_s, p99_s=r.p99_s, mean_batch=r.mean_batch,
                             utilisation=r.utilisation, cost_per_m=cost, result=r))
    return rows


def batching_table(rows: list[dict]) -> str:
    """The :func:`sweep` rows as a text table (latencies in ms)."""
    with_cost = any(r.get("cost_per_m") is not None for r in rows)
    headers = ["max batch", "max wait ms", "offered req/s", "served req/s", "tokens/s", "p50 ms", "p99 ms",
               "mean batch", "busy %"] + (["$/M tokens"] if with_cost else [])
    return table([(r["max_batch"], 1e3 * r["max_wait_s"], r["rate"], r["throughput_rps"], r["tokens_per_s"],
                   1e3 * r["p50_s"], 1e3 * r["p99_s"], r["mean_batch"], 100 * r["utilisation"])
                  + ((r["cost_per_m"],) if with_cost else ()) for r in rows], headers)


def plot_tradeoff(rows: list[dict]):
    """Throughput (served requests/s) against p99 latency (ms, log scale): one line per
    ``max_wait`` through the ``max_batch`` values, each point labelled with its max_batch.
    Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = []
    for mw in sorted({r["max_wait_s"] for r in rows}):
        pts = sorted((r for r in rows if r["max_wait_s"] == mw), key=lambda r: r["max_batch"])
        ax.plot([1e3 * r["p99_s"] for r in pts], [r["throughput_rps"] for r in pts], marker="o",
                label=f"max wait {1e3 * mw:g} ms")
        labels += [ax.annotate(str(r["max_batch"]), (1e3 * r["p99_s"], r["throughput_rps"]), textcoords="offset points",
                               xytext=(3, 3), fontsize="x-small") for r in pts]
    if rows:
        ax.axhline(rows[0]["rate"], color="grey", linestyle="--", linewidth=0.8, label="offered rate")
    ax.set(xscale="log", xlabel="p99 latency (ms)", ylabel="served requests/s",
           title="Dynamic batching: throughput vs tail latency (labels: max batch)")
    ax.legend(fontsize="small", frameon=False)
    fig.tight_layout()
    plots.place_labels(ax, labels)  # points of different max_wait sit close: their labels must not collide
    return fig


def batching_widget(latency, tokens_per_request: int = 1, price_per_hour: float = 2.0):
    """Sliders for offered load (× what batch-1 serving sustains), ``max_batch``, ``max_wait`` and
    the GPU's price per hour → the simulated dynamic-batching server
    (:func:`teraflops.compilation.batching.simulate_server`, driven by the measured ``latency``, a
    :class:`~teraflops.compilation.batching.BatchLatency`): served requests/s, p50/p99 latency (ms), mean batch,
    busy fraction, and the cost per million tokens (:func:`teraflops.compilation.batching.cost_per_million_tokens`).

    Returns the ``ipywidgets.interactive``; its ``result`` is the :class:`~teraflops.compilation.batching.ServerResult`."""
    import ipywidgets as W

    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= latency.max_batch]

    def show(load, max_batch, max_wait_ms, price):
        rate = load / latency(1)
        r = simulate_server(latency, rate, max_batch, max_wait_ms / 1e3, duration=min(5.0, 5000 / rate),
                            tokens_per_request=tokens_per_request)
        print(f"offered {rate:,.0f} req/s → served {r.throughput_rps:,.0f} req/s ({r.tokens_per_s:,.0f} tokens/s); "
              f"p50 {r.p50_s * 1e3:.2f} ms, p99 {r.p99_s * 1e3:.2f} ms; mean batch {r.mean_batch:.1f}, "
              f"busy {r.utilisation:.0%}; ${cost_per_million_tokens(r.tokens_per_s, price):.4f} per million tokens "
              f"at ${price:g}/h")
        return r

    ui = W.interactive(show, **widgets.controls(
        load=W.FloatSlider(value=1.5, min=0.1, max=4.0, step=0.1, description="load ×"),
        max_batch=W.SelectionSlider(options=batches, value=batches[min(3, len(batches) - 1)], description="max batch"),
        max_wait_ms=W.FloatSlider(value=2.0, min=0.0, max=20.0, step=0.5, description="max wait ms"),
        price=W.FloatSlider(value=price_per_hour, min=0.5, max=10.0, step=0.25, description="$ per hour"),
    ))
    widgets.show_widget(ui)
    return ui
