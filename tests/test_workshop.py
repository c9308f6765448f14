"""A workshop on one machine (issue 20): clusters belong to their owners, a killed notebook takes its
run with it, a host's warm cache, builds that say why they failed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from teraflops import cluster as cl
from teraflops import ownership

REASON = cl.unavailable() if sys.platform == "linux" else "needs Linux"
NEEDS_NODES = pytest.mark.skipif(REASON is not None, reason=f"emulated nodes unavailable: {REASON}")
TRIALS = int(os.environ.get("TERAFLOPS_UP_TRIALS", "2"))  # 20 by hand: TERAFLOPS_UP_TRIALS=20


def _shell(*args: str) -> subprocess.Popen:
    """A shell that runs `teraflops cluster ARGS`, prints its exit code and stays (it owns the cluster)."""
    line = " ".join([sys.executable, "-m", "teraflops", "cluster", *args])
    return subprocess.Popen(["sh", "-c", f"{line}; echo rc=$?; exec sleep 120"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _until_done(shell: subprocess.Popen) -> str:
    out = []
    for line in shell.stdout:
        out.append(line)
        if line.startswith("rc="):
            return "".join(out)
    return "".join(out)


def _ping(name: str) -> bool:
    """A TCP connection from node 0 to node 1 of cluster ``name`` (the machine has no ping)."""
    ns = f"{cl.PREFIX}{name}-node"
    server = subprocess.Popen(["ip", "netns", "exec", ns + "1", sys.executable, "-c",
                               "import socket; s = socket.create_server(('10.213.0.2', 5599)); print('up', flush=True); "
                               "s.settimeout(10); c, _ = s.accept(); c.sendall(b'ok')"], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "up":
            return False
        client = subprocess.run(["ip", "netns", "exec", ns + "0", sys.executable, "-c",
                                 "import socket; print(socket.create_connection(('10.213.0.2', 5599), 5).recv(2))"],
                                capture_output=True, text=True, timeout=20)
        return "ok" in client.stdout
    finally:
        server.kill()
        server.wait()


def test_a_claim_is_atomic_and_a_dead_owners_claim_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv(ownership.CLUSTER_DIR_ENV, str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert ownership.claim("x", 2, pid=os.getppid())[0]
    ok, held = ownership.claim("x", 2)
    assert not ok and held["pid"] == os.getppid()  # a live owner's name is refused, its record kept
    assert ownership.read("x")["pid"] == os.getppid()
    (tmp_path / "y.json").write_text('{"pid": %d, "start": 1.0, "user": "gone"}' % dead.pid)
    assert ownership.claim("y", 2)[0] and ownership.read("y")["pid"] == os.getpid()


@NEEDS_NODES
@pytest.mark.slow
@pytest.mark.parametrize("same_name", [False, True])
def test_concurrent_ups_both_work_or_one_refuses_and_down_spares_live_owners(same_name):
    for trial in range(TRIALS):
        name = f"w20t{trial}"
        shells = [_shell("up", *(["--name", name] if same_name else [])) for _ in range(2)]
        try:
            outs = [_until_done(s) for s in shells]
            ok = [o for o in outs if "rc=0" in o]
            names = [o.split("cluster '", 1)[1].split("'", 1)[0] for o in ok]
            if same_name:  # one cluster, one clean refusal that names the owner
                assert len(ok) == 1 and any("belongs to" in o and "rc=2" in o for o in outs), outs
            else:  # each shell its own cluster
                assert len(ok) == 2 and len(set(names)) == 2, outs
            assert all(_ping(n) for n in names), f"trial {trial}: a cluster that said it was up is not usable"
            third = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "down"], capture_output=True,
                                   text=True)
            assert third.returncode == 0 and all(_ping(n) for n in names), third.stdout + third.stderr
            status = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "status"], capture_output=True,
                                    text=True).stdout
            assert all(n in status for n in names) and "owner: root (pid" in status, status
            gone = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "down", "--all"],
                                  capture_output=True, text=True)
            assert gone.returncode == 0 and not any(n in {cl.cluster_of(ns) for ns in cl.namespaces()} for n in names)
        finally:
            for s in shells:
                s.kill()
                s.wait()
            cl.down(only=[ns for ns in cl.namespaces() if (cl.cluster_of(ns) or "").startswith(("w20t", "cli"))
                          and not ownership.alive(ownership.read(cl.cluster_of(ns)))])
