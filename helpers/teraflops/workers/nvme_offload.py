"""Rank side of Unit 5 §5's offload runs: train models.GPT under DeepSpeed ZeRO-3 with the parameters and
the optimizer offloaded, to NVMe (swap files) and to CPU memory, one pass after the other.

Started by :func:`teraflops.hardware.offload.run_nvme_offload` through the DeepSpeed launcher:
``python -m teraflops.workers.nvme_offload --spec PATH`` (a :class:`teraflops.hardware.offload.OffloadSpec`,
whose passes carry their whole DeepSpeed config). Each pass builds the same model (same seed), sees the
same batches and hands back a :class:`teraflops.hardware.offload.OffloadPassResult`: per step the bytes this
process read from and wrote to the disk (``/proc/self/io``'s ``read_bytes``/``write_bytes`` just before
the forward and just after the optimizer step: DeepSpeed's ``async_io`` threads are this process's, and
their ``O_DIRECT`` requests are counted there), the step's wall time and loss; the parameters DeepSpeed
put on NVMe (``ds_tensor.final_location``) and the bytes of the swap files left after the last step.

The model is partitioned by ``deepspeed.zero.Init(module=model, config_dict_or_path=config)`` before
``deepspeed.initialize``, not by the conversion inside it: that conversion passes the model's dtype to
``Init``, whose ``_set_dtype`` (``deepspeed/runtime/zero/partition_parameters.py``) reads ``dtype or
torch.float16 if is_fp16_supported() else torch.bfloat16 ...``, i.e. ``(dtype or fp16) if ... else ...``:
on an accelerator without fp16 (the CPU) the fp32 given is dropped for bf16, the parameter swapper
counts 2-byte elements, and no fp32 tensor under 2 MiB is ever swapped (measured here: no parameter on
NVMe). Without a dtype, ``Init`` takes it from the config: fp32.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from teraflops.data import markov_tokens
from teraflops.hardware.offload import OffloadPass, OffloadPassResult, OffloadResult, OffloadSpec, io_delta, proc_io
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.workers.common import build_model, rank_batch, release_device_memory


def _on_nvme(param) -> bool:
    where = getattr(getattr(param, "ds_tensor", None), "final_location", None)
    return getattr(where, "value", where) == "nvme"


def _folder_bytes(config: dict) -> int:
    """Bytes of the files under the pass's ``nvme_path`` (0 when it has none)."""
    path = config["zero_optimization"]["offload_param"].get("nvme_path")
    if not path:
        return 0
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.name.startswith("."))


def run_pass(one: OffloadPass, spec: OffloadSpec, world: int, rank: int, step0: int) -> OffloadPassResult:
    import deepspeed

    cfg, steps = spec.model, spec.steps
    model = build_model(cfg)
    numels = [p.numel() for p in model.parameters()]  # before DeepSpeed partitions them (then numel() reads 0)
    deepspeed.zero.Init(module=model, config_dict_or_path=one.config,  # no dtype: see the module docstring
                        remote_device=one.config["zero_optimization"]["offload_param"]["device"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=one.config)
    data = markov_tokens(world * cfg.micro_batch * steps, cfg.seq_len, cfg.vocab, seed=cfg.seed)
    device = engine.device
    reads, writes, step_s, losses = [], [], [], []
    for step in range(steps):
        x, y = (t.to(device) for t in rank_batch(data, step, rank, world, cfg.micro_batch))
        before, start = proc_io(), time.perf_counter()
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - start)
        read, written = io_delta(before, proc_io())
        reads.append(read)
        writes.append(written)
        losses.append(loss.item())
        report_progress(step0 + step + 1, len(spec.passes) * steps)
    result = OffloadPassResult(device=one.device, read_bytes=reads, write_bytes=writes, step_s=step_s, losses=losses,
                               param_numels=numels, nvme_params=sum(map(_on_nvme, engine.module.parameters())),
                               swap_file_bytes=_folder_bytes(one.config))
    engine.destroy()
    del engine, model, optimizer
    release_device_memory(device)
    return result


def main() -> None:
    spec = read_spec(OffloadSpec)  # the DeepSpeed launcher may append --local_rank: read_spec ignores it
    worker = init_worker(spec.timeout_s, deepspeed=True)
    passes = tuple(run_pass(one, spec, worker.world_size, worker.rank, i * spec.steps)
                   for i, one in enumerate(spec.passes))
    write_result(OffloadResult(**worker.identity(), passes=passes))
    finish()


if __name__ == "__main__":
    main()
