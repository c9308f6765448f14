"""Rank side of Unit 3 §1 and §4: synchronous data parallelism with an injected straggler.

``python -m teraflops.workers.straggler --spec PATH`` (a :class:`teraflops.orchestration.stragglers.StragglerSpec`),
started by :func:`teraflops.orchestration.stragglers.run` through :func:`~teraflops.launch.launcher.launch`. Every
setting trains a fresh :class:`~teraflops.models.GPT` from the spec's seed with SGD (the spec's
``momentum``) on the same Markov token stream: at step ``t`` the global batch is rows
``t·B ... (t+1)·B`` and rank ``r`` takes ``sizes[r]`` of them after those of the ranks before it
(:func:`rank_rows`), so every setting sees the same global batches.

One synchronous step, each phase timed (``time.perf_counter``; on CUDA after synchronizing):
forward and backward of the rank's micro-batch (**compute**; the ``compute`` injection makes the
injected rank go on computing, forward and backward of one sequence at a time with the gradients
discarded, until its compute has lasted ``factor``× as long: a device at 1/factor of its speed,
whose extra time is proportional to its micro-batch) → the injected **delay** (``time.sleep``,
after backward and before the collective, so the rank is late to it while the others' compute is
undisturbed) → one blocking ``all_reduce`` of all gradients flattened into one buffer (**wait**:
the rank waits there for the last one, then the transfer) → the optimizer step (**update**).
Each rank's loss is weighted by ``b_r / B`` and the gradients are summed: the global batch's mean
gradient for any split. Local SGD (``local_k = k``): the rank steps on its own gradient (loss not
weighted, no all-reduce); every ``k`` steps the parameters are all-reduce-averaged (the wait).

Experiments: ``sweep`` (a constant delay per ``delays_ms``) and ``kinds`` (intermittent, random,
compute on the last rank), all taking turns step by step (:func:`take_turns`), so that drift in
other processes' load hits them alike; ``rebalance`` (compute ×``factor`` on the last rank: a
calibration run with equal micro-batches, then, taking turns, the equal split and the sizes that
:func:`teraflops.orchestration.stragglers.rebalance` gives for the calibration's speeds); ``localsgd`` (random
delays on every rank; synchronous, then local SGD per ``local_ks``, one after the other; steps
rounded up so that the last step is an average). Each setting begins with
the spec's ``warmup`` untimed steps and a barrier.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from teraflops.launch.faults import fault_point
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.orchestration.stragglers import (
    Injection,
    SettingRecords,
    SettingResult,
    StragglerResult,
    StragglerSpec,
    rebalance,
)
from teraflops.sizing import TrainConfig
from teraflops.workers.common import (
    build_model,
    flat_grads,
    held_out_loss,
    make_data,
    set_grads,
    sync_device,
    trained_rank,
)

RECORDS = ("start", "compute", "delay", "wait", "update", "step", "batch", "loss")


def rank_rows(step: int, rank: int, sizes) -> slice:
    """Rows of the data that ``rank`` trains on at global step ``step`` when rank r takes ``sizes[r]``."""
    lo = step * sum(sizes) + sum(sizes[:rank])
    return slice(lo, lo + sizes[rank])


def weighted_loss(model, x: torch.Tensor, y: torch.Tensor, global_batch: int) -> torch.Tensor:
    """The micro-batch's mean loss times ``len(x) / global_batch``: summed over ranks (and so their
    gradients), the mean loss of the global batch, whatever the split."""
    return lm_loss(model(x), y) * (len(x) / global_batch)


def _slow_down(model, params, x, y, until: float, device) -> None:
    """Forward and backward passes over one sequence, gradients discarded, until ``time.perf_counter()``
    reaches ``until``: real computation that changes nothing but takes time."""
    while time.perf_counter() < until:
        torch.autograd.grad(lm_loss(model(x[:1]), y[:1]), params)
        sync_device(device)


def _average(params, world: int) -> None:
    vec = parameters_to_vector(params)
    dist.all_reduce(vec)
    vector_to_parameters(vec.div_(world), params)


def _stopwatch(device):
    """``lap()``: seconds since the previous lap (or the call), the device synchronized first."""
    sync_device(device)
    last = [time.perf_counter()]

    def lap() -> float:
        sync_device(device)
        now = time.perf_counter()
        dt, last[0] = now - last[0], now
        return dt

    return lap


class Setting:
    """One training setting on this rank: a fresh model (from ``cfg.seed``), SGD with ``momentum``, an
    injection, the micro-batch sizes of all ranks, and the records of its timed steps. :meth:`step`
    runs the next step; the first ``warmup`` are not recorded."""

    def __init__(self, w, cfg: TrainConfig, data, name: str, inj: Injection, steps: int, sizes, local_k: int, *,
                 warmup: int, momentum: float):
        self.w, self.cfg, self.data, self.name, self.inj = w, cfg, data, name, inj
        self.sizes, self.local_k, self.warmup = list(sizes), local_k, warmup
        self.model = build_model(cfg, w.device)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=cfg.lr, momentum=momentum)
        self.t, self.total = 0, warmup + steps
        self.delays = inj.delays_s(self.total, w.rank, w.world_size)
        self.slow = inj.kind == "compute" and w.rank in inj.ranks(w.world_size)
        self.rec = {k: [] for k in RECORDS}

    def step(self) -> None:
        t, w, params, k, global_batch = self.t, self.w, self.params, self.local_k, sum(self.sizes)
        x, y = (v[rank_rows(t, w.rank, self.sizes)].to(w.device) for v in self.data)
        lap = _stopwatch(w.device)
        start = time.time()
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model(x), y) if k else weighted_loss(self.model, x, y, global_batch)
        loss.backward()
        flat = None if k else flat_grads(params)
        compute = lap()
        if self.slow:  # a device at 1/factor of its speed: the compute lasts factor× as long
            _slow_down(self.model, params, x, y, time.perf_counter() + (self.inj.factor - 1) * compute, w.device)
            compute += lap()
        if self.delays[t]:
            time.sleep(self.delays[t])
        delay = lap()
        if k:  # local SGD: own update, then every k steps (and at the end) average the parameters
            self.opt.step()
            update = lap()
            if (t + 1) % k == 0 or t == self.total - 1:
                _average(params, w.world_size)
            wait = lap()
        else:
            dist.all_reduce(flat)
            wait = lap()
            set_grads(params, flat)
            self.opt.step()
            update = lap()
        if t >= self.warmup:
            own = loss.item() * (1 if k else global_batch / len(x))  # the micro-batch's mean loss
            for key, v in zip(RECORDS, (start, compute, delay, wait, update, compute + delay + wait + update,
                                        len(x), own)):
                self.rec[key].append(v)
        self.t += 1

    def speed(self) -> float:
        """This rank's samples/s: micro-batch over the median compute time of the timed steps."""
        return self.sizes[self.w.rank] / statistics.median(self.rec["compute"])

    def result(self, evaluate: bool = False) -> SettingResult:
        """This setting's :class:`~teraflops.orchestration.stragglers.SettingResult`: ``records`` holds a list per
        :data:`RECORDS` entry, one value per timed step (times in s, ``start`` in ``time.time()``
        seconds); ``eval_loss`` (held-out rows, nats) if ``evaluate``, else None."""
        eval_loss = None
        if evaluate:
            eval_loss = held_out_loss(self.model, self.data, self.cfg, self.total, self.w.world_size, self.w.device).item()
        return SettingResult(name=self.name, injection=self.inj, local_k=self.local_k, sizes=self.sizes,
                             records=SettingRecords(**self.rec), eval_loss=eval_loss)


def take_turns(settings: list[Setting], tick) -> None:
    """Run the settings to their end: each one's warm-up steps, a barrier (the timed steps start
    together), then their timed steps in turn, step by step, so that drift in other processes' load
    hits them alike. ``tick()`` after every step."""
    for s in settings:
        for _ in range(s.warmup):
            s.step()
            tick()
    dist.barrier()
    while any(s.t < s.total for s in settings):
        for s in (s for s in settings if s.t < s.total):
            s.step()
            tick()


def run_settings(makers, tick, interleave: bool) -> tuple[SettingResult, ...]:
    """Build and run the settings ``makers`` make (each a call returning a :class:`Setting`), and
    return their results in order: all built at once, taking turns step by step (:func:`take_turns`),
    if ``interleave``; else one after another, each built when the previous one is freed, so one
    setting's model, momentum and gradients live on the device at a time."""
    if interleave:
        group = [make() for make in makers]
        take_turns(group, tick)
        return tuple(s.result() for s in group)
    results = []
    for make in makers:
        one = make()
        take_turns([one], tick)
        results.append(one.result())
        del one  # before the next is built
    return tuple(results)


def settings(a: StragglerSpec) -> dict[str, list[tuple]]:
    """Per experiment, ``(name, Injection, steps, local_k)`` of each setting (rebalance: the
    calibration, whose speeds size the micro-batches, and the equal split; the rebalanced setting
    is the equal split's with those sizes)."""
    kind_d, ks = a.kind_delay_ms, list(a.local_ks)
    lcm = math.lcm(*ks) if ks else 1
    local_steps = -(-(a.warmup + a.steps) // lcm) * lcm - a.warmup  # the last step of every k is an average
    jitter = Injection("random", a.jitter_ms, rank="all", prob=a.jitter_prob, seed=a.model.seed)
    slow = Injection("compute", factor=a.factor)
    return {"sweep": [(f"{d:g} ms", Injection("constant", d), a.steps, 0)
                      for d in a.delays_ms],
            "kinds": [("intermittent", Injection("intermittent", kind_d), a.steps, 0),
                      ("random", Injection("random", kind_d, seed=a.model.seed), a.steps, 0),
                      ("compute", slow, a.steps, 0)],
            "rebalance": [("calibration", slow, max(2, a.steps // 2), 0), ("equal split", slow, a.steps, 0)],
            "localsgd": [("synchronous", jitter, local_steps, 0)] + [(f"local SGD k={k}", jitter, local_steps, k)
                                                                    for k in ks]}


def main(argv: list[str] | None = None) -> None:
    """Run the experiments of the :class:`~teraflops.orchestration.stragglers.StragglerSpec`; write this rank's
    :class:`~teraflops.orchestration.stragglers.StragglerResult`. The sweep and kinds settings take turns
    (:func:`take_turns`); rebalance runs its calibration alone, then the equal split and the
    rebalanced split in turns; where ``spec.interleave`` is false (GPUs) those settings run one
    after another instead (:func:`run_settings`); the local-SGD runs go one after the other (taking
    turns step by step would synchronise local SGD's ranks at every step)."""
    spec = read_spec(StragglerSpec, argv)
    cfg = spec.model
    plan = {e: s for e, s in settings(spec).items() if e in spec.experiments}

    w = init_worker(spec.timeout_s)
    equal = [cfg.micro_batch] * w.world_size
    warm = spec.warmup
    data = make_data(cfg, max(warm + s[2] for ss in plan.values() for s in ss), w.world_size)
    total = sum(warm + s[2] for ss in plan.values() for s in ss) + (warm + spec.steps if "rebalance" in plan else 0)
    done = 0

    def tick():  # after each step of any setting: the launch's step count, for progress and TERAFLOPS_FAULT
        nonlocal done
        fault_point(done)
        done += 1
        report_progress(done, total)

    def setting(entry, sizes=equal, name=None):
        return Setting(w, cfg, data, name or entry[0], entry[1], entry[2], sizes, entry[3], warmup=warm,
                       momentum=spec.momentum)

    turns = [(e, entry) for e in ("sweep", "kinds") if e in plan for entry in plan[e]]  # sweep and kinds in turns
    done_turns = run_settings([lambda entry=entry: setting(entry) for _, entry in turns], tick, spec.interleave)
    result = {e: tuple(r for (ee, _), r in zip(turns, done_turns) if ee == e) for e in ("sweep", "kinds") if e in plan}
    if "rebalance" in plan:  # micro-batches proportional to the speeds measured with equal ones
        probe, entry = setting(plan["rebalance"][0]), plan["rebalance"][1]
        take_turns([probe], tick)
        speeds = torch.zeros(w.world_size, dtype=torch.float64, device=w.device)
        speeds[w.rank] = probe.speed()
        del probe
        dist.all_reduce(speeds)
        sizes = rebalance(speeds.tolist(), sum(equal))
        pair = [lambda: setting(entry), lambda: setting(entry, sizes, "rebalanced")]
        result["rebalance"] = run_settings(pair, tick, spec.interleave)
        result["calibration_speeds"] = speeds.tolist()
    localsgd = []
    for entry in plan.get("localsgd", []):
        run = setting(entry)
        take_turns([run], tick)
        localsgd.append(run.result(evaluate=True))
        del run  # before the next is built
    write_result(StragglerResult(**trained_rank(w, cfg), localsgd=tuple(localsgd), **result))
    finish()


if __name__ == "__main__":
    main()
