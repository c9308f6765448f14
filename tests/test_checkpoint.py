"""teraflops.orchestration.checkpoint: atomic save (write, fsync, rename), latest, load; a real SIGKILL mid-write."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from teraflops.orchestration.checkpoint import (CheckpointError, best_interval, checkpoint_path, latest, load, overhead,
                                                save_atomic)

DEAD_PID = 2**22 + 1  # above Linux's largest pid_max: no process has it


def state(step: int, n: int = 10) -> dict:
    return {"model": {"w": torch.full((n,), float(step))}, "step": step, "losses": [1.5] * step}


def test_round_trip_and_latest_is_the_most_steps(tmp_path):
    assert latest(tmp_path) is None and latest(tmp_path / "missing") is None
    for step in (3, 12, 9):
        assert save_atomic(state(step), checkpoint_path(tmp_path, step)) == tmp_path / f"step-{step:06d}.pt"
    (tmp_path / "step-000099.pt.bak").write_bytes(b"x")  # not a checkpoint name
    (tmp_path / "step-latest.pt").write_bytes(b"x")
    assert latest(tmp_path) == tmp_path / "step-000012.pt"
    got = load(latest(tmp_path))
    assert got["step"] == 12 and got["losses"] == [1.5] * 12 and torch.equal(got["model"]["w"], torch.full((10,), 12.0))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_stray_temp_file_is_ignored_and_the_next_save_removes_it(tmp_path):
    save_atomic(state(5), checkpoint_path(tmp_path, 5))
    stray = tmp_path / f".step-000010.pt.{DEAD_PID}.tmp"  # a writer killed mid-save
    live = tmp_path / f".step-000010.pt.{os.getppid()}.tmp"  # a writer still at work
    stray.write_bytes(b"PK\x03\x04 half a checkpoint")
    live.write_bytes(b"busy")
    assert latest(tmp_path) == checkpoint_path(tmp_path, 5)
    save_atomic(state(6), checkpoint_path(tmp_path, 6))
    assert not stray.exists() and live.exists() and latest(tmp_path) == checkpoint_path(tmp_path, 6)


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temp_file(tmp_path):
    path = save_atomic(state(1), checkpoint_path(tmp_path, 1))
    with pytest.raises(Exception):
        save_atomic({"f": lambda: 0}, path)  # a lambda cannot be pickled: fails mid-write
    assert load(path)["step"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_corrupt_file_gives_a_one_line_error(tmp_path, damage):
    path = save_atomic(state(7, n=10_000), checkpoint_path(tmp_path, 7))
    data = path.read_bytes()
    path.write_bytes({"garbage": b"not a checkpoint\n" * 10, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(CheckpointError) as info:
        load(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "Hint:" in msg, msg


WRITER = textwrap.dedent("""
    import sys, torch
    from teraflops.orchestration.checkpoint import checkpoint_path, save_atomic
    directory, n = sys.argv[1], 4 << 20
    for step in range(1, 1000):
        save_atomic({"step": step, "x": torch.full((n,), float(step))}, checkpoint_path(directory, step))
        checkpoint_path(directory, step - 2).unlink(missing_ok=True)  # keep the disk use small
""")


@pytest.mark.slow
def test_a_kill_mid_write_leaves_the_last_complete_checkpoint(tmp_path):
    """A process saving 16 MB checkpoints in a loop is SIGKILLed while a temporary file exists."""
    for attempt in range(5):  # the kill may land just after a rename; then try again
        directory = tmp_path / str(attempt)
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)])
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                names = [p.name for p in directory.iterdir()] if directory.exists() else []
                if len(names) >= 2 and any(n.endswith(".tmp") for n in names):  # a checkpoint done, one in flight
                    break
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        strays = [p for p in directory.iterdir() if p.name.endswith(".tmp")]
        if strays:
            break
    assert strays, "never caught the writer mid-write"
    last = latest(directory)
    got = load(last)
    assert last == checkpoint_path(directory, got["step"]) and got["x"].numel() == 4 << 20
    assert torch.equal(got["x"], torch.full((4 << 20,), float(got["step"])))
    save_atomic(state(0), checkpoint_path(directory, 0))  # the next save removes the dead writer's stray
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_save_latest_keeps_only_the_newest_checkpoint(tmp_path):
    from teraflops.orchestration.checkpoint import save_latest

    for step in (3, 6, 9):
        assert save_latest(state(step), tmp_path, step) == checkpoint_path(tmp_path, step)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{step:06d}.pt"]
    assert load(latest(tmp_path))["step"] == 9


def test_youngs_interval_is_the_overheads_minimum():
    # sqrt(2 · 0.5 s · 600 s) = 24.49 s of 0.25 s steps = 97.98: the whole numbers 97 and 98 are compared
    k = best_interval(0.25, 0.5, 600.0, 45.0)
    assert k == 98 and all(overhead(k, 0.25, 0.5, 600.0, 45.0) <= overhead(n, 0.25, 0.5, 600.0, 45.0)
                           for n in range(1, 400))
    # 0.5/(98·0.25) + (45 + 98·0.25/2)/600, worked by hand
    assert overhead(98, 0.25, 0.5, 600.0, 45.0) == pytest.approx(0.5 / 24.5 + (45 + 12.25) / 600)
