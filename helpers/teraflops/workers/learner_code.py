"""What the rank programs of Unit 2's and Unit 5's by-hand checks share: running the learner's code.

Not a rank program itself (no ``main``): :mod:`teraflops.workers.zero1_check`,
:mod:`teraflops.workers.sharded_check`, :mod:`teraflops.workers.ddp_check`,
:mod:`teraflops.workers.fsdp_check` and :mod:`teraflops.workers.ring_check` import it.

* :func:`define` runs the learner's class or function block (its source, shipped by the check) in a
  namespace holding only ``torch``, ``dist`` (``torch.distributed``), ``math``, ``nn`` and ``F``.
* :class:`LearnerCalls` calls into that code: counted while it runs, an exception kept as the rank's
  error instead of ending the rank; :meth:`LearnerCalls.leave_group` after the result is written, and
  :func:`run_and_exit` around ``main``, end every such rank program the same way.
* :class:`CommLog` wraps ``torch.distributed``'s collectives and point-to-point calls while the
  learner's code runs: calls and elements per name, whether each call was asynchronous, and each
  asynchronous handle (:class:`WatchedWork`) so a check can see whether it was waited on.
* :func:`rank_error` turns an exception into a :class:`~teraflops.parallelization.zero.RankError`
  (where, type, first line without torch's log prefixes, time).
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import time
from contextlib import suppress

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from teraflops.launch.rank import finish
from teraflops.parallelization.zero import RankError

CALLS = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_gather_single",
         "all_gather_into_tensor", "all_gather", "broadcast", "reduce", "all_to_all_single", "send", "recv",
         "isend", "irecv", "batch_isend_irecv")


def define(source: str, name: str):
    """The object ``name`` defined by ``source`` (the learner's block) in a namespace of ``torch``,
    ``dist``, ``math``, ``nn`` and ``F`` only; the compiled code is named ``<name>`` in tracebacks."""
    namespace = {"torch": torch, "dist": dist, "math": math, "nn": nn, "F": F, "__name__": "learner"}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


def rank_error(where: str, e: BaseException, secondary: bool = False) -> RankError:
    """``e`` raised while running ``where``; ``secondary``: the fallout of another rank's failure."""
    # torch's C++ checks start with log prefixes: "[rank0]:[F1129 21:31:24.98 ProcessGroupGloo.cpp:1537] Check failed"
    lines = [re.sub(r"^(\[[^\]]*\]:?\s*)+", "", ln.strip()) for ln in str(e).strip().splitlines() if ln.strip()]
    return RankError(where=where, type=type(e).__name__, message=lines[0][:400] if lines else "", time=time.time(),
                     secondary=secondary)


class LearnerCalls:
    """Calls into the learner's code. While one runs, ``comm`` (a :class:`CommLog`, installed here) counts
    its collectives; an exception it raises becomes :attr:`error` (:func:`rank_error`, ``where`` naming
    the call) and the call returns None, so the rank still writes its result. A rank program stops at
    the first error (``if learner.error: break``)."""

    def __init__(self, comm):
        comm.install()
        self.comm = comm
        self.error: RankError | None = None

    def __call__(self, where: str, fn, *args, **kwargs):
        self.comm.active = True
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - anything the learner's code raised is reported
            self.error = rank_error(where, e)
        finally:
            self.comm.active = False

    def leave_group(self) -> None:
        """After the result is written: leave the process group with the other ranks
        (:func:`~teraflops.launch.rank.finish`), unless this rank saw an error: a rank whose learner code
        failed has left, so there is no barrier with it."""
        if not self.error:
            with suppress(Exception):
                finish()


def run_and_exit(main) -> None:
    """Run a rank program's ``main``, then exit at once: the result is written and the group is gone, so
    the interpreter's teardown of torch's modules (~1.5 s on 2 busy cores, spent after every check) is
    skipped."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WatchedWork:
    """An asynchronous handle (``torch.distributed.Work``) that remembers whether it was waited on."""

    def __init__(self, work):
        self._work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        done = self._work.is_completed()
        self.waited = self.waited or done
        return done

    def get_future(self):
        self.waited = True  # a future's value is waited for through it
        return self._work.get_future()

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def _list_elements(items) -> int:
    """Elements of the tensors in a list (all_gather's outputs), or of the sends among
    ``dist.P2POp`` items (``batch_isend_irecv``: the elements this rank sends)."""
    return sum(t.numel() if isinstance(t, torch.Tensor) else
               t.tensor.numel() if "send" in getattr(getattr(t, "op", None), "__name__", "") else 0 for t in items)


class CommLog:
    """Counts the calls and elements the learner's code passes to each name of :data:`CALLS`, while
    ``active``; ``works`` holds every asynchronous handle handed back, wrapped (:class:`WatchedWork`)."""

    def __init__(self):
        self.active = False
        self.calls: dict[str, int] = {}
        self.elements: dict[str, int] = {}
        self.works: list[WatchedWork] = []
        self.log: list[tuple[str, int]] = []  # (name, elements) in call order
        self.times: list[float] = []  # time.perf_counter() of each logged call (s)
        self._depth = 0  # a deprecated name calls its successor (reduce_scatter_tensor → _single): count once

    def install(self) -> None:
        from torch.distributed import distributed_c10d  # where the functions live: wrap both names

        for name in CALLS:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_counted", False):
                wrapped = self._wrap(name, fn)
                for module in (dist, distributed_c10d):
                    if getattr(module, name, None) is fn:
                        setattr(module, name, wrapped)

    def unwaited(self) -> int:
        """Asynchronous handles not yet waited on."""
        return sum(not w.waited for w in self.works)

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if not self.active or self._depth:
                return fn(*args, **kwargs)
            sizes = [a.numel() if isinstance(a, torch.Tensor) else _list_elements(a) if isinstance(a, (list, tuple)) else 0
                     for a in (*args, *kwargs.values())]
            self.calls[name] = self.calls.get(name, 0) + 1
            self.elements[name] = self.elements.get(name, 0) + max(sizes, default=0)
            self.log.append((name, max(sizes, default=0)))
            self.times.append(time.perf_counter())
            self._depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth -= 1
            if isinstance(out, list):  # batch_isend_irecv
                out = [WatchedWork(w) for w in out]
                self.works.extend(out)
            elif out is not None and hasattr(out, "wait"):
                out = WatchedWork(out)
                self.works.append(out)
            return out

        counted._counted = True
        return counted


def mlp(features: tuple[int, int, int]) -> nn.Module:
    """Linear, GELU, LayerNorm, Linear of ``features`` = (inputs, hidden, outputs), initialised from
    seed 0 (the same on every rank; :mod:`teraflops.workers.zero1_check` trains the same model)."""
    inputs, hidden, outputs = features
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.LayerNorm(hidden), nn.Linear(hidden, outputs))


def mlp_batch(features: tuple[int, int, int], rows: int, step: int, rank: int, device):
    """Rank ``rank``'s regression batch at ``step`` (``rows`` rows, fp32): different on every rank, so
    gradients must be averaged."""
    inputs, _, outputs = features
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, inputs, generator=g)
    y = torch.sin(x[:, :outputs] * (rank + 1)) + 0.1 * torch.randn(rows, outputs, generator=g)
    return x.to(device), y.to(device)


def flat(params) -> list[float]:
    """``params`` (tensors) as one flat list of floats, in order."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in params]).tolist()


def optimizers_in(obj) -> list[torch.optim.Optimizer]:
    """``torch.optim.Optimizer`` instances among ``obj`` and its attributes (and in lists, tuples
    and dicts among them, two levels down)."""
    found, seen = [], set()

    def visit(x, depth):
        if id(x) in seen or depth < 0:
            return
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found.append(x)
        if isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth - 1)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v, depth - 1)
        elif x is obj and hasattr(x, "__dict__"):
            for v in vars(x).values():
                visit(v, depth - 1)

    visit(obj, 2)
    return found
