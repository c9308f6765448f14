"""The Unit 4 decode model behind Triton Inference Server (PyTriton): ``python -m teraflops.workers.serve_decode --spec PATH``.

Started by :class:`teraflops.compilation.serving.Server` (never by hand) inside a private mount namespace whose
``/tmp`` and ``/dev/shm`` are the server's own folders (see that module), with a
:class:`~teraflops.compilation.serving.ServeSpec`. It builds the preset's decode model
(:func:`teraflops.compilation.decode.decode_model`), times one request's work at each batch size in this very
process (the per-batch latency the SimPy model is driven with), binds two Triton models of it on
127.0.0.1: ``decode_batched`` (Triton's dynamic batcher, ``max_queue_delay_microseconds`` from the spec) and
``decode_single`` (no batcher: one request per execution), writes a
:class:`~teraflops.compilation.serving.ServeReady` to ``ready.json`` and serves until SIGTERM/SIGINT or until
its owner (the notebook kernel) is gone, then ends Triton's processes (:func:`_end_tree`).

One request = one whole short generation: a prompt of ``prompt_len`` token ids in, ``new_tokens`` greedy
tokens out (prefill, then decode steps with a static KV cache). A batch of B requests runs as one batched
generation.
"""

from __future__ import annotations

import os
import signal
import statistics
from contextlib import suppress
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from teraflops.compilation.decode import decode_model, generate
from teraflops.compilation.serving import BATCHED, SINGLE, ServeReady, ServeSpec
from teraflops.launch import wire
from teraflops.launch.rank import read_spec
from teraflops.launch.scripts.proc_identity import proc_start
from teraflops.sizing import preset

_STOP = []


def _on_signal(signum, frame):
    _STOP.append(signum)


def _time_batches(run, spec: ServeSpec, vocab: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Median seconds of ``run(prompt)`` at each of ``spec.latency_batches`` (one warm-up, then ``spec.latency_reps``)."""
    rng = np.random.default_rng(0)
    out = []
    for b in spec.latency_batches:
        prompt = rng.integers(0, vocab, (b, spec.prompt_len), dtype=np.int64)
        run(prompt)
        times = []
        for _ in range(spec.latency_reps):
            t0 = time.perf_counter()
            run(prompt)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return tuple(spec.latency_batches), tuple(out)


def main(argv: list[str] | None = None) -> None:
    spec = read_spec(ServeSpec, argv)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)  # also where a shell started us with SIGINT ignored
    torch.set_num_threads(spec.threads)
    p = preset(spec.preset)
    model = decode_model(p)
    device = next(model.parameters()).device
    vocab = p.decode.vocab

    @torch.inference_mode()
    def run(prompt: np.ndarray) -> np.ndarray:
        tokens = torch.from_numpy(np.ascontiguousarray(prompt)).long().remainder_(vocab)
        cache = model.new_cache(tokens.shape[0], max_seq_len=spec.prompt_len + spec.new_tokens)
        out = generate(model, tokens.to(device), spec.new_tokens, cache=cache).tokens[:, spec.prompt_len:]
        return out.cpu().numpy()

    batch_sizes, batch_seconds = _time_batches(run, spec, vocab)

    from pytriton.decorators import batch  # lazy: the serving extra, only in the server process
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    @batch
    def infer(prompt):
        return {"tokens": run(prompt)}

    config = TritonConfig(http_address="127.0.0.1", grpc_address="127.0.0.1", metrics_address="127.0.0.1",
                          http_port=spec.http_port, grpc_port=spec.grpc_port, metrics_port=spec.metrics_port,
                          log_file=Path(spec.folder) / "tritonserver.log", exit_timeout_secs=1)
    inputs = [Tensor(name="prompt", dtype=np.int64, shape=(spec.prompt_len,))]
    outputs = [Tensor(name="tokens", dtype=np.int64, shape=(spec.new_tokens,))]
    batcher = DynamicBatcher(max_queue_delay_microseconds=spec.queue_delay_us)
    with Triton(config=config, workspace=Path(spec.folder) / "workspace",
                security_config=TritonSecurityConfig(access_token=spec.token)) as triton:
        triton.bind(BATCHED, [infer] * spec.instances, inputs, outputs,
                    config=ModelConfig(max_batch_size=spec.max_batch, batcher=batcher))
        triton.bind(SINGLE, [infer] * spec.instances, inputs, outputs,
                    config=ModelConfig(max_batch_size=spec.max_batch, batcher=None))
        triton.run()
        wire.write(ServeReady(pid=os.getpid(), ready_s=time.monotonic() - started, batch_sizes=batch_sizes,
                              batch_seconds=batch_seconds, device=str(device), threads=torch.get_num_threads()),
                   Path(spec.folder) / "ready.json")
        while not _STOP and proc_start(spec.owner_pid) == spec.owner_start:
            time.sleep(0.25)
        print(f"stopping ({'signal ' + str(_STOP[0]) if _STOP else 'owner gone'})", flush=True)
        _end_tree()


def _end_tree() -> None:
    """SIGKILL this process's descendants (tritonserver, its backend stubs, PyTriton's proxies), then exit.

    Not PyTriton's graceful ``Triton.stop()``: that takes ~4 s and the interpreter's exit 2 s more on the
    2-core machine, and there is nothing to save: every file and shared-memory region of the server lies in
    its own folders (its private ``/tmp`` and ``/dev/shm``), which the host removes, and the kernel frees
    the ports with the processes."""
    kids = psutil.Process().children(recursive=True)
    for kid in kids:
        with suppress(psutil.Error):
            kid.kill()
    psutil.wait_procs(kids, timeout=5)
    os._exit(0)


if __name__ == "__main__":
    main()
