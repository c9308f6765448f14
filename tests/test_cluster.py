"""Emulated nodes (teraflops.nodes.cluster) and multi-node launches on them.

The real tests need Linux, root and iproute2 (CI has them) and skip with the reason elsewhere.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from teraflops.nodes import cluster as cl
from teraflops.nodes.cluster import Cluster, ClusterError, Link

REASON = cl.unavailable() if sys.platform == "linux" else "needs Linux"
NEEDS_NODES = pytest.mark.skipif(REASON is not None, reason=f"emulated nodes unavailable: {REASON}")


# ---- pure -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({"rate": 0}, "bytes/s"), ({"rate": 5e3}, "bytes/s"), ({"rate": "fast"}, "finite number"),
    ({"rate": float("inf")}, "finite number"), ({"latency": 50}, "seconds"), ({"latency": True}, "finite"),
    ({"loss": 1.0}, "fraction"), ({"loss": -0.1}, "fraction"),
])
def test_a_bad_link_is_one_line_with_a_hint(kwargs, words):
    with pytest.raises(ClusterError, match=words) as info:
        Link(**kwargs)
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)


def test_tc_commands_shape_rate_with_tbf_and_delay_with_netem(monkeypatch):
    assert Link().tc_commands("eth0") == []  # unshaped: no qdisc
    (tbf,) = Link(rate=25e6).tc_commands("eth0")
    assert tbf[:6] == ["qdisc", "add", "dev", "eth0", "root", "handle"] and "tbf" in tbf and "200000000bit" in tbf
    monkeypatch.setattr(cl, "_PROBE", (None, frozenset({"tbf", "netem"})))
    netem, child = Link(rate=25e6, latency=1e-3, loss=0.01).tc_commands("port0")
    assert "netem" in netem and "1000us" in netem and "1%" in netem
    assert child[4:8] == ["parent", "1:1", "handle", "10:"] and "tbf" in child
    monkeypatch.setattr(cl, "_PROBE", (None, frozenset({"tbf"})))
    with pytest.raises(ClusterError, match="netem"):
        Link(latency=1e-3).tc_commands("eth0")


def test_describe_and_units():
    assert Link(rate=25e6, latency=2e-3).describe() == "25 MB/s (200 Mbit/s), 2 ms, 0% loss"
    assert Link().describe().startswith("unshaped")


@pytest.mark.parametrize("nodes", [0, 201, 1.5, True, "2"])
def test_bad_node_counts(nodes):
    with pytest.raises(ClusterError, match="Hint"):
        Cluster(nodes)


def test_links_per_node_and_names():
    c = Cluster(3, [Link(rate=1e6), Link(), Link(rate=2e6)], name="t1")
    assert [x.rate for x in c.links] == [1e6, None, 2e6]
    assert c.node_name(2) == "teraflops-t1-node2" and c.switch == "teraflops-t1-switch" and c.address(0) == "10.213.0.1"
    with pytest.raises(ClusterError, match="2 Links|3 Links"):
        Cluster(3, [Link(), Link()])
    with pytest.raises(ClusterError, match="name"):
        Cluster(2, name="no spaces")
    with pytest.raises(ClusterError, match="node must be"):
        c.set_link(3, rate=1e6)


def test_default_names_differ_and_a_cluster_that_is_down_runs_nothing():
    a, b = Cluster(1), Cluster(1)
    assert a.name != b.name
    with pytest.raises(ClusterError, match="not up"):
        a.run(0, ["true"])


def test_down_reports_only_what_it_removed(monkeypatch):
    monkeypatch.setattr(cl, "namespaces", lambda: ["teraflops-x-node0"])  # as if `ip netns del` failed
    monkeypatch.setattr(cl, "pids", lambda ns: [])
    monkeypatch.setattr(cl, "_ip", lambda *a, **k: None)
    assert cl.down() == []


class Node:
    """Processes of fake namespaces on an injected clock: a process exits 0.1 s after SIGTERM (unless it
    ignores SIGTERM) and 0.01 s after SIGKILL; every signal is recorded with the clock's time."""

    def __init__(self, by_ns: dict[str, list[int]], deaf: set[int]):
        self.by_ns, self.deaf, self.now, self.dies, self.sent = by_ns, deaf, 0.0, {}, []

    def pids(self, ns):
        return [p for p in self.by_ns[ns] if self.alive(p)]

    def alive(self, pid):
        return not (pid in self.dies and self.dies[pid] <= self.now)

    def kill(self, pid, sig):
        if not self.alive(pid):
            raise ProcessLookupError(pid)
        if sig:
            self.sent.append((self.now, pid, sig))
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and pid not in self.deaf):
            self.dies[pid] = min(self.dies.get(pid, float("inf")), self.now + (0.01 if sig == signal.SIGKILL else 0.1))

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


def _fake_node(monkeypatch, deaf=frozenset()):
    node = Node({"teraflops-x-node0": [11, 12], "teraflops-x-node1": [21]}, set(deaf))
    monkeypatch.setattr(cl, "pids", node.pids)
    monkeypatch.setattr(cl, "_alive", node.alive)
    monkeypatch.setattr(cl, "os", SimpleNamespace(kill=node.kill))
    monkeypatch.setattr(cl, "time", node)
    monkeypatch.setattr(cl.slurm_mod, "kill_at_once", lambda pids: {p for p in pids if p == 21})  # as slurmctld
    return node


def test_teardown_signals_every_node_at_once_and_returns_when_they_are_gone(monkeypatch):
    """What keeps `cluster down` to seconds (its time is a figure of scripts/benchmark.py --clusters): one
    round of signals to every process of every node before any wait, SIGKILL at once to what
    :func:`teraflops.nodes.slurm.kill_at_once` names, and no wait once everything is gone."""
    node = _fake_node(monkeypatch)
    cl._stop_processes(["teraflops-x-node0", "teraflops-x-node1"], grace=3.0)
    assert sorted(node.sent) == [(0.0, 11, signal.SIGTERM), (0.0, 12, signal.SIGTERM), (0.0, 21, signal.SIGKILL)]
    assert not any(map(node.alive, (11, 12, 21))) and node.now < 0.2  # gone after 0.1 s: not the 3 s grace


def test_teardown_kills_what_ignores_sigterm_after_one_grace_period(monkeypatch):
    node = _fake_node(monkeypatch, deaf={12})
    cl._stop_processes(["teraflops-x-node0", "teraflops-x-node1"], grace=3.0)
    assert sorted((p, s) for t, p, s in node.sent if t == 0) == [(11, signal.SIGTERM), (12, signal.SIGTERM), (21, signal.SIGKILL)]
    late = [(t, p, s) for t, p, s in node.sent if t > 0]
    assert [(p, s) for _, p, s in late] == [(12, signal.SIGKILL)] and late[0][0] == pytest.approx(3.0, abs=0.06)
    assert not node.alive(12) and node.now < 3.2  # one grace period, then gone: not a second one


def test_the_cli_rate_is_in_mb_per_s(capsys):
    from teraflops.course.cli import main

    assert main(["cluster", "up", "--rate", "25e6"]) == 2
    assert "MB/s" in capsys.readouterr().err


def test_unavailable_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(cl.os, "geteuid", lambda: 1000)
    assert "root" in cl.unavailable()
    monkeypatch.setattr(cl.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cl.shutil, "which", lambda tool: None)
    assert "iproute2" in cl.unavailable()
    monkeypatch.setattr(cl.sys, "platform", "darwin")
    assert "Linux" in cl.unavailable()


def test_a_multi_node_launch_needs_torchrun_and_a_cluster_that_is_up():
    from teraflops.launch.launcher import launch
    from teraflops.errors import CourseError

    with pytest.raises(CourseError, match="cluster that is up"):
        launch("teraflops.workers.selftest", 1, cluster=Cluster(2))
    with pytest.raises(CourseError, match="torchrun"):
        launch("teraflops.workers.selftest", 1, launcher="deepspeed", cluster=Cluster(2))


# ---- real ----------------------------------------------------------------------------------------


def _node_processes():
    """Processes started for an emulated node (their environment names it)."""
    found = []
    for p in psutil.process_iter():
        try:
            if "TERAFLOPS_NODE" in p.environ():
                found.append(p)
        except psutil.Error:
            pass
    return found


@NEEDS_NODES
@pytest.mark.slow
def test_nodes_see_only_their_subnet_and_go_away():
    with Cluster(2, Link(rate=25e6), name="t2") as c:
        assert set(c.namespaces()) == {"teraflops-t2-switch", "teraflops-t2-node0", "teraflops-t2-node1"}
        routes = c.run(0, ["ip", "-4", "route"]).stdout.split("\n")
        assert [r.split()[0] for r in routes if r.strip()] == ["10.213.0.0/24"]  # no default route: nothing leaves
        assert "tbf" in c.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        c.set_link(1, rate=5e6)
        assert "40Mbit" in c.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        for bad in (lambda: c.set_link(1, "fast"), lambda: c.set_link(1, 5e6), lambda: c.set_link(1, bogus=1),
                    lambda: c.set_link(1, Link(), rate=1e6), lambda: c.set_link(1, latency=1e-3 if "netem" not in cl.qdiscs() else 99)):
            with pytest.raises(ClusterError, match="Hint"):
                bad()
            assert "40Mbit" in c.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout  # still shaped as it was
            assert c.links[1].rate == 5e6
        sleeper = subprocess.Popen(c.prefix(0) + ["sleep", "60"])
        try:
            with pytest.raises(ClusterError, match="is up with processes"):
                Cluster(2, name="t2").up()  # would have taken over a cluster at work
        finally:
            sleeper.kill()
            sleeper.wait()
    assert not [ns for ns in cl.namespaces() if ns.startswith("teraflops-t2-")]


@NEEDS_NODES
@pytest.mark.slow
def test_the_alpha_beta_fit_recovers_each_link_rate():
    from teraflops.hardware import alpha_beta, collectives

    sizes = [2 ** k for k in range(12, 22)]  # 4 KiB - 2 MiB
    with Cluster(2, name="t3") as c:
        for rate in (50e6, 25e6, 10e6):
            for i in range(2):
                c.set_link(i, rate=rate)
            rows = collectives.sweep(("all_reduce",), sizes=sizes, cluster=c, iters=4, min_iters=2, warmup=1,
                                     volume_bytes=2 ** 22)
            fit = alpha_beta.fit_rows(rows)
            busbw = fit.bandwidth * collectives.BUS_FACTOR["all_reduce"](2)  # = algbw at n = 2
            print(f"link {rate / 1e6:g} MB/s: fitted busbw {busbw / 1e6:.1f} MB/s, alpha {fit.alpha * 1e3:.2f} ms, "
                  f"R² {fit.r2:.3f}")
            # the mechanism: tc caps the link. An unshaped veth pair moves ~935 MB/s here, so a fit above the
            # rate means tc did not shape. How close the fit comes to the cap is a measurement (0.81 of it with
            # other work on the 2 cores, 0.94-1.0 quiet): Unit 5's fabric story reports it, this test does not
            assert 0 < busbw <= 1.15 * rate
            assert {r["ranks"] for r in rows} == {2}


@NEEDS_NODES
@pytest.mark.slow
def test_two_nodes_train_as_one_node_does(zero_tiny_runs, remedies_tiny_run):
    """The one-node runs are the ones test_zero and test_remedies check (conftest's session fixtures)."""
    from teraflops.hardware import remedies
    from teraflops.parallelization import zero
    from teraflops.sizing import PRESETS
    from teraflops.launch.placement import data_parallel_plan

    zero_plan, tiny = data_parallel_plan(PRESETS["tiny"]), PRESETS["tiny"]
    one_zero = zero_tiny_runs[0][2]  # stages (0, 1, 2, 3): ZeRO-2
    one_ddp = next(r for r in remedies_tiny_run.rows if r["setting"] == "baseline")
    with Cluster(2, Link(rate=50e6), name="t4") as c:
        two_zero = zero.run_zero(stages=(2,), plan=zero_plan, steps=3, cluster=c)[0]
        two = remedies.run(settings=("baseline",), plan=data_parallel_plan(tiny, ranks_cpu=tiny.remedy.ranks_cpu),
                           cluster=c)
    two_ddp = two.rows[0]
    assert two_zero.world_size == one_zero.world_size == 2 and two.ranks == remedies_tiny_run.ranks == 4
    for a, b in zip(one_zero.losses, two_zero.losses):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert len(two_ddp["losses"]) == len(one_ddp["losses"])
    assert max(abs(x - y) for x, y in zip(one_ddp["losses"], two_ddp["losses"])) < 1e-4


@NEEDS_NODES
@pytest.mark.slow
def test_cluster_down_after_a_killed_run_leaves_nothing_and_the_next_run_starts(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "from teraflops.nodes.cluster import Cluster, Link\n"
        "from teraflops.launch.launcher import launch\n"
        "c = Cluster(2, Link(rate=25e6), name='t5').up()\n"
        "from teraflops.launch.selftest import SelftestSpec, run\n"
        "run(1, SelftestSpec(timeout_s=600), cluster=c, timeout=600, env={'TERAFLOPS_FAULT': 'hang:rank=1:step=1'})\n")
    victim = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while len([p for p in _node_processes() if "selftest" in " ".join(p.cmdline())]) < 2:  # both ranks started
        assert time.monotonic() < deadline and victim.poll() is None, "the 2-node run did not start"
        time.sleep(0.5)
    time.sleep(3)  # rank 0 is now waiting in the all-reduce that rank 1 never joins
    logs = {p.environ().get("TERAFLOPS_RESULTS_DIR") for p in _node_processes()} - {None}
    os.kill(victim.pid, signal.SIGKILL)  # as a crashed notebook: its clean-up never runs
    victim.wait()
    assert cl.namespaces() and _node_processes()  # left behind
    done = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "down"], capture_output=True, text=True)
    assert done.returncode == 0 and "teraflops-t5-node1" in done.stdout
    assert cl.namespaces() == []
    assert psutil.wait_procs(_node_processes(), timeout=5)[1] == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "port0" not in links and "br0" not in links  # nothing of the cluster in the machine's own namespace
    for leftover in logs:  # the killed run's logs folder (its clean-up never ran)
        shutil.rmtree(leftover, ignore_errors=True)
    from teraflops.launch.selftest import run

    with Cluster(2, name="t5") as c:
        out = run(1, cluster=c, timeout=120)
    assert [r.node for r in out] == [0, 1] and {r.sum for r in out} == {12.0}


def test_scaled_fabrics_keep_their_ratios_and_tables_read():
    from teraflops.hardware import alpha_beta, fabrics

    ib, pcie, eth = (fabrics.scaled_rate(f) for f in fabrics.FABRICS)
    assert ib == 50e6 and abs(pcie - 31.5e6) < 0.1e6 and eth == 3.125e6  # published GB/s become MB/s
    fit = alpha_beta.AlphaBeta(alpha=2e-3, bandwidth=48e6, r2=0.99, max_rel_error=0.1)
    text = fabrics.fabric_table([{"fabric": "x", "published": 50e9, "configured": 50e6, "fit": fit,
                                  "busbw_fit": 48e6, "ratio": 0.96, "rows": []}])
    assert "fitted busbw (MB/s)" in text and "0.96" in text
    text = fabrics.hierarchy_table([{"level": "intra", "ranks": 2, "nodes": 1, "peak_busbw": 500e6}], 50e6)
    assert "× link rate" in text and "10" in text
    for nodes in (1, 3):
        with pytest.raises(ValueError, match="2 nodes"):
            fabrics.hierarchy(Cluster(nodes))
