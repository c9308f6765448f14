"""teraflops.launch.launcher on CPU (gloo): launches through torchrun and DeepSpeed, and clean failures.

Every launch must leave no process and no bound port behind, whether it succeeds, a rank is
killed or hangs, or the notebook interrupts it. Each launch costs ~10 s on 2 cores (torch imports).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from teraflops.launch.faults import FAULT_ENV, fault_point, parse_fault
from teraflops.launch.launcher import LaunchFailed
from teraflops.launch.ports import free_port, port_in_use
from teraflops.launch.rank import report_progress, write_result
from teraflops.launch.selftest import SelftestSpec, run

def assert_clean(port):
    assert psutil.Process().children(recursive=True) == []
    assert not port_in_use(port)


# A successful launch is exercised by the relaunch below (torchrun) and by tests/test_zero.py (DeepSpeed's
# launcher); each launch costs ~10 s of start-up on 2 cores.


@pytest.mark.slow
def test_killed_rank_fails_in_one_line_then_the_port_is_reusable():
    port = free_port()
    with pytest.raises(LaunchFailed) as info:
        run(2, env={FAULT_ENV: "kill:rank=1:step=2"}, port=port, timeout=600)
    msg = str(info.value)
    # the death was seen, not waited out: the launch's own timeout says "timed out after"
    assert "timed out after 600 s" not in msg
    assert "\n" not in msg and "rank 1 of 2 was killed by SIGKILL" in msg and info.value.rank == 1, msg
    assert str(info.value.logs) in msg
    shutil.rmtree(info.value.logs)
    assert_clean(port)
    assert run(2, SelftestSpec(steps=1), port=port)[1].sum == 3.0


@pytest.mark.slow
def test_hung_rank_makes_the_collective_time_out():
    port = free_port()
    with pytest.raises(LaunchFailed) as info:
        run(2, SelftestSpec(timeout_s=5), env={FAULT_ENV: "hang:rank=1:step=2"}, port=port, timeout=600)
    msg = str(info.value)
    # the collective's own 5 s timeout ended the run, not the launch's 600 s one
    assert "timed out after 600 s" not in msg
    assert "\n" not in msg and "timed out" in msg.lower() and "rank(s) [1] never reached it" in msg, msg
    shutil.rmtree(info.value.logs)
    assert_clean(port)


@pytest.mark.slow
def test_interrupt_stops_every_process():
    port = free_port()  # the notebook's interrupt button raises KeyboardInterrupt in the kernel
    # as a Jupyter kernel does; a test process started in the background inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(8, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(2, SelftestSpec(timeout_s=60), env={FAULT_ENV: "hang:rank=1:step=0"}, port=port, timeout=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert_clean(port)


def test_free_port_and_port_in_use():
    import socket

    port = free_port()
    assert 0 < port < 65536 and not port_in_use(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert port_in_use(port)
    assert not port_in_use(port)


def test_parse_fault():
    assert parse_fault("kill:rank=1:step=3") == ("kill", 1, 3)
    assert parse_fault("hang:step=0:rank=2").rank == 2
    assert parse_fault("") is None and parse_fault(None) is None


@pytest.mark.parametrize("spec", ["kill", "kill:rank=1", "boom:rank=1:step=2", "kill:rank=x:step=1",
                                  "kill:rank=1:step=2:extra=3", "kill:rank=1:rank=2"])
def test_parse_fault_rejects(spec):
    with pytest.raises(ValueError, match="KIND:rank=R:step=S"):
        parse_fault(spec)


def test_fault_point_fires_only_for_its_rank_and_step(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "raise:rank=1:step=2")
    monkeypatch.setenv("RANK", "0")
    fault_point(2)  # another rank: nothing happens
    monkeypatch.setenv("RANK", "1")
    fault_point(1)
    with pytest.raises(RuntimeError, match="step 2"):
        fault_point(2)


def test_results_and_progress_files(monkeypatch, tmp_path):
    monkeypatch.setenv("TERAFLOPS_RESULTS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    write_result({"loss": 0.5})
    report_progress(1, 4)  # only rank 0 reports progress
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.json"]
    monkeypatch.setenv("RANK", "0")
    report_progress(2, 4)
    assert (tmp_path / "progress.json").read_text() == '{"done": 2, "total": 4}'


@pytest.mark.slow
def test_a_stale_build_lock_is_removed_and_a_live_one_kept(monkeypatch, tmp_path):
    # torch's JIT loader waits forever on a lock file a killed rank left (file_baton.py): the launch clears it,
    # but never one a live process holds (open, as FileBaton keeps it), however old, nor beside a mere waiter
    from teraflops.launch import ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / ops.SHM_OP / "lock"
    lock.parent.mkdir()
    assert not ops.clear_stale_build_lock()  # no lock: nothing to do
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | "
                               "os.O_EXCL); print('held', flush=True); time.sleep(60)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    waiter = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nwhile os.path.exists(sys.argv[1]): "
                               "time.sleep(0.1)", str(lock)])
    try:
        assert holder.stdout.readline().strip() == "held"
        os.utime(lock, (time.time() - 3600, time.time() - 3600))  # old, and a waiter started after it: still held
        assert ops.holders(lock) == [holder.pid]
        assert not ops.clear_stale_build_lock() and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    try:
        assert ops.clear_stale_build_lock() and not lock.exists()  # the holder died holding it: stale
        waiter.wait(10)  # and the waiter goes on
    finally:
        waiter.kill()
        waiter.wait()


WATCHDOG_LOG = """[rank1]:[E1201 12:00:00.000000 123 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective \
operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, Timeout(ms)=5000) ran for 5012 \
milliseconds before timing out.
terminate called after throwing an instance of 'c10::DistBackendError'
Fatal Python error: Aborted

Thread 0x00007f (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
"""


def test_an_nccl_watchdog_timeout_is_a_timeout_naming_the_rank_not_faulthandlers_last_line(tmp_path):
    from teraflops.launch.diagnosis import diagnose, nccl_timeout

    for r in range(3):
        (tmp_path / f"rank{r}.err").write_text(WATCHDOG_LOG if r in (0, 1) else "")
        (tmp_path / f"rank{r}.exit").write_text(json.dumps({"rank": r, "returncode": -6 if r < 2 else -15,
                                                             "time": 1.0 + r}))
    assert "allreduce (collective #5)" in nccl_timeout(tmp_path / "rank1.err")
    rank, line = diagnose(tmp_path, 3, 1, 60, "torchrun", None)
    assert rank == 0 and "\n" not in line
    assert "allreduce" in line and "5.012 s against a 5 s timeout" in line and "rank(s) [2] never reached it" in line
    assert "Aborted" not in line
