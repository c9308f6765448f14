"""Ray on the emulated nodes (teraflops.nodes.ray): `Cluster(K, ray=True)` / `teraflops cluster up --ray`.

The real test needs Linux, root, iproute2 and Ray (the test extra installs ``ray[train]``) and skips
with the reason elsewhere. It costs one Ray cluster start (~10 s quiet, ~40 s on 2 busy cores).
"""

import glob
import os
import signal
import subprocess
import sys

import psutil
import pytest

from teraflops import ownership
from teraflops.course.cli import build_parser
from teraflops.nodes import cluster as cl
from teraflops.nodes import ray as ray_mod
from teraflops.nodes.ray import RayConfig, RayError

REASON = (cl.unavailable() if sys.platform == "linux" else "needs Linux") or ray_mod.unavailable()
NEEDS_RAY = pytest.mark.skipif(REASON is not None, reason=f"Ray on emulated nodes unavailable: {REASON}")


# ---- pure -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({"cpus_per_node": 0}, "cpus_per_node"), ({"gpus_per_node": 9}, "gpus_per_node"),
    ({"gpus_per_node": True}, "gpus_per_node"), ({"object_store_mb": 10}, "object_store_mb"),
    ({"health_check_period_ms": 1.5}, "health_check_period_ms"), ({"health_check_failure_threshold": 0}, "threshold"),
])
def test_a_bad_ray_config_is_one_line(kwargs, words):
    with pytest.raises(RayError, match=words) as e:
        RayConfig(**kwargs)
    assert "\n" not in str(e.value) and "Hint" in str(e.value)


def test_a_bad_ray_argument_says_what_to_pass():
    with pytest.raises(cl.ClusterError, match="ray must be True, False or a RayConfig"):
        cl.Cluster(2, ray="yes")


def test_the_head_gets_the_shortened_failure_detection_and_no_dashboard():
    made = cl.Cluster(3, name="demo", ray=RayConfig(health_check_period_ms=500, health_check_failure_threshold=4))
    r = ray_mod.Ray(made, made.ray)
    head, worker = r.command(0), r.command(2)
    n = len(ray_mod.ray_command())  # this Python -m ray.scripts.scripts: Ray's processes inherit its path
    assert head[:n] == ray_mod.ray_command() and head[n:n + 2] == ["start", "--head"]
    assert "--include-dashboard" in head and "false" in head
    assert '"health_check_period_ms": 500' in " ".join(head) and made.ray.detection_s() == 2.0
    assert worker[worker.index("--address") + 1] == "10.213.0.1:6379"
    assert worker[worker.index("--node-ip-address") + 1] == "10.213.0.3"
    assert worker[worker.index("--temp-dir") + 1] == str(ray_mod.state_dir("demo") / "node2")  # not /tmp/ray


def test_missing_ray_names_the_install_command(monkeypatch):
    monkeypatch.setattr(ray_mod, "ray_command", lambda: None)
    assert "pip install" in ray_mod.unavailable() and "ray[train]" in ray_mod.unavailable()


def test_cli_help_names_the_ray_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster", "up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ray" in text and "never `ray stop`" not in text  # up's help; down's says it
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster", "down", "--help"])
    assert "never `ray stop`" in " ".join(capsys.readouterr().out.split())


# ---- real ----------------------------------------------------------------------------------------

VICTIM = """
import sys, time
from teraflops.nodes.cluster import Cluster
Cluster(3, name=sys.argv[1], ray=True).up()
print("up", flush=True)
time.sleep(600)
"""


def _netns_inode(ns: str) -> int:
    return os.stat(f"/run/netns/{ns}").st_ino


def _in_namespaces(inodes: set[int]) -> list[psutil.Process]:
    """Live processes whose network namespace is one of ``inodes``, wherever their namespace's name went."""
    found = []
    for p in psutil.process_iter():
        try:
            ino = int(os.readlink(f"/proc/{p.pid}/ns/net").split("[")[1].rstrip("]"))
            if ino in inodes and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, ValueError, IndexError, psutil.Error):
            pass
    return found


def _listening(prefix: list[str]) -> list[str]:
    """Local addresses of listening TCP sockets (``ss -ltnH``) where ``prefix`` runs it."""
    out = subprocess.run(prefix + ["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def _ray_on_host() -> list[str]:
    """Listening sockets of the machine's own namespace held by a Ray program (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if any(w in line for w in ("raylet", "gcs_server", "ray::"))]


def _plain_host(host: str) -> str:
    """`ss`'s local host without IPv6 brackets, an IPv4-mapped address ([::ffff:10.213.0.1]) as its IPv4."""
    host = host.strip("[]")
    return host.removeprefix("::ffff:") if host.startswith("::ffff:") and "." in host else host


@NEEDS_RAY
@pytest.mark.slow
def test_ray_listens_on_node_addresses_only_and_down_after_sigkill_leaves_nothing(tmp_path):
    name = f"r{os.getpid()}"
    tmp_ray_before = set(glob.glob("/tmp/ray*"))
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        seen = []  # on a busy machine Cluster.up() says a node came up slowly before the script's "up"
        while (line := victim.stdout.readline()) and line.strip() != "up":
            seen.append(line.strip())
        assert line.strip() == "up", "\n".join(seen) + victim.stderr.read()[-2000:]
        nodes = [f"{cl.PREFIX}{name}-node{i}" for i in range(3)]
        inodes = {_netns_inode(ns) for ns in nodes}
        made = cl.attach_ray(name)
        status = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "exec", "--name", name, "--",
                                 "ray", "status"], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0 and status.stdout.count(" node_") == 3, status.stdout + status.stderr
        assert "6.0 GPU" in status.stdout  # 2 fake GPUs per node
        procs = made.ray_.processes()
        assert {"raylet", "gcs_server"} <= {p["name"] for p in procs} and {p["node"] for p in procs} == {0, 1, 2}
        for i, ns in enumerate(nodes):
            # a node's only addresses are its own and its loopback: a wildcard bind there reaches nothing else
            addrs = subprocess.run(["ip", "netns", "exec", ns, "ip", "-o", "-4", "addr"], capture_output=True,
                                   text=True, check=True).stdout
            assert sorted(x.split()[3] for x in addrs.splitlines()) == sorted(["127.0.0.1/8", f"{cl.Cluster.address(i)}/24"])
            for local in _listening(["ip", "netns", "exec", ns]):
                host = _plain_host(local.rsplit(":", 1)[0])
                assert host in (cl.Cluster.address(i), "127.0.0.1", "::1", "0.0.0.0", "*", "::"), \
                        (ns, local)  # also as IPv6: the Ray client server shows as [::ffff:10.213.0.1]:10001
        assert _ray_on_host() == []  # nothing of Ray on the machine's own interfaces
        assert set(glob.glob("/tmp/ray*")) == tmp_ray_before  # temp dirs are the cluster's, not /tmp/ray
        assert (ray_mod.state_dir(name) / "node1").is_dir()
    finally:
        os.kill(victim.pid, signal.SIGKILL)  # as a crashed notebook: its clean-up never runs
        victim.communicate()
    assert len(_in_namespaces(inodes)) >= 6  # the Ray processes outlived their owner
    # how long `down` takes is a figure of scripts/benchmark.py --clusters; what makes it short (one round of
    # signals to every process, returning once they are gone) is tests/test_cluster.py's fake-clock test
    down = subprocess.run([sys.executable, "-m", "teraflops", "cluster", "down"], capture_output=True, text=True,
                          timeout=120)
    assert down.returncode == 0 and f"{cl.PREFIX}{name}-node2" in down.stdout, down.stderr
    assert psutil.wait_procs(_in_namespaces(inodes), timeout=5)[1] == []
    assert not [ns for ns in cl.namespaces() if cl.cluster_of(ns) == name]
    assert not ray_mod.state_dir(name).exists() and ownership.read(name) is None
    assert set(glob.glob("/tmp/ray*")) == tmp_ray_before
    assert _ray_on_host() == []
