"""Rank side of Unit 3 §4b: synchronous data-parallel training that resumes from its last checkpoint.

``python -m teraflops.workers.elastic_train --spec PATH`` (a :class:`teraflops.orchestration.elastic.ElasticSpec`),
started by :func:`teraflops.orchestration.elastic.run` through :func:`~teraflops.launch.launcher.launch`, under
torchrun's elastic agent, which restarts every rank when one fails.

Training: the :class:`~teraflops.models.GPT` of the spec's seed on the Markov token stream
(:func:`~teraflops.data.markov_tokens`); at step ``t`` rank ``r`` trains on sequences
``(t * world + r) * B ... + B``, so the batches depend on the global step only and a resumed run
sees exactly the batches an uninterrupted one does. Each step all-reduces one flat buffer holding
every gradient and the loss (gloo or NCCL sum, divided by the world size) and takes an Adam step,
so all ranks keep identical parameters and the logged loss is the global batch's.

Recovery: at start every rank loads the newest checkpoint in the spec's ``checkpoint_dir``
(:func:`teraflops.orchestration.checkpoint.latest`; model, optimizer, step, loss history) or starts from
scratch if there is none. After every ``checkpoint_every`` completed steps rank 0 saves
``step-NNNNNN.pt`` atomically and deletes the older ones (:func:`teraflops.orchestration.checkpoint.save_latest`:
one checkpoint on disk per run), then all ranks pass a
barrier, so a rank that fails later can only lose the steps after a checkpoint that is on disk.
Each step begins at :func:`~teraflops.launch.faults.fault_point`, so ``TERAFLOPS_FAULT=kill:rank=1:step=17``
kills rank 1 before step 17 in the first attempt. Rank 0 appends ``{"step", "loss", "attempt",
"time"}`` (attempt: ``TORCHELASTIC_RESTART_COUNT``; time: Unix seconds when the step finished) to
``steps.jsonl`` in the checkpoint directory, one flushed line per step, which outlives the attempt.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from teraflops.data import markov_tokens
from teraflops.launch.faults import fault_point
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.orchestration.checkpoint import latest, load, save_latest
from teraflops.orchestration.elastic import STEPS_LOG, ElasticResult, ElasticSpec
from teraflops.workers.common import build_model, rank_batch, set_grads


def main(argv: list[str] | None = None) -> None:
    """Train the :class:`~teraflops.orchestration.elastic.ElasticSpec`; write this rank's :class:`~teraflops.orchestration.elastic.ElasticResult`."""
    a = read_spec(ElasticSpec, argv)
    cfg, folder = a.model, Path(a.checkpoint_dir)

    w = init_worker(a.timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model = build_model(cfg, w.device)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr)
    inputs, targets = markov_tokens(a.steps * w.world_size * cfg.micro_batch, cfg.seq_len, cfg.vocab, seed=cfg.seed + 1)
    start, losses = 0, []
    if (found := latest(folder)) is not None:
        state = load(found, map_location=w.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, losses = state["step"], list(state["losses"])
    log = open(folder / STEPS_LOG, "a") if w.rank == 0 else None
    t0 = time.perf_counter()
    for step in range(start, a.steps):
        fault_point(step)
        x, y = (t.to(w.device) for t in rank_batch((inputs, targets), step, w.rank, w.world_size, cfg.micro_batch))
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        flat /= w.world_size
        set_grads(params, flat[:-1])
        opt.step()
        losses.append(flat[-1].item())
        if log:
            log.write(json.dumps({"step": step, "loss": losses[-1], "attempt": attempt, "time": time.time()}) + "\n")
            log.flush()
        if (step + 1) % a.checkpoint_every == 0:
            if w.rank == 0:
                save_latest({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                             "losses": losses}, folder, step + 1)
            dist.barrier()
        report_progress(step + 1, a.steps)
    if log:
        log.close()
    write_result(ElasticResult(**w.identity(), attempt=attempt,
                               resumed_from=start, steps=a.steps, losses=losses, final_loss=losses[-1],
                               params=sum(q.numel() for q in params), train_s=time.perf_counter() - t0))
    finish()


if __name__ == "__main__":
    main()
