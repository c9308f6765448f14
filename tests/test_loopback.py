"""Rendezvous listens on loopback only on one machine, on each node's own address on a cluster.

The listening sockets are read from ``/proc/<pid>/net/tcp`` and ``tcp6`` (state ``0A``, LISTEN;
man ``proc(5)``), matched to each process by the socket inodes among its ``/proc/<pid>/fd``: the
pid's own network namespace, so an emulated node's sockets are read too (``psutil.net_connections``
reads only this process's namespace). A launch runs in a thread while the main thread samples every
process whose environment names the launch's folder (agents, ranks, launchers) every 50 ms. The
control is torch's own TCPStore in this process: it listens on ``::``. Measured on the 2-core
machine (loaded): torchrun static 4.6 s, c10d 4.1 s, DeepSpeed's launcher 8.5 s, 2 emulated nodes
6 s, 2 Slurm nodes 8 s.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from teraflops.launch import loopback
from teraflops.nodes import cluster, slurm as slurm_mod
from teraflops.nodes.cluster import Cluster
from teraflops.launch.ports import free_port
from teraflops.launch.selftest import SelftestSpec, expected_sum, run
from teraflops.launch.wire import RESULTS_ENV

STEPS = SelftestSpec(steps=10)  # ~1 s of all-reduces: every store and pair is up while they run


def _address(field: str) -> tuple[str, int]:
    """``0100007F:1F90`` (``/proc/net/tcp``: the address's 32-bit words in host order, x86 little-endian) → ip, port."""
    ip, port = field.split(":")
    raw = bytes.fromhex(ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port, 16)


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses process ``pid`` listens on, in its own network namespace."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.islink(f"/proc/{pid}/fd/{fd}") else ""
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    except OSError:  # gone
        return set()
    found = set()
    for proto in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:
                found.add(_address(f[1]))
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _of_launch(pid: int, port: int, known: dict) -> str | None:
    """``pid``'s command line if it belongs to the launch whose rendezvous is on ``port`` (it or a process
    above it has ``port`` in its command line: the launcher's agent, torchrun inside an sbatch script,
    DeepSpeed's launcher), else None: other launches on the machine (another test worker's, another
    learner's), and a process gone before its command line was read. Read once per process."""
    if pid not in known:
        try:
            chain = [psutil.Process(pid), *psutil.Process(pid).parents()]
        except psutil.Error:
            return None
        mark = re.compile(rf"(?<!\d){port}(?!\d)")
        cmd = _cmdline(pid)
        known[pid] = cmd if cmd and any(mark.search(_cmdline(p.pid)) for p in chain) else None
    return known[pid]


def sampled(run, port: int) -> tuple[object, dict]:
    """``run()``'s result, and what the processes of its launch (rendezvous on ``port``) listened on
    meanwhile: ``{(ip, port): {(node, command line), ...}}`` (node: ``$TERAFLOPS_NODE``, None outside one)."""
    seen, done, known = {}, threading.Event(), {}

    def sample():
        while not done.is_set():
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                env = _environ(pid)
                if RESULTS_ENV in env and pid != os.getpid() and (cmd := _of_launch(pid, port, known)):
                    for addr in listening(pid):
                        seen.setdefault(addr, set()).add((env.get("TERAFLOPS_NODE"), cmd))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return run(), seen
    finally:
        done.set()
        sampler.join()


def wide(seen: dict, allowed) -> list[str]:
    """Listeners of ``seen`` whose address ``allowed(ip, node)`` refuses, one line each."""
    return [f"{ip}:{port} by node {node}: {cmd[:140]}" for (ip, port), who in sorted(seen.items())
            for node, cmd in sorted(who, key=str) if not allowed(ip, node)]


# ---- in this process --------------------------------------------------------------------------


def test_loopback_and_node_hosts_get_one_address_and_others_are_left_to_torch():
    assert loopback.listen_address("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    assert loopback.listen_address("::1") == (socket.AF_INET6, "::1")
    assert loopback.listen_address("localhost")[1] in ("127.0.0.1", "::1")
    assert loopback.listen_address("10.213.0.1") is None  # not a node address it was told of
    assert loopback.listen_address("10.213.0.1", ("10.213.0.1",)) == (socket.AF_INET, "10.213.0.1")
    assert loopback.listen_address("no-such-host.invalid") is None
    assert loopback.allowed({loopback.LISTEN_ENV: "10.213.0.1, 10.213.0.2"}) == ("10.213.0.1", "10.213.0.2")
    assert loopback.allowed({}) == ()


def test_torchs_store_listens_on_every_interface_the_bound_one_on_its_host_only():
    """The control (torch's own server on ``::``) and the fix, read the same way as the launches."""
    import torch.distributed as dist

    plain = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    assert ("::", plain.port) in listening(os.getpid())  # what every launch's store did before
    del plain
    bound_cls = loopback._bound(dist.TCPStore)
    store = bound_cls("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    port = store.port
    assert isinstance(store, dist.TCPStore) and {a for a in listening(os.getpid()) if a[1] == port} == \
        {("127.0.0.1", port)}
    client = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(RuntimeError):  # a taken port: torch's own error, as without the shim
        bound_cls("127.0.0.1", port, 1, True, datetime.timedelta(seconds=2), wait_for_workers=False)
    del client, store
    assert not [a for a in listening(os.getpid()) if a[1] == port]  # the store closed the socket


# ---- launches ---------------------------------------------------------------------------------


def _one_node(ip: str, node) -> bool:
    return ip == "127.0.0.1"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["static", "c10d", "deepspeed"])
def test_a_one_node_run_listens_on_loopback_only(how):
    port = free_port()
    kw = {"static": {}, "c10d": {"launcher_args": ["--rdzv-backend", "c10d"]},
          "deepspeed": {"launcher": "deepspeed"}}[how]
    spec = replace(STEPS, deepspeed=how == "deepspeed")
    out, seen = sampled(lambda: run(2, spec, port=port, timeout=120, **kw), port)
    assert [r.sum for r in out] == [expected_sum(spec, 2)] * 2 == [10 * 3.0] * 2
    print(f"{how}: {sorted(seen)}")
    assert ("127.0.0.1", port) in seen, sorted(seen)  # the rendezvous store was seen, where it belongs
    assert wide(seen, _one_node) == []


def _node_address(ip: str, node) -> bool:
    return node is not None and ip == Cluster.address(int(node))


NODES = cluster.unavailable() if sys.platform == "linux" else "needs Linux"
SLURM = NODES or slurm_mod.unavailable()


@pytest.mark.slow
@pytest.mark.parametrize("slurm", [
    pytest.param(False, id="agents", marks=pytest.mark.skipif(NODES is not None, reason=f"no emulated nodes: {NODES}")),
    pytest.param(True, id="sbatch", marks=pytest.mark.skipif(SLURM is not None, reason=f"no Slurm on them: {SLURM}"))])
def test_each_node_listens_on_its_own_address_only(slurm):
    """Two emulated nodes, the agents started by launch or by ``srun`` in a batch job. Slurm's own
    ``srun`` listens on ``0.0.0.0`` for its steps' connections and I/O (``SrunPortRange``,
    slurm.conf(5)), inside node 0's namespace, so on the emulated subnet only: not the course's."""
    port = free_port()
    with Cluster(2, name="lbs" if slurm else "lbn", slurm=slurm) as c:
        out, seen = sampled(lambda: run(1, STEPS, cluster=c, port=port, timeout=120), port)
    assert [r.node for r in out] == [0, 1] and {r.sum for r in out} == {10 * 3.0}
    print(f"{'sbatch' if slurm else 'agents'}: {sorted(seen)}")
    assert (c.address(0), port) in seen, sorted(seen)  # the rendezvous store, on node 0
    ours = {addr: {(n, cmd) for n, cmd in who if not cmd.startswith("srun ")} for addr, who in seen.items()}
    assert wide(ours, _node_address) == []


def test_a_torch_below_the_floor_is_one_line_and_the_floor_is_pyprojects():
    """Torch 2.4-2.7 serve no pre-bound master_listen_fd in the libuv TCPStore: every launch
    would hang. The floor is pyproject's, and an older torch is refused in one line."""
    import re
    from pathlib import Path

    from teraflops.errors import CourseError
    from teraflops.launch.loopback import TORCH_FLOOR, check_torch

    for old in ("2.4.1+cu121", "2.7.0"):
        with pytest.raises(CourseError, match=r"torch 2\.[47]\.\d.* older .*torch 2\.8.*Hint: pip install torch"):
            check_torch(old)
    for ok in ("2.8.0", "2.13.0+cpu", "3.0.0a0"):
        check_torch(ok)
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', pyproject).groups()
    assert tuple(map(int, floor)) == TORCH_FLOOR
