"""The real server (Triton Inference Server through PyTriton) and Triton's load generator (perf_analyzer).

Fast tests: the parsers, the settings, the one-line reasons, the closed-loop simulation. Slow tests start
the server: up and down with nothing left (process, port, /tmp and /dev/shm folders), dynamic batching
measurably on vs off under perf_analyzer (ratios, so they hold on a loaded machine), and the owner
interrupted while the server starts, or SIGKILLed while it serves.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from teraflops.compilation import batching, loadgen, serving
from teraflops.compilation.batching import BatchLatency
from teraflops.compilation.loadgen import LoadPoint
from teraflops.launch.wire import RESULTS_ENV

CAN = serving.why_not() or loadgen.why_not()
needs_server = pytest.mark.skipif(CAN is not None, reason=CAN or "")

METRICS = """# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="decode_batched",version="1"} 365
nv_inference_count{model="decode_single",version="1"} 82
nv_inference_exec_count{model="decode_batched",version="1"} 46
nv_cpu_utilization 0.5
"""
CSV = ("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
       "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency\n"
       "16,125.932,148,3938,53085,90,64803,435,0,122768,177373,185099,227096\n")


def test_metrics_are_read_per_model():
    m = serving.parse_metrics(METRICS)
    assert m["decode_batched"]["nv_inference_count"] == 365 and m["decode_batched"]["nv_inference_exec_count"] == 46
    assert m["decode_single"] == {"nv_inference_count": 82}


def test_perf_analyzer_csv_is_parsed_in_its_units():
    row = loadgen.parse_csv(CSV)
    assert row["Inferences/Second"] == pytest.approx(125.932) and row["p99 latency"] == 227096
    with pytest.raises(serving.ServingError, match="no measurement row"):
        loadgen.parse_csv(CSV.splitlines()[0])


@pytest.mark.parametrize("kw, match", [(dict(queue_delay_ms=-1), "queue_delay_ms"), (dict(max_batch=0), "max_batch"),
                                       (dict(instances=1.5), "instances"), (dict(new_tokens=10_000), "max_seq_len")])
def test_bad_settings_are_one_line(kw, match):
    with pytest.raises(serving.ServingError, match=match):
        serving.Server(**kw)


def test_a_container_without_cap_sys_admin_is_not_ready_to_serve(monkeypatch):
    """Docker and Kubernetes refuse ``unshare --mount`` (EPERM) although ``unshare`` is installed: the
    probe's failure (recorded: util-linux's message) is what why_not() and so ``teraflops doctor`` say."""
    import subprocess

    calls = []

    def refused(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "unshare: unshare failed: Operation not permitted\n")

    why = serving.mount_namespace_error(run=refused)
    assert "Operation not permitted" in why and "CAP_SYS_ADMIN" in why and "\n" not in why
    assert calls[0][-4:] == ["--mount", "--propagation", "private", "true"]
    assert serving.mount_namespace_error(run=lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", "")) is None
    monkeypatch.setattr(serving, "_mount_namespace_once", lambda: why)
    monkeypatch.setattr(serving.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(serving.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(serving.metadata, "version", lambda name: "1.0")
    monkeypatch.setattr(serving.shutil, "which", lambda name: "/usr/bin/" + name)
    assert serving.why_not() == why


def test_why_not_names_the_platform_the_glibc_and_the_extra(monkeypatch):
    monkeypatch.setattr(serving.platform, "machine", lambda: "aarch64")
    assert "x86-64" in serving.why_not()
    monkeypatch.setattr(serving.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(serving.platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert "glibc >= 2.35" in serving.why_not() and "2.31" in serving.why_not()
    monkeypatch.setattr(serving.platform, "libc_ver", lambda: ("glibc", "2.36"))

    def missing(name):
        raise serving.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(serving.metadata, "version", missing)
    assert serving.why_not() == 'nvidia-pytriton is not installed. Fix: pip install -e ".[serving]"'
    monkeypatch.setattr(loadgen, "binary", lambda: None)
    assert loadgen.why_not().startswith("perf_analyzer is not installed. Fix: pip install")
    with pytest.raises(serving.ServingError, match="perf_analyzer is not installed"):
        loadgen.check()


def _point(c, rps, p99):
    return LoadPoint("decode_batched", c, None, rps, rps * 8, p99 / 2, p99, p99, 0, 0, 0, 1.0, 1, 1)


def test_the_knee_is_the_lowest_tail_near_the_best_throughput():
    pts = [_point(1, 30, 40), _point(4, 100, 50), _point(16, 240, 80), _point(32, 250, 160)]
    assert loadgen.knee(pts).concurrency == 16
    assert loadgen.knee(pts, slack=0.0).concurrency == 32


def _rate(rate, rps):
    return LoadPoint("decode_batched", None, rate, rps, rps * 8, 10, 20, 30, 0, 0, 0, 1.0, 1, 1)


def test_the_rate_knee_is_the_highest_offered_rate_still_served():
    pts = [_rate(20, 19.8), _rate(40, 36.5), _rate(80, 60), _rate(160, 62), _point(16, 240, 80)]
    assert loadgen.rate_knee(pts).request_rate == 40  # 36.5 ≥ 0.9 × 40; 60 < 0.9 × 80
    assert loadgen.rate_knee(pts, keep_up=0.95).request_rate == 20  # 36.5 < 0.95 × 40
    assert loadgen.rate_knee([_rate(80, 60), _point(16, 240, 80)]) is None  # no rate kept up; clients ignored


def test_closed_loop_clients_fill_the_batch_and_batch_one_serves_one_over_latency():
    lat = BatchLatency((1, 2, 4, 8, 16), (0.030, 0.031, 0.033, 0.037, 0.045))
    one = batching.simulate_clients(lat, 16, 1, 0.0, 5.0)
    assert one.throughput_rps == pytest.approx(1 / 0.030, rel=0.02) and one.mean_batch == 1
    sizes = [batching.simulate_clients(lat, c, 16, 0.002, 5.0).mean_batch for c in (1, 4, 16)]
    assert sizes[0] == pytest.approx(1) and sizes[1] > 3 and sizes[2] > 12
    with pytest.raises(batching.BatchingError, match="clients"):
        batching.simulate_clients(lat, 0, 16, 0.0)


def test_the_overhead_per_execution_is_a_busy_unbatched_servers_time_beyond_the_models():
    lat = BatchLatency((1, 2, 4), (0.020, 0.022, 0.026))
    single = LoadPoint("decode_single", 16, None, 40.0, 320, 400, 400, 400, 0, 0, 0, 1.0, 1, 1)
    assert loadgen.execution_overhead(single, lat) == pytest.approx(1 / 40 - 0.020)  # 25 ms per execution, 20 of work
    faster = LoadPoint("decode_single", 16, None, 55.0, 440, 300, 300, 300, 0, 0, 0, 1.0, 1, 1)
    assert loadgen.execution_overhead(faster, lat) == 0.0  # noise read faster than the model: no negative cost
    with_it = lat.plus(loadgen.execution_overhead(single, lat))
    assert with_it.seconds == pytest.approx((0.025, 0.027, 0.031)) and "per call" in with_it.label
    # with the overhead the model predicts the busy unbatched server it was calibrated on
    assert batching.simulate_clients(with_it, 16, 1, 0.0, 5.0).throughput_rps == pytest.approx(40, rel=0.02)
    for wrong in (_point(16, 240, 80), LoadPoint("decode_single", 1, None, 40.0, 320, 25, 25, 25, 0, 0, 0, 1.0, 1, 1),
                  LoadPoint("decode_single", None, 40.0, 39.0, 312, 25, 25, 25, 0, 0, 0, 1.0, 1, 1)):
        with pytest.raises(serving.ServingError, match="needs a closed-loop point of decode_single with >= 2"):
            loadgen.execution_overhead(wrong, lat)
    with pytest.raises(batching.BatchingError, match="overhead_s must be seconds"):
        lat.plus(-0.001)


# ----------------------------------------------------------------------------------------- real servers

def _members(folder) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(RESULTS_ENV) == str(folder):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _listening(pids) -> set[tuple[str, int]]:
    out = set()
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            out.add((c.laddr.ip, c.laddr.port))
    return out


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def _gone(folder, ports, timeout=20.0) -> list[str]:
    """What is left of a server after ``timeout`` s: processes, listening ports, folders (empty list: nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        left = ([f"pid {p.pid}" for p in _members(folder)] + [f"port {p}" for p in ports if p in _ports_listening()]
                + [f for f in serving.leftover_paths() if os.path.basename(f) == os.path.basename(str(folder))])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.3)


def _ports_listening() -> set[int]:
    return {c.laddr.port for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


@pytest.mark.slow
@needs_server
def test_batching_measurably_on_vs_off_and_nothing_left_after_stop():
    with serving.Server(queue_delay_ms=2.0) as s:
        folder, ports = s.folder, (s.spec.http_port, s.spec.grpc_port, s.spec.metrics_port)
        pids = {p.pid for p in _members(folder)}
        assert {port for _, port in _listening(pids)} >= set(ports)
        wide = {(ip, port) for ip, port in _listening(pids) if not _loopback(ip)}
        assert not wide, f"the server must listen on loopback only; it listens on {wide}"
        assert s.infer([[1, 2, 3, 4], [5, 6, 7, 8]]).shape == (2, s.new_tokens)
        single = loadgen.measure(s, serving.SINGLE, concurrency=16)
        batched = [loadgen.measure(s, serving.BATCHED, concurrency=c) for c in (1, 4, 16)]
    assert single.executed_batch == pytest.approx(1.0)
    sizes = [p.executed_batch for p in batched]
    assert sizes[0] < 1.2 and sizes[0] < sizes[1] < sizes[2], f"executed batch sizes at 1, 4, 16 clients: {sizes}"
    assert all(1 <= b <= c for b, c in zip(sizes, (1, 4, 16)))  # a batch holds at most the requests in flight
    # what batching buys in requests per second is this machine's figure (printed), not asserted
    assert single.throughput_rps > 0 and all(p.throughput_rps > 0 for p in batched)
    print(f"req/s: unbatched {single.throughput_rps:.0f} at 16 clients, batched "
          + ", ".join(f"{p.throughput_rps:.0f}" for p in batched) + " at 1, 4, 16")
    assert _gone(folder, ports) == []


_OWNER = textwrap.dedent("""
    import sys, time
    from teraflops.compilation.serving import Server
    s = Server()
    if sys.argv[1] == "serve":
        s.start()
        print("FOLDER", s.folder, s.spec.http_port, s.spec.grpc_port, s.spec.metrics_port, flush=True)
        time.sleep(600)
    else:
        print("STARTING", flush=True)
        try:
            s.start()
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(3)
        print("STARTED", flush=True)  # the start finished before the Ctrl-C came: the test tries again
        s.stop()
        sys.exit(4)
""")


def _folders_of(pid: int) -> set[str]:
    """The server folders (``$TMPDIR`` and ``/dev/shm``) whose ``owner.json`` names process ``pid``."""
    out = set()
    for path in serving.leftover_paths():
        with contextlib.suppress(OSError, ValueError):
            if json.loads((Path(path) / "owner.json").read_text()).get("pid") == pid:
                out.add(path)
    return out


def _owner(mode: str) -> subprocess.Popen:
    # Ctrl-C's default action in the owner, whatever this runner ignores (a suite started with `cmd &` runs
    # with SIGINT ignored; Python then installs no KeyboardInterrupt handler and the start is never interrupted)
    return subprocess.Popen([sys.executable, "-c", _OWNER, mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
@needs_server
def test_a_sigkilled_owner_leaves_nothing():
    owner = _owner("serve")
    line = owner.stdout.readline().split()
    assert line and line[0] == "FOLDER", line
    folder, ports = line[1], tuple(int(x) for x in line[2:])
    assert _members(folder)
    owner.kill()
    owner.wait()
    assert _gone(folder, ports) == []


@pytest.mark.slow
@needs_server
def test_an_interrupted_start_leaves_nothing():
    for _ in range(3):  # a start that wins the race with the Ctrl-C (exit 4) proves nothing: again
        owner = _owner("interrupt")
        assert owner.stdout.readline().strip() == "STARTING"
        deadline = time.monotonic() + 120  # a hang guard: importing torch at load 9 takes tens of seconds
        # Ctrl-C once the server program is launched (its log opened) and before it is ready
        new = set()
        while owner.poll() is None and time.monotonic() < deadline:
            new = _folders_of(owner.pid)
            if any((Path(f) / "server.log").exists() for f in new):
                break
            time.sleep(0.05)
        folder = next(f for f in new if not f.startswith("/dev/shm"))  # its own: another test's may start beside
        owner.send_signal(signal.SIGINT)
        code, out = owner.wait(120), owner.stdout.read()
        if code != 4:
            break
    assert code == 3 and "INTERRUPTED" in out, (code, out)
    assert _gone(folder, ()) == [] and not (set(serving.leftover_paths()) & new)
