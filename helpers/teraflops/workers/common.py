"""What the rank programs share: the GPT of a :class:`~teraflops.sizing.TrainConfig`, its token data,
each rank's micro-batch, gradients flattened into one buffer, and the DeepSpeed ZeRO config.

Rank programs import this module, never one another. The model is the same on every rank and in
every run of a config (initialised from ``cfg.seed``); the data is a Markov token stream
(:func:`~teraflops.data.markov_tokens`) whose rows are laid out by global step, so a global batch
does not depend on the world's split of it.
"""

from __future__ import annotations

import gc

import torch

from teraflops.data import markov_tokens
from teraflops.models import GPT, lm_loss
from teraflops.sizing import TrainConfig


def build_model(cfg: TrainConfig, device="cpu") -> GPT:
    """The GPT of ``cfg``, initialised from ``cfg.seed`` (identical on every rank and in every run)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len)
    # built on the CPU, then moved (the same weights on any device); no move to the CPU, where the
    # fake tensors of teraflops.memory.fake_memory measure it
    return model if torch.device(device).type == "cpu" else model.to(device)


def trained_rank(w, cfg: TrainConfig) -> dict:
    """The :class:`~teraflops.parallelization.ddp_sync.TrainedRank` fields of worker ``w``'s result (``w``
    from :func:`teraflops.launch.rank.init_worker`), as keywords of the rank program's Result."""
    return dict(**w.identity(), params=build_model(cfg).num_params(), config=cfg)


def make_data(cfg: TrainConfig, steps: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, int64 ``[rows, seq_len]``: ``steps`` global batches of ``world *
    micro_batch`` sequences, then ``cfg.eval_batches`` more, held out (see :func:`held_out`);
    seeded by ``cfg.seed + 1``."""
    return markov_tokens((steps + cfg.eval_batches) * world * cfg.micro_batch, cfg.seq_len, cfg.vocab, seed=cfg.seed + 1)


def held_out(data, cfg: TrainConfig, steps: int, world: int):
    """The ``cfg.eval_batches`` global batches after the first ``steps`` of ``data`` (:func:`make_data`
    of ``cfg``): no run of ``steps`` steps trained on them."""
    batch = world * cfg.micro_batch
    rows = slice(steps * batch, (steps + cfg.eval_batches) * batch)
    return data[0][rows], data[1][rows]


def held_out_loss(model, data, cfg: TrainConfig, steps: int, world: int, device) -> torch.Tensor:
    """The mean loss (nats, a 0-d fp32 tensor on ``device``) of ``model`` on the :func:`held_out`
    rows, ``cfg.micro_batch`` sequences per forward pass, without gradients.

    One pass over all ``eval_batches · world · micro_batch`` rows would hold their logits and
    ``log_softmax`` at once: on 8 ranks at the GPU preset (seq 1024, vocab 32,768, fp32) 2 × 69 GB
    per rank. In chunks the most that lives is one micro-batch's logits, which training already
    holds. Every chunk has ``micro_batch`` rows, so the mean of the chunks' means is the mean.
    """
    x, y = held_out(data, cfg, steps, world)
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for lo in range(0, len(x), cfg.micro_batch):
            xb, yb = x[lo:lo + cfg.micro_batch].to(device), y[lo:lo + cfg.micro_batch].to(device)
            total += lm_loss(model(xb), yb) * len(xb)
    return total / len(x)


def rank_batch(data, step: int, rank: int, world: int, micro_batch: int):
    """Rank ``rank``'s micro-batch of global step ``step``: ``micro_batch`` rows from row
    ``(step * world + rank) * micro_batch`` of ``data = (inputs, targets)``."""
    start = (step * world + rank) * micro_batch
    return data[0][start:start + micro_batch], data[1][start:start + micro_batch]


def flat_grads(params) -> torch.Tensor:
    """Every parameter's ``.grad`` copied into one flat buffer (parameter order), for one all-reduce."""
    return torch.cat([p.grad.reshape(-1) for p in params])


def set_grads(params, flat: torch.Tensor) -> None:
    """Point each parameter's ``.grad`` at its slice of ``flat`` (no copy)."""
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def sync_device(device) -> None:
    """Wait for this rank's own queued device work (the current CUDA stream); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def release_device_memory(device) -> None:
    """Free what the objects just deleted held: garbage collected, and on CUDA the caching allocator's
    cached blocks returned (``torch.cuda.empty_cache``), so that the next run in this process (the next
    ZeRO stage, whose DeepSpeed buffers differ in size) starts from unfragmented memory."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def zero_config(stage: int, micro_batch: int, bucket: int) -> dict:
    """The DeepSpeed config of one fp32 ZeRO run (https://www.deepspeed.ai/docs/config-json/) that
    keeps ZeRO's communication visible per collective: comms logger on, no overlap, no multi-rank
    bucket all-reduce, stage 3 partitioning every parameter and gathering it again for backward;
    ``bucket``: reduce / all-gather bucket, elements."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, so no fused_adam op to compile
        "steps_per_print": 10**9,
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "use_multi_rank_bucket_allreduce": False,  # stages 1-2 reduce each partition to its owner
            "stage3_param_persistence_threshold": 0,  # partition every parameter, however small
            "stage3_max_live_parameters": 0,  # release gathered parameters after use ...
            "stage3_max_reuse_distance": 0,  # ... so the backward pass gathers them again
            "stage3_prefetch_bucket_size": 0,
        },
    }
