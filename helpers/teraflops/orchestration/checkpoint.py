"""Checkpoints that a crash cannot leave half-written: write to a temporary file, then rename.

A process killed while ``torch.save`` writes ``step-000020.pt`` in place leaves a truncated file
under a valid name, and the restarted job would load it and fail (or load whatever it holds).
:func:`save_atomic` writes the whole checkpoint to a temporary file in the same directory, flushes
it and ``os.fsync``\\s it to the disk, and only then ``os.replace``\\s it onto its name. POSIX
``rename()`` within one filesystem is atomic: "a link named new shall remain visible ... and refer
either to the file referred to by new or old before the operation began"
(https://pubs.opengroup.org/onlinepubs/9699919799/functions/rename.html; ``os.replace`` is that call),
so a reader sees the old file at that name (or none), or the whole new one, never a mix. The
temporary file must be in the same directory, since a rename across filesystems is a copy. A kill
mid-write leaves at most a stray temporary file, whose name :func:`latest` does not match and which
the next save removes. Syncing the directory after the rename makes the new name itself survive a
power cut, not only a killed process.

Names: ``step-000020.pt`` holds the state after 20 completed steps (the step to run next is 20).
One writer per directory (in data parallelism, rank 0; every rank holds the same state).
:func:`save_latest` saves and then deletes the older checkpoints, so one stays on disk.

How often to checkpoint: :func:`overhead` is the expected share of wall time a checkpoint interval
costs (writing checkpoints, plus per failure the restart and half an interval redone), and
:func:`best_interval` the whole number of steps that minimises it (Young's first-order optimum; Unit 3
measures the restart it needs under torchrun and under Ray, :mod:`teraflops.orchestration.elastic`,
:mod:`teraflops.orchestration.ray_elastic`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from teraflops.errors import CourseError

_NAME = re.compile(r"step-(\d+)\.pt")
_TEMP = re.compile(r"\..+\.(\d+)\.tmp")  # .step-000020.pt.<pid>.tmp


class CheckpointError(CourseError, ValueError):
    """A file cannot be loaded as a checkpoint (cut short, corrupted, not one at all, or holding
    objects ``weights_only`` loading refuses)."""


def checkpoint_path(directory, step: int) -> Path:
    """``directory/step-000020.pt`` for ``step = 20``: the checkpoint taken after ``step`` steps."""
    return Path(directory) / f"step-{step:06d}.pt"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def save_atomic(obj, path) -> Path:
    """``torch.save(obj, path)`` so that ``path`` is at every moment absent, the old file or the
    whole new one (see the module docstring). Creates the directory; removes temporary files that
    earlier saves, killed mid-write, left in it. Returns ``path`` as a Path.

    Raises:
        OSError: the disk is full or not writable (the temporary file is removed, ``path`` unchanged).
    """
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stray in path.parent.iterdir():  # left by a writer that was killed; a live one's stays
        m = _TEMP.fullmatch(stray.name)
        if m and not _alive(int(m.group(1))):
            stray.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # and so is the new directory entry
    finally:
        os.close(fd)
    return path


def save_latest(obj, directory, step: int) -> Path:
    """:func:`save_atomic` of ``obj`` as ``directory/step-NNNNNN.pt``, then delete the directory's
    checkpoints of fewer steps: a run keeps one checkpoint on disk, not one per interval (on the GPU
    preset each is ~1.6 GB). The older files go only after the new one is complete under its name
    and synced, so at every moment the directory holds at least one whole checkpoint. Returns
    the new checkpoint's path.

    Raises:
        OSError: as :func:`save_atomic` (the older checkpoints are then kept).
    """
    path = save_atomic(obj, checkpoint_path(directory, step))
    for old in Path(directory).glob("step-*.pt"):
        m = _NAME.fullmatch(old.name)
        if m and int(m.group(1)) < step:
            old.unlink(missing_ok=True)
    return path


def latest(directory) -> Path | None:
    """The checkpoint of the most steps in ``directory`` (``step-NNNNNN.pt``), or None if it has none
    (or does not exist). Temporary files of unfinished saves are ignored: every file under a
    checkpoint name was complete when it got that name."""
    found = [(int(m.group(1)), p) for p in Path(directory).glob("step-*.pt") if (m := _NAME.fullmatch(p.name))]
    return max(found)[1] if found else None


def load(path, map_location="cpu"):
    """``torch.load`` of a checkpoint (tensors, numbers, strings, lists, dicts: ``weights_only``, so
    loading runs no code from the file), its tensors on ``map_location``.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as for ``open``.
        CheckpointError: the file is cut short, corrupted, not a torch checkpoint, or holds objects
            that ``weights_only`` refuses.
    """
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError, ValueError, KeyError) as e:
        text = str(e).split("WeightsUnpickler error:", 1)[-1]  # torch's long weights_only preamble, skipped
        detail = next((line.strip() for line in text.splitlines() if line.strip()), "")[:160]
        raise CheckpointError(f"cannot load checkpoint {path} ({type(e).__name__}{': ' * bool(detail)}{detail}). "
                              "Hint: it is cut short or damaged (not written by save_atomic?), or holds objects "
                              "other than tensors, numbers, strings, lists and dicts; delete it and latest() "
                              "finds the one before") from None


def overhead(k: int, step_s: float, checkpoint_s: float, mtbf_s: float, recovery_s: float) -> float:
    """Expected fraction of wall time lost with a checkpoint every ``k`` steps of ``step_s`` s each:
    ``checkpoint_s / (k·step_s)`` (writing checkpoints) ``+ (recovery_s + k·step_s / 2) / mtbf_s``
    (per failure, every ``mtbf_s`` s on average: the restart, measured as a Ray run's ``shrink_s`` or
    torchrun's ``restart_s``, and half an interval of steps redone). First-order model of Young, "A first order approximation to the optimum
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
