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

:func:`run` (about a minute here): a cluster of 3 nodes × 1 CPU (so one worker per node), the
course's GPT (:mod:`teraflops.workers.ray_train`) with ``num_workers=(2, 3)``; after ``kill_step``
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

import json
import math
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
from teraflops.sizing import TrainConfig, gpt_config, preset
from teraflops.tables import table

WORKER = "teraflops.workers.ray_train"
LOSS_TOLERANCE = 1e-3  # nats: 2 or 3 workers vs one process, float32 summation order (measured here ~1e-6)
# Ray Train's knobs, shortened for the lecture (defaults in the comments), set in the driver's environment
KNOBS = {
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",  # 60: how long a new group may take to start
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",  # 2: how often the controller polls its workers
}
RESIZE_INTERVAL_S = 3.0  # ScalingConfig(elastic_resize_monitor_interval_s), default 60: look for more nodes


class RayTrainError(CourseError, RuntimeError):
    """The Ray Train run failed or did not go through its phases; one line with a hint."""


@dataclass(frozen=True)
class RaySpec:
    """What :mod:`teraflops.workers.ray_train` runs: ``model`` trained ``steps`` steps on global
    batches of ``global_batch`` sequences (divisible by every group size), each step at least
    ``step_s`` s, a checkpoint every ``checkpoint_every`` steps; ``num_workers`` workers (with
    ``min_workers``: elastic, ``(min_workers, num_workers)``); files in ``steps_log``, ``result_path``,
    ``storage_path`` (Ray Train's run folder); ``ifname``: the nodes' interface for gloo."""

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

    def __post_init__(self):
        sizes = range(self.min_workers or self.num_workers, self.num_workers + 1)
        if any(self.global_batch % w for w in sizes):
            raise RayTrainError(f"global_batch {self.global_batch} must divide evenly among {list(sizes)} workers. "
                                "Hint: global_batch=12 for 2 or 3 workers.")


@dataclass(frozen=True)
class RayDriverResult:
    """What the driver hands back: whether ``trainer.fit()`` succeeded (``error`` if not), the last
    reported step and loss, Unix start/end, and the GCS's node table as it changed
    (``node_events``: ``{"time", "address", "alive"}`` at every change the driver saw)."""

    ok: bool
    error: str | None
    final_loss: float | None
    final_step: int | None
    started: float
    ended: float
    host: str
    node_events: list = field(default_factory=list)


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


def _wait(ready, timeout: float, what: str, driver: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if driver.poll() is not None or time.monotonic() > deadline:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-600:] if log.exists() else ""
            why = "the driver exited" if driver.poll() is not None else f"not within {timeout:g} s"
            raise RayTrainError(f"{what} ({why}). Driver log {log}: {tail}")
        time.sleep(0.2)
    return found


def run(steps: int = 60, checkpoint_every: int = 5, kill_step: int = 12, rejoin_after: int = 8,
        step_s: float = 0.25, global_batch: int = 12, timeout: float = 240, knobs: dict | None = None) -> RayElasticRun:
    """Train on a fresh 3-node Ray cluster with ``num_workers=(2, 3)``; kill node 2 after ``kill_step``
    steps, bring it back after ``rejoin_after`` steps of the smaller group (module docstring).

    Raises:
        RayTrainError: the run failed or a phase did not come within ``timeout`` s (quoting the driver's log).
        teraflops.nodes.cluster.ClusterError: the machine cannot host the nodes or Ray.
    """
    knobs = {**KNOBS, **(knobs or {})}
    p = preset()
    folder = Path(tempfile.mkdtemp(prefix="teraflops-ray-"))
    spec = RaySpec(model=gpt_config(p, global_batch // 3, p.dp.lr),
                   steps=steps, global_batch=global_batch, checkpoint_every=checkpoint_every, num_workers=3,
                   min_workers=2, step_s=step_s, steps_log=str(folder / "steps.jsonl"),
                   result_path=str(folder / "result.json"), storage_path=str(folder / "ray"))
    wire.write(spec, folder / "spec.json")
    log, steps_log = folder / "driver.log", Path(spec.steps_log)
    config = ray_mod.RayConfig(cpus_per_node=1)
    kept = False
    try:
        with Cluster(3, ray=config) as cl:
            env = {**cl.ray_.env(), **knobs}
            with open(log, "wb") as out:
                driver = subprocess.Popen(["nsenter", f"--net=/run/netns/{cl.node_name(0)}", sys.executable, "-m", WORKER,
                                           "--spec", str(folder / "spec.json")], stdout=out, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
            try:
                _wait(lambda: any(s["step"] >= kill_step and s["world"] == 3 for s in _read_steps(steps_log)), timeout,
                      "the 3-worker group did not reach the kill step", driver, log)
                kill_time = time.time()
                cl.ray_.kill_node(2)
                _wait(lambda: sum(1 for s in _read_steps(steps_log) if s["world"] == 2) >= rejoin_after, timeout,
                      "the group did not shrink to 2 workers", driver, log)
                cl.ray_.start_node(2)
                cl.ray_.wait_nodes([2], timeout)
                rejoin_time = time.time()
                _wait(lambda: driver.poll() is not None, timeout, "the run did not finish", driver, log)
            except BaseException:
                _keep_logs(cl, folder)
                raise
            finally:
                if driver.poll() is None:
                    driver.kill()
                driver.wait(10)
        result = wire.read(RayDriverResult, Path(spec.result_path)) if Path(spec.result_path).exists() else None
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


def overhead(k: int, step_s: float, checkpoint_s: float, mtbf_s: float, recovery_s: float) -> float:
    """Expected fraction of wall time lost with a checkpoint every ``k`` steps of ``step_s`` s each:
    ``checkpoint_s / (k·step_s)`` (writing checkpoints) ``+ (recovery_s + k·step_s / 2) / mtbf_s``
    (per failure, every ``mtbf_s`` s on average: the restart, measured as ``shrink_s`` above, and half an
    interval of steps redone). First-order model of Young, "A first order approximation to the optimum
    checkpoint interval", CACM 17(9), 1974; its optimum is ``k·step_s = sqrt(2·checkpoint_s·mtbf_s)``,
    whatever ``recovery_s`` (a cost per failure, not per interval)."""
    interval = k * step_s
    return checkpoint_s / interval + (recovery_s + interval / 2) / mtbf_s


def best_interval(step_s: float, checkpoint_s: float, mtbf_s: float, recovery_s: float) -> int:
    """The whole number of steps ``k ≥ 1`` that minimises :func:`overhead` (Young's optimum, rounded to
    the better neighbour)."""
    k = max(1.0, math.sqrt(2 * checkpoint_s * mtbf_s) / step_s)
    candidates = {max(1, math.floor(k)), math.ceil(k)}
    return min(sorted(candidates), key=lambda n: overhead(n, step_s, checkpoint_s, mtbf_s, recovery_s))
