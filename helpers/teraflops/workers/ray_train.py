"""Driver and worker side of Unit 3's Ray Train run: the course's GPT data-parallel under Ray Train.

``python -m teraflops.workers.ray_train --spec PATH`` (a :class:`teraflops.orchestration.ray_elastic.RaySpec`) runs
*inside node 0* of an emulated Ray cluster (:mod:`teraflops.nodes.ray`), started by
:func:`teraflops.orchestration.ray_elastic.run`. It is the job's **driver**: it connects to the cluster
(``ray.init(address=...)``) and hands Ray Train's ``TorchTrainer`` (its V2 API, Ray 2.60's default;
https://docs.ray.io/en/latest/train/api/api.html) the training function :func:`train_loop`, which Ray
runs in one worker process per ``ScalingConfig`` worker, on whichever nodes it places them, with a
gloo process group it sets up (``torch.distributed``). The driver writes the run's
:class:`~teraflops.orchestration.ray_elastic.RayDriverResult` to the spec's ``result_path``.

Training (every worker): the :class:`~teraflops.models.GPT` of the spec's seed on the Markov token
stream; global step ``t`` trains on rows ``t·G ... t·G + G`` (``G``: the spec's global batch), of
which worker ``r`` of ``w`` takes the ``r``-th of ``w`` equal slices. Gradients are averaged over the
workers by one all-reduce (sum / w), so the update is the global batch's mean gradient whatever the
number of workers: a run that shrinks from 3 workers to 2 computes the same steps, up to float
rounding. Each step reports ``ray.train.report(metrics, checkpoint=...)`` (every worker reports;
rank 0 attaches a checkpoint, model + optimizer + step, every ``checkpoint_every`` steps). At start
a worker resumes from ``ray.train.get_checkpoint()``, the last checkpoint Ray registered, if any.
Rank 0 appends ``{"step", "loss", "world", "nodes", "time", "checkpoint_s"}`` to the spec's
``steps_log`` (one flushed JSON line per step; ``nodes``: the addresses of the workers' nodes;
``time``: Unix seconds; ``checkpoint_s``: what the *previous* step's checkpoint took, 0 without one),
which the host reads while the run goes on. Each step lasts at least the spec's ``step_s`` (the
model's step here is a few ms; the pause stretches the run so a node can die and come back while it
trains; it is not compute).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from teraflops.data import markov_tokens
from teraflops.launch import wire
from teraflops.launch.rank import read_spec
from teraflops.models import lm_loss
from teraflops.orchestration.ray_elastic import RayDriverResult, RaySpec
from teraflops.workers.common import build_model, set_grads


def _node_address() -> str:
    """This worker's node address (the emulated node's ``eth0``; Ray's own view)."""
    import ray  # lazy: only in Ray workers and the driver

    return ray.util.get_node_ip_address()


def train_loop(config: dict) -> None:
    """Ray Train's per-worker function: :class:`RaySpec` ``config["spec"]`` (as JSON), trained from the last
    registered checkpoint (module docstring)."""
    import ray.train  # lazy: only in Ray workers
    from ray.train import Checkpoint

    a = wire.from_json(RaySpec, config["spec"])
    cfg = a.model
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = build_model(cfg)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr)
    inputs, targets = markov_tokens(a.steps * a.global_batch, cfg.seq_len, cfg.vocab, seed=cfg.seed + 1)
    start = 0
    found = ray.train.get_checkpoint()
    if found is not None:
        with found.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    nodes = [None] * world
    dist.all_gather_object(nodes, _node_address())
    share = a.global_batch // world
    last_checkpoint_s = 0.0  # the previous step's checkpoint: rank 0's save + Ray's registration, s
    for step in range(start, a.steps):
        while world < a.num_workers and a.hold_path and _held(Path(a.hold_path), rank):
            time.sleep(0.2)  # a smaller group waits for the host's node to come back (RaySpec.hold_path)
        t0 = time.monotonic()
        rows = slice(step * a.global_batch + rank * share, step * a.global_batch + (rank + 1) * share)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs[rows]), targets[rows])
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        flat /= world
        set_grads(params, flat[:-1])
        opt.step()
        loss_value = flat[-1].item()
        time.sleep(max(0.0, a.step_s - (time.monotonic() - t0)))
        metrics = {"step": step + 1, "loss": loss_value, "world": world, "resumed_from": start}
        if rank == 0:
            with open(a.steps_log, "a") as log:
                log.write(json.dumps({"step": step + 1, "loss": loss_value, "world": world, "nodes": nodes,
                                      "resumed_from": start, "time": time.time(),
                                      "checkpoint_s": last_checkpoint_s}) + "\n")
        t1 = time.monotonic()
        if (step + 1) % a.checkpoint_every == 0 or step + 1 == a.steps:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                               Path(d) / "state.pt")
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
            last_checkpoint_s = time.monotonic() - t1  # logged with the next step (this one's line is written)
        else:
            ray.train.report(metrics)
            last_checkpoint_s = 0.0


def _held(path: Path, rank: int) -> bool:
    """Whether the host's hold file exists, as rank 0 sees it, the same answer on every rank (one broadcast:
    ranks that each looked for themselves could disagree and leave one alone in the next all-reduce)."""
    flag = torch.tensor([1.0 if rank == 0 and path.exists() else 0.0])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def _scaling(a: RaySpec):
    from ray.train import ScalingConfig  # lazy: only in the driver

    workers = a.num_workers if a.min_workers is None else (a.min_workers, a.num_workers)
    return ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 1},
                         placement_strategy="SPREAD", elastic_resize_monitor_interval_s=a.resize_interval_s)


def drive(a: RaySpec) -> RayDriverResult:
    """Run :func:`train_loop` under ``TorchTrainer`` on the cluster at ``RAY_ADDRESS``; the result."""
    import ray  # lazy: only in the driver
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": a.ifname, "OMP_NUM_THREADS": "1",
                                       **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}})
    t0 = time.time()
    events: list[dict] = []
    watching = threading.Event()
    watcher = threading.Thread(target=_watch_nodes, args=(events, watching, a.node_poll_s), daemon=True)
    watcher.start()
    trainer = TorchTrainer(train_loop, train_loop_config={"spec": wire.to_json(a)},
                           torch_config=TorchConfig(backend="gloo", timeout_s=int(a.collective_timeout_s)),
                           scaling_config=_scaling(a),
                           run_config=RunConfig(name=a.run_name, storage_path=a.storage_path,
                                                failure_config=FailureConfig(max_failures=a.max_failures)))
    try:
        result = trainer.fit()
        error = None if result.error is None else f"{type(result.error).__name__}: {result.error}"
        metrics = dict(result.metrics or {})
    except Exception as e:  # noqa: BLE001 - handed back to the host in the result
        error, metrics = f"{type(e).__name__}: {e}".splitlines()[0][:500], {}
        traceback.print_exc()
    watching.set()
    watcher.join(5)
    return RayDriverResult(ok=error is None, error=error, final_loss=metrics.get("loss"),
                           final_step=metrics.get("step"), started=t0, ended=time.time(), host=socket.gethostname(),
                           node_events=list(events), attempts=_attempts())


def _attempts() -> list[dict]:
    """Ray Train's record of this job's worker-group attempts, oldest first: ``{"start", "end", "status",
    "workers", "nodes", "detail"}`` (Unix s; ``workers``: the group's size, ``nodes``: its workers' node
    addresses, empty for a group that never started). Read from Train's state actor (the record behind its
    dashboard page: ``ray.train.v2._internal.state``, Ray 2.60; an internal API, hence the fallback to none)."""
    import ray  # lazy: only in the driver

    try:
        from ray.train.v2._internal.state.state_actor import get_state_actor

        actor = get_state_actor()
        runs = ray.get(actor.get_train_run_attempts.remote(), timeout=30) if actor is not None else {}
    except Exception:  # noqa: BLE001 - another Ray version: the run stands without the attempts
        traceback.print_exc()
        return []
    out = [{"start": a.start_time_ns / 1e9, "end": None if a.end_time_ns is None else a.end_time_ns / 1e9,
            "status": getattr(a.status, "value", str(a.status)), "workers": len(a.resources),
            "nodes": [w.node_ip for w in a.workers], "detail": (a.status_detail or "").strip()[:400]}
           for attempts in runs.values() for a in attempts.values()]
    return sorted(out, key=lambda a: a["start"])


def _watch_nodes(events: list, stop: threading.Event, every: float) -> None:
    """Append ``{"time", "address", "alive"}`` to ``events`` whenever a node's state in the GCS's node
    table (``ray.nodes()``) changes, polling every ``every`` s until ``stop`` is set."""
    import ray  # lazy: only in the driver

    seen: dict[str, bool] = {}
    while not stop.is_set():
        try:
            table = ray.nodes()
        except Exception:  # noqa: BLE001 - the GCS busy for a moment: try again
            table = []
        for n in table:
            key, alive = n.get("NodeID"), bool(n.get("Alive"))
            if seen.get(key) != alive:
                seen[key] = alive
                events.append({"time": time.time(), "address": n.get("NodeManagerAddress"), "alive": alive})
        stop.wait(every)


def main(argv: list[str] | None = None) -> None:
    """Read the spec, drive the run, write the result to the spec's ``result_path``."""
    a = read_spec(RaySpec, argv)
    wire.write(drive(a), Path(a.result_path))


if __name__ == "__main__":
    main()
