"""Unit 3 §4b′: elasticity that *moves* work. Ray Train on three emulated nodes, one node killed
mid-training, the group shrinking to the survivors and growing back when the node returns.

torchrun's elastic restart (:mod:`teraflops.orchestration.elastic`) brings the same processes back
on the same nodes. Ray (https://docs.ray.io) schedules work onto whatever nodes are alive: its GCS
(:mod:`teraflops.nodes.ray`) health-checks every node's raylet and declares a node dead after
``health_check_failure_threshold`` missed checks ``health_check_period_ms`` apart; Ray Train's
controller (``TorchTrainer``, Ray Train V2, Ray 2.60's default) polls its worker group every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (default 2 s), and when a worker is gone it tears the group
down and starts a new one, of any size in ``ScalingConfig(num_workers=(min, max))`` that the
cluster's free resources allow, waiting at most ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (default
60 s) for it; the new workers resume from the last checkpoint registered with
``ray.train.report(checkpoint=...)`` (``FailureConfig(max_failures)`` bounds the restarts). While
healthy, an elastic group is checked for more resources every
``ScalingConfig(elastic_resize_monitor_interval_s)`` (default 60 s) and restarted at the larger
size when they appear (https://docs.ray.io/en/latest/train/user-guides/fault-tolerance.html).
The knobs the course shortens, and why: :data:`KNOBS` (and :class:`teraflops.nodes.ray.RayConfig`'s
health check), so that one run fits a lecture; production keeps the defaults, which are minutes of
patience against flapping nodes.

:func:`run` (5 min with the cluster's start at load 4–6 here, 10 at load 12): a cluster of 3 nodes ×
1 CPU (so one worker per node), the course's GPT (:mod:`teraflops.workers.ray_train`) with ``num_workers=(2, 3)``; after ``kill_step``
steps every process of node 2 is SIGKILLed (its raylet and its worker: the node dies as a machine
does, without a word to the head); once the 2-worker group has trained ``rejoin_after`` steps, node 2
starts Ray again and the group grows back to 3. What is measured, from Ray's and the run's own
records (Unix seconds; one clock, one machine):

* ``detect_s``: kill → the GCS's node table shows the node dead (``ray.nodes()``, polled by the
  driver every 0.2 s);
* ``shrink_s``: kill → the first step of the 2-worker group (includes detection, the controller's
  poll, stopping the old group, starting 2 workers, torch + gloo set-up and loading the checkpoint);
* ``grow_s``: node 2's Ray up again → the first step of the 3-worker group;
* where each group's workers ran (their nodes' addresses), steps redone (trained after the last
  checkpoint before the kill), and the final loss against an uninterrupted reference.

The reference (:func:`reference_losses`) trains the same GPT on the same global batches in one
process. Every group averages its workers' gradients over equal slices of the global batch, so a
run of 3 workers, 2 workers or 1 computes the same updates up to float32 rounding (summation
order): :data:`LOSS_TOLERANCE` is the agreement the lecture states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from teraflops.data import markov_tokens
from teraflops.errors import CourseError
from teraflops.launch import wire
from teraflops.models import GPT, lm_loss
from teraflops.nodes import ray as ray_mod
from teraflops.nodes.cluster import Cluster
from teraflops.sizing import PRESETS, TrainConfig, gpt_config, preset
from teraflops.tables import table

WORKER = "teraflops.workers.ray_train"
LOSS_TOLERANCE = 1e-3  # nats: 2 or 3 workers vs one process, float32 summation order (measured here ~1e-6)
# Ray Train's knobs, shortened for the lecture (defaults in the comments), set in the driver's environment
KNOBS = {
    # 60: how long a new group's placement group (its workers' resources) may stay pending before the controller
    # gives up on that size. It bounds the reservation only, not the workers' start (measured: a 2-worker group
    # reserved at once and started 38 s later at load 13 without a timeout); a reservation on live nodes takes
    # well under a second, a retry at the old size after a node died waits all of it (the lecture's decomposition)
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "8",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",  # 2: how often the controller polls its workers
    # off by default: Ray Train's record of its runs and worker-group attempts (the decomposition reads it)
    "RAY_TRAIN_ENABLE_STATE_TRACKING": "1",
}
RESIZE_INTERVAL_S = 3.0  # ScalingConfig(elastic_resize_monitor_interval_s), default 60: look for more nodes
SLOW_PHASE_S = 30.0  # a phase waited on this long says so (run's ``say``)
# The cluster the run needs: one CPU per node, so one Train worker per node (and 2 fake GPUs each, which the
# lecture's placement groups use on the same cluster afterwards)
CLUSTER = ray_mod.RayConfig(cpus_per_node=1, gpus_per_node=2)


class RayTrainError(CourseError, RuntimeError):
    """The Ray Train run failed or did not go through its phases; one line with a hint."""


@dataclass(frozen=True)
class RaySpec:
    """What :mod:`teraflops.workers.ray_train` runs: ``model`` trained ``steps`` steps on global
    batches of ``global_batch`` sequences (divisible by every group size), each step at least
    ``step_s`` s, a checkpoint every ``checkpoint_every`` steps; ``num_workers`` workers (with
    ``min_workers``: elastic, ``(min_workers, num_workers)``); files in ``steps_log``, ``result_path``,
    ``storage_path`` (Ray Train's run folder); ``ifname``: the nodes' interface for gloo; ``hold_path``: the
    host's hold file (a shrunken group pauses while it exists, so that a run on a slow machine does not end
    before the node it waits for is back)."""

    model: TrainConfig
    steps: int
    global_batch: int
    checkpoint_every: int
    num_workers: int
    steps_log: str
    result_path: str
    storage_path: str
    min_workers: int | None = None
    step_s: float = 0.2
    max_failures: int = 3
    ifname: str = "eth0"
    run_name: str = "gpt"
    collective_timeout_s: float = 30
    node_poll_s: float = 0.2  # how often the driver reads the GCS's node table (ray.nodes()), s
    resize_interval_s: float = RESIZE_INTERVAL_S
    hold_path: str = ""  # while this file exists, a group smaller than num_workers waits before each step

    def __post_init__(self):
        sizes = range(self.min_workers or self.num_workers, self.num_workers + 1)
        if any(self.global_batch % w for w in sizes):
            raise RayTrainError(f"global_batch {self.global_batch} must divide evenly among {list(sizes)} workers. "
                                "Hint: global_batch=12 for 2 or 3 workers.")


@dataclass(frozen=True)
class RayDriverResult:
    """What the driver hands back: whether ``trainer.fit()`` succeeded (``error`` if not), the last
    reported step and loss, Unix start/end, and the GCS's node table as it changed
    (``node_events``: ``{"time", "address", "alive"}`` at every change the driver saw), and Ray Train's own
    record of its worker-group attempts (``attempts``: ``{"start", "end", "status", "workers", "nodes",
    "detail"}``, Unix s, from Train's state actor; one attempt per worker group the controller started)."""

    ok: bool
    error: str | None
    final_loss: float | None
    final_step: int | None
    started: float
    ended: float
    host: str
    node_events: list = field(default_factory=list)
    attempts: list = field(default_factory=list)


@dataclass(frozen=True)
class RayElasticRun:
    """One :func:`run`: the steps (``{"step", "loss", "world", "nodes", "resumed_from", "time"}``, as
    rank 0 logged them, several per step number where steps were redone), the times of the kill and
    the rejoin (Unix s), the driver's result, the reference losses, and the knobs in force."""

    steps: list
    killed_node: int
    kill_time: float
    rejoin_time: float | None
    driver: RayDriverResult
    reference: list
    checkpoint_every: int
    knobs: dict
    detection_bound_s: float

    def groups(self) -> list[dict]:
        """The worker groups in order: ``world``, ``nodes``, ``resumed_from``, first step, first time."""
        out = []
        for s in self.steps:
            if not out or (s["world"], s["resumed_from"]) != (out[-1]["world"], out[-1]["resumed_from"]):
                out.append({"world": s["world"], "nodes": s["nodes"], "resumed_from": s["resumed_from"],
                            "first_step": s["step"], "first_time": s["time"]})
        return out

    @property
    def detect_s(self) -> float | None:
        """Kill → the GCS's table shows the killed node dead (s)."""
        dead = [e["time"] for e in self.driver.node_events if not e["alive"] and e["time"] >= self.kill_time - 1]
        return min(dead) - self.kill_time if dead else None

    def _first_after(self, t: float, world: int) -> float | None:
        found = [g["first_time"] for g in self.groups() if g["first_time"] > t and g["world"] == world]
        return found[0] - t if found else None

    @property
    def shrink_s(self) -> float | None:
        """Kill → the first step of the smaller group (s)."""
        small = min(g["world"] for g in self.groups())
        return self._first_after(self.kill_time, small)

    @property
    def grow_s(self) -> float | None:
        """Node back → the first step of the regrown group (s)."""
        return None if self.rejoin_time is None else self._first_after(self.rejoin_time, max(g["world"] for g in self.groups()))

    @property
    def shrank_and_grew(self) -> bool:
        """The group went 3 → 2 → 3 (or max → smaller → max) within the run."""
        worlds = [g["world"] for g in self.groups()]
        return len(worlds) >= 3 and worlds[0] == worlds[-1] > min(worlds)

    @property
    def steps_redone(self) -> int:
        """Steps trained twice: logged before the kill, after the checkpoint the next group resumed from."""
        before = [s["step"] for s in self.steps if s["time"] <= self.kill_time]
        after = [g for g in self.groups() if g["first_time"] > self.kill_time]
        return max(0, max(before, default=0) - after[0]["resumed_from"]) if after else 0

    @property
    def final_loss_diff(self) -> float:
        """|final loss − the reference's final loss| (nats)."""
        last = max(self.steps, key=lambda s: (s["step"], s["time"]))
        return abs(last["loss"] - self.reference[last["step"] - 1])

    def moved(self) -> bool:
        """The smaller group ran only on nodes other than the killed one."""
        small = [g for g in self.groups() if g["first_time"] > self.kill_time][:1]
        return bool(small) and Cluster.address(self.killed_node) not in small[0]["nodes"]


def reference_losses(spec: RaySpec) -> list[float]:
    """The uninterrupted run's loss per step: the same GPT, data and Adam, each global batch in one
    process (what every worker group computes, up to rounding; module docstring)."""
    cfg = spec.model
    torch.manual_seed(cfg.seed)  # as teraflops.workers.common.build_model: the workers' initial weights
    model = GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    inputs, targets = markov_tokens(spec.steps * spec.global_batch, cfg.seq_len, cfg.vocab, seed=cfg.seed + 1)
    out = []
    for step in range(spec.steps):
        rows = slice(step * spec.global_batch, (step + 1) * spec.global_batch)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs[rows]), targets[rows])
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _read_steps(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _wait(ready, timeout: float, what: str, driver: subprocess.Popen, log: Path, say=None):
    start = time.monotonic()
    deadline, told = start + timeout, start
    while not (found := ready()):
        if say is not None and time.monotonic() - told > SLOW_PHASE_S:  # under load: progress, not silence
            told = time.monotonic()
            say(f"  still waiting ({told - start:.0f} s; load {_load():.1f} on {os.cpu_count()} cores: "
                "a busy machine starts Ray's workers slowly)")
        if driver.poll() is not None or time.monotonic() > deadline:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-600:] if log.exists() else ""
            why = "the driver exited" if driver.poll() is not None else f"not within {timeout:g} s"
            raise RayTrainError(f"{what} ({why}). Driver log {log}: {tail}")
        time.sleep(0.2)
    return found


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def worker_preset():
    """The preset that sizes the Ray Train workers' GPT: they are CPU workers (``use_gpu=False``, one
    CPU each, ``workers/ray_train.py``), so the preset in force where it is a CPU one (``cpu``, ``tiny``),
    else the ``cpu`` preset: the GPU preset's GPT (~10⁸ parameters, TFLOPs per worker-step) on one core
    each would outlast every phase's timeout."""
    p = preset()
    return p if p.device == "cpu" else PRESETS["cpu"]


def make_spec(folder: Path, *, steps: int, checkpoint_every: int, step_s: float, global_batch: int) -> RaySpec:
    """The driver's :class:`RaySpec` for a run whose files live in ``folder``; the GPT and learning rate
    of :func:`worker_preset`, ``global_batch // 3`` sequences per worker."""
    p = worker_preset()
    return RaySpec(model=gpt_config(p, global_batch // 3, p.dp.lr),
                   steps=steps, global_batch=global_batch, checkpoint_every=checkpoint_every, num_workers=3,
                   min_workers=2, step_s=step_s, steps_log=str(folder / "steps.jsonl"),
                   result_path=str(folder / "result.json"), storage_path=str(folder / "ray"))


def run(steps: int = 60, checkpoint_every: int = 5, kill_step: int = 12, rejoin_after: int | None = 8,
        step_s: float = 0.25, global_batch: int = 12, timeout: float = 240, knobs: dict | None = None,
        cluster: Cluster | None = None, say=None) -> RayElasticRun:
    """Train on a fresh 3-node Ray cluster with ``num_workers=(2, 3)``; kill node 2 after ``kill_step``
    steps, bring it back after ``rejoin_after`` steps of the smaller group (module docstring).
    ``cluster``: an up 3-node cluster with Ray at one CPU per node (:data:`CLUSTER`) to use instead of a fresh
    one (the lecture runs its placement groups on it afterwards; node 2 is back up when this returns);
    ``say``: called with one line at each phase (``print`` in the lecture: a slow phase is not silence);
    ``rejoin_after=None``: node 2 is not brought back (the run ends on 2 workers; Lab 3's checkpoint run).

    Raises:
        RayTrainError: the run failed or a phase did not come within ``timeout`` s (quoting the driver's log).
        teraflops.nodes.cluster.ClusterError: the machine cannot host the nodes or Ray.
    """
    knobs = {**KNOBS, **(knobs or {})}
    folder = Path(tempfile.mkdtemp(prefix="teraflops-ray-"))
    spec = make_spec(folder, steps=steps, checkpoint_every=checkpoint_every, step_s=step_s, global_batch=global_batch)
    hold = folder / "hold"
    spec = dataclasses.replace(spec, hold_path=str(hold))
    wire.write(spec, folder / "spec.json")
    log, steps_log = folder / "driver.log", Path(spec.steps_log)
    config = cluster.ray_.config if cluster is not None else CLUSTER
    say = say or (lambda line: None)
    kept = False
    try:
        with contextlib.nullcontext(cluster) if cluster is not None else Cluster(3, ray=config) as cl:
            env = {**cl.ray_.env(), **knobs}
            with open(log, "wb") as out:
                driver = subprocess.Popen(["nsenter", f"--net=/run/netns/{cl.node_name(0)}", sys.executable, "-m", WORKER,
                                           "--spec", str(folder / "spec.json")], stdout=out, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
            try:
                t0 = time.time()
                say(f"Ray Train driver started on node 0; waiting for 3 workers to train {kill_step} steps")
                _wait(lambda: any(s["step"] >= kill_step and s["world"] == 3 for s in _read_steps(steps_log)), timeout,
                      "the 3-worker group did not reach the kill step", driver, log, say)
                kill_time = time.time()
                cl.ray_.kill_node(2)
                say(f"step {kill_step} reached after {kill_time - t0:.0f} s: node 2 killed (SIGKILL, every process)")
                _wait(lambda: sum(1 for s in _read_steps(steps_log) if s["world"] == 2) >= (rejoin_after or 1), timeout,
                      "the group did not shrink to 2 workers", driver, log, say)
                rejoin_time = None
                if rejoin_after is not None:  # else node 2 stays down (a cluster of the caller's is left with 2 nodes)
                    hold.touch()  # the 2 workers pause: on a busy machine they would finish before node 2 is back
                    say(f"2 workers trained {rejoin_after} steps ({time.time() - kill_time:.0f} s after the kill) and "
                        "pause; node 2 starts Ray again")
                    rejoin_time = _rejoin(cl, timeout, say)
                    if rejoin_time is not None:
                        say(f"node 2 rejoined {rejoin_time - kill_time:.0f} s after the kill; waiting for 3 workers")
                        _wait(lambda: any(s["world"] == 3 and s["time"] > rejoin_time for s in _read_steps(steps_log)),
                              timeout, "the group did not grow back to 3 workers", driver, log, say)
                    hold.unlink()
                _wait(lambda: driver.poll() is not None, timeout, "the run did not finish", driver, log, say)
                say(f"run finished {time.time() - t0:.0f} s after the driver started")
                logged = [x for f in sorted(cl.ray_.dir.glob("node*/session_latest/logs/train/ray-train-sys-controller-*.log"))
                          for x in f.read_text(errors="replace").splitlines()]  # read before the teardown removes them
            except BaseException:
                _keep_logs(cl, folder)
                raise
            finally:
                if driver.poll() is None:
                    driver.kill()
                driver.wait(10)
        result = wire.read(RayDriverResult, Path(spec.result_path)) if Path(spec.result_path).exists() else None
        from_log = attempts_from_controller_log(logged)
        if result is not None and len(from_log) >= len(result.attempts):
            # the controller's log holds every attempt; Train's state actor only those whose placement group was
            # reserved (measured here: the retry at the old size, pending until its timeout, was not in it)
            result = dataclasses.replace(result, attempts=from_log)
        if result is None or not result.ok:
            kept = True
            raise RayTrainError(f"the Ray Train run failed: {result.error if result else 'no result'}. Logs in {folder}; driver: "
                                + " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-600:])
        return RayElasticRun(_read_steps(steps_log), 2, kill_time, rejoin_time, result, reference_losses(spec),
                             checkpoint_every, {**knobs, "elastic_resize_monitor_interval_s": RESIZE_INTERVAL_S,
                                                "health_check_period_ms": config.health_check_period_ms,
                                                "health_check_failure_threshold": config.health_check_failure_threshold},
                             config.detection_s())
    except BaseException:
        kept = True
        raise
    finally:
        if not kept:
            shutil.rmtree(folder, ignore_errors=True)


def _rejoin(cl: Cluster, timeout: float, say) -> float | None:
    """Start node 2's Ray again; when it is up (Unix s), or None when it could not start (said in one line: at a
    load of 10 or more on 2 cores the node's dashboard agent can outlast the raylet's own wait for it, and the run
    then ends on the survivors without the regrow)."""
    try:
        cl.ray_.start_node(2)
        cl.ray_.wait_nodes([2], timeout)
    except ray_mod.RayError as e:
        say(f"node 2 could not start Ray again (load {_load():.1f}): the run ends on 2 workers. {str(e)[:300]}")
        return None
    return time.time()


def _keep_logs(cl: Cluster, folder: Path) -> None:
    """Copy the nodes' Ray logs (``ray start`` and each session's ``logs``) into ``folder/ray-logs``,
    before the cluster's teardown removes them: the error message names ``folder``."""
    for i in range(cl.nodes):
        src = cl.ray_.temp_dir(i) / "session_latest" / "logs"
        if src.is_dir():
            shutil.copytree(src, folder / "ray-logs" / f"node{i}", dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("old", "events", "export_events"))
    shutil.copytree(cl.ray_.dir / "log", folder / "ray-logs" / "start", dirs_exist_ok=True)


def groups_table(r: RayElasticRun) -> str:
    """One row per worker group: workers, the nodes they ran on, the checkpoint they resumed from, first step."""
    t0 = r.steps[0]["time"] if r.steps else 0
    return table([(g["world"], ", ".join(g["nodes"]), g["resumed_from"], g["first_step"], f"{g['first_time'] - t0:.1f}")
                  for g in r.groups()], ["workers", "nodes", "resumed from step", "first step", "at s"])


def _fmt(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def recovery_table(r: RayElasticRun) -> str:
    """The measured times: detection, shrink, grow, steps redone, final loss difference."""
    rows = [("node declared dead (GCS)", _fmt(r.detect_s), f"≤ {r.detection_bound_s:g} s: health check period × threshold"),
            ("kill → first step of the 2-worker group", _fmt(r.shrink_s), "detection + controller poll + new group + resume"),
            ("node back → first step of the 3-worker group", _fmt(r.grow_s), "resize check + new group + resume"),
            ("steps redone", str(r.steps_redone), f"checkpoint every {r.checkpoint_every} steps"),
            ("final loss − uninterrupted", f"{r.final_loss_diff:.1e}", f"tolerance {LOSS_TOLERANCE:g} nats")]
    return table(rows, ["event", "s", "what sets it"])


def _step_s(r: RayElasticRun) -> float:
    """The median time between consecutive logged steps of one group (s): what a redone step costs."""
    gaps = sorted(b["time"] - a["time"] for a, b in zip(r.steps, r.steps[1:])
                  if (a["world"], a["resumed_from"]) == (b["world"], b["resumed_from"]))
    return gaps[len(gaps) // 2] if gaps else float("nan")


def recovery_parts(r: RayElasticRun) -> list[dict]:
    """Kill → first step of the smaller group, cut at Ray Train's own records (``r.driver.attempts``, the
    worker-group attempts; ``r.steps``): ``{"part", "s", "knob"}`` in order. The parts before
    ``"work redone"`` add up to :attr:`RayElasticRun.shrink_s` exactly (consecutive intervals of one clock):

    1. kill → the controller ends the broken group (its poll sees the failed workers: the survivors' gloo
       all-reduce fails when the dead node's worker vanishes, or the GCS declares the node dead);
    2. each retry that failed: a new group asked for and never started, until the worker-group start
       timeout (Ray Train retries at the size it last had while the dead node's resources still count);
    3. the controller between attempts (tearing a group down, choosing the next size);
    4. the smaller group's start → its first step (placing and starting workers, torch + gloo set-up,
       loading the checkpoint);
    then, not part of ``shrink_s``: the steps redone since the checkpoint, times the median step time.
    Empty when the run has no attempts on record (another Ray version) or did not shrink.
    """
    small = min((g["world"] for g in r.groups()), default=None)
    first = r._first_after(r.kill_time, small) if small is not None else None
    if not r.driver.attempts or first is None:
        return []
    first_step = r.kill_time + first
    broken = [a for a in r.driver.attempts if a["start"] <= r.kill_time and (a["end"] or first_step) >= r.kill_time]
    later = [a for a in r.driver.attempts if a["start"] > r.kill_time and a["start"] < first_step]
    if not broken or not later or later[-1]["workers"] != small:
        return []
    parts = [{"part": f"kill → controller ends the {broken[-1]['workers']}-worker group",
              "s": (broken[-1]["end"] or first_step) - r.kill_time,
              "knob": "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (controller's poll); node death: "
                      "health_check_period_ms × health_check_failure_threshold"}]
    gap, prev_end = 0.0, broken[-1]["end"] or first_step
    for a in later[:-1]:
        gap += a["start"] - prev_end
        parts.append({"part": f"retry at {a['workers']} workers (placement group pending: {a['status'].lower()})",
                      "s": (a["end"] or a["start"]) - a["start"], "knob": "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"})
        prev_end = a["end"] or a["start"]
    gap += later[-1]["start"] - prev_end
    parts.append({"part": "controller between groups (teardown, next size)", "s": gap,
                  "knob": "none (Ray Train's own work; slower on a busy machine)"})
    parts.append({"part": f"{small}-worker group start → first step", "s": first_step - later[-1]["start"],
                  "knob": "the machine's load, torch + gloo set-up, checkpoint size"})
    parts.append({"part": f"work redone: {r.steps_redone} steps × {_step_s(r):.2f} s", "s": r.steps_redone * _step_s(r),
                  "knob": f"checkpoint interval (every {r.checkpoint_every} steps)"})
    return parts


def parts_table(parts: list[dict]) -> str:
    """:func:`recovery_parts` as a table, with the total of the parts before the work redone (``shrink_s``)."""
    before = [p for p in parts if not p["part"].startswith("work redone")]
    rows = [(p["part"], f"{p['s']:.1f}", p["knob"]) for p in parts]
    rows.insert(len(before), ("= kill → first step of the smaller group", f"{sum(p['s'] for p in before):.1f}", ""))
    return table(rows, ["part of the recovery", "s", "the knob that moves it"])


def plot_timeline(r: RayElasticRun, ax=None):
    """Per node, the worker each attempt ran there (a bar from the group's start to its end; hatched: an
    attempt that never started its workers, drawn on the controller's row) and each logged step (a tick
    under its group's bar); the kill, the GCS's verdict and the rejoin as vertical lines. Seconds from
    the first attempt's start."""
    import matplotlib.pyplot as plt  # lazy: figures only

    ax = ax or plt.subplots(figsize=(11, 3.2))[1]
    attempts = r.driver.attempts
    t0 = min([a["start"] for a in attempts] + [s["time"] for s in r.steps[:1]])
    nodes = [Cluster.address(i) for i in range(3)]
    rows = {a: i for i, a in enumerate(nodes)} | {"controller": len(nodes)}
    colours = {3: "tab:blue", 2: "tab:orange"}
    end_all = max([s["time"] for s in r.steps] + [a["end"] or 0 for a in attempts])
    for a in attempts:
        end = a["end"] or end_all
        where = a["nodes"] or ["controller"]
        for n in where:
            ax.barh(rows.get(n, len(nodes)), end - a["start"], left=a["start"] - t0, height=0.5,
                    color=colours.get(a["workers"], "tab:green"), alpha=0.35 if a["nodes"] else 0.15,
                    hatch=None if a["nodes"] else "//", edgecolor="black", linewidth=0.5)
        if not a["nodes"]:
            ax.text(a["start"] - t0, len(nodes) + 0.3, f"{a['workers']} workers asked, never started", fontsize=8)
    for s in r.steps:
        for n in s["nodes"]:
            ax.plot([s["time"] - t0] * 2, [rows[n] - 0.2, rows[n] + 0.2], color=colours.get(s["world"], "k"), lw=0.8)
    marks = [(r.kill_time, "node 2 killed", "red")]
    if r.detect_s is not None:
        marks.append((r.kill_time + r.detect_s, "GCS: node dead", "darkred"))
    if r.rejoin_time is not None:
        marks.append((r.rejoin_time, "node 2 back", "green"))
    for n, (t, label, colour) in enumerate(marks):
        ax.axvline(t - t0, color=colour, ls="--", lw=1)
        ax.text(t - t0, -0.75 + 0.3 * (n % 2), " " + label, color=colour, fontsize=8)  # staggered: marks can be close
    ax.set_yticks(range(len(rows)), [f"node {i} ({a})" for i, a in enumerate(nodes)] + ["controller"])
    ax.set_ylim(-1.0, len(rows) - 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("s since the first worker group was asked for (ticks: steps; blue 3 workers, orange 2)")
    ax.set_title("Ray Train: the worker groups per node, the kill, the shrink and the regrow")
    return ax


def measured_cost(r: RayElasticRun) -> dict:
    """What a run's checkpoint interval cost, from its records: ``checkpoints`` written and their measured
    time (``checkpoint_s`` each, the median; ``checkpoint_total_s``; rank 0's save plus Ray's registration,
    the steps log's ``checkpoint_s``), the last step logged before the kill, the step the next group
    ``resumed_from`` and the one the interval predicts (``predicted_resume``: the last multiple of the
    interval at or before it, 0 if none), ``steps_redone`` and their time (``redo_s``, at the median step)."""
    k = r.checkpoint_every
    last = max((s["step"] for s in r.steps if s["time"] <= r.kill_time), default=0)
    after = [g for g in r.groups() if g["first_time"] > r.kill_time]
    times = sorted(s["checkpoint_s"] for s in r.steps if s.get("checkpoint_s", 0.0) > 0)  # logged a step later
    each = times[len(times) // 2] if times else float("nan")
    return {"checkpoints": len(times), "checkpoint_s": each, "checkpoint_total_s": sum(times),
            "last_before_kill": last, "resumed_from": after[0]["resumed_from"] if after else None,
            "predicted_resume": last // k * k, "steps_redone": r.steps_redone,
            "redo_s": r.steps_redone * _step_s(r)}


def comparison_rows(r: RayElasticRun | None, torchrun=None, slurm_requeue_s: float | None = None) -> list[tuple]:
    """torchrun's elastic restart, Ray Train's elastic group and a Slurm requeue side by side: who detects,
    what restarts, where it runs, time lost (measured where a run is given, else '—'), the knobs."""
    ray_lost = _fmt(r.shrink_s) if r is not None else "—"
    torch_lost = _fmt(getattr(torchrun, "restart_s", None)) if torchrun is not None else "—"
    return [
        ("torchrun elastic agent", "the agent on the node polls its workers' exit codes (monitor interval 0.1 s)",
         "every worker, same nodes; a dead node ends the job", "same nodes", torch_lost, "--max-restarts, --monitor-interval"),
        ("Ray Train (elastic)", "the GCS's health check of each raylet; the Train controller's poll of its workers",
         "the worker group, at any size in (min, max) that fits", "any live node", ray_lost,
         "health_check_period_ms × threshold, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, elastic_resize_monitor_interval_s"),
        ("Slurm requeue", "slurmctld: the node misses SlurmdTimeout, is set DOWN; the job is requeued",
         "the whole job, from its batch script, after it waits in the queue again", "wherever the scheduler places it",
         _fmt(slurm_requeue_s), "SlurmdTimeout, --requeue, the queue's wait"),
        ("Kubernetes", "not run here: no container images can be pulled on these machines (Debian 12 ships kubectl "
         "and etcd only)", "—", "—", "—", "—"),
    ]


def comparison_table(r: RayElasticRun | None, torchrun=None, slurm_requeue_s: float | None = None) -> str:
    return table(comparison_rows(r, torchrun, slurm_requeue_s),
                 ["mechanism", "who detects", "what restarts", "where", "time lost s", "knobs"])


_STARTING = re.compile(r"Attempting to start training worker group of size (\d+)")
_STARTED = re.compile(r"Started training worker group of size (\d+)")
_NODE_IP = re.compile(r"\(ip=([\d.]+),")


def attempts_from_controller_log(lines) -> list[dict]:
    """Ray Train's worker-group attempts read from its controller's structured log (``logs/train/
    ray-train-sys-controller-*.log`` on the controller's node: one JSON object per line, ``asctime`` in the
    machine's local time), in :class:`RayDriverResult`'s ``attempts`` form: an attempt starts at "Attempting to
    start training worker group of size N", is running from "Started training worker group" (``nodes``: its
    workers' addresses), and ends at the controller's next "[FailurePolicy]" decision, a "startup timed out"
    error (status ``ERRORED``) or the next attempt. What the driver reads when Train's state actor has none."""
    out: list[dict] = []
    for line in lines:
        try:
            rec = json.loads(line)
            t = time.mktime(time.strptime(rec["asctime"].split(",")[0], "%Y-%m-%d %H:%M:%S")) + \
                int(rec["asctime"].split(",")[1]) / 1000
            msg = rec["message"]
        except (ValueError, KeyError, IndexError):
            continue
        cur = out[-1] if out and out[-1]["end"] is None else None
        if m := _STARTING.search(msg):
            if cur is not None:
                cur["end"] = t
            out.append({"start": t, "end": None, "status": "PENDING", "workers": int(m.group(1)), "nodes": [],
                        "detail": ""})
        elif cur is not None and _STARTED.search(msg):
            cur.update(status="RUNNING", nodes=_NODE_IP.findall(msg))
        elif cur is not None and ("[FailurePolicy]" in msg or "startup timed out" in msg):
            cur.update(end=t, status="ERRORED", detail=msg.strip().splitlines()[0][:300])
    return out
