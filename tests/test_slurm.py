"""Slurm on the emulated nodes (teraflops.nodes.slurm) and its commands (`teraflops cluster up --slurm`,
`exec`, `status`, `down`).

The real tests need Linux, root, iproute2 and Slurm's packages (CI installs them with
``teraflops.nodes.slurm.INSTALL``) and skip with the reason elsewhere.
"""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from teraflops.nodes import cluster as cl
from teraflops import ownership
from teraflops.nodes import slurm
from teraflops.course.cli import build_parser, main
from teraflops.nodes.slurm import SlurmConfig, SlurmError

REASON = (cl.unavailable() if sys.platform == "linux" else "needs Linux") or slurm.unavailable(accounting=True)
NEEDS_SLURM = pytest.mark.skipif(REASON is not None, reason=f"Slurm on emulated nodes unavailable: {REASON}")


def _fake_cluster(nodes=3, name="demo"):
    return SimpleNamespace(name=name, nodes=nodes, address=cl.Cluster.address, node_name=lambda i: f"ns{i}")


# ---- pure -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({"scheduler": "sjf"}, "scheduler must be one of"), ({"gpus_per_node": 0}, "gpus_per_node"),
    ({"gpus_per_node": 9}, "gpus_per_node"), ({"gpus_per_node": True}, "gpus_per_node"),
    ({"interval": 0}, "interval"), ({"priority_period": 0}, "priority_period"),
    ({"cpus_per_node": 0}, "cpus_per_node"), ({"cpus_per_node": 2.0}, "cpus_per_node"),
    ({"accounts": ()}, "accounts"), ({"accounts": ("Team A",)}, "accounts"),
])
def test_a_bad_slurm_config_is_one_line(kwargs, words):
    with pytest.raises(SlurmError, match=words) as e:
        SlurmConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_fifo_and_backfill_are_slurms_own_schedulers():
    fifo = slurm.slurm_conf(_fake_cluster(), SlurmConfig(scheduler="fifo"), slurm.state_dir("demo")).splitlines()
    backfill = slurm.slurm_conf(_fake_cluster(), SlurmConfig(), slurm.state_dir("demo")).splitlines()
    assert "SchedulerType=sched/builtin" in fifo and "SchedulerType=sched/backfill" in backfill
    assert [x for x in fifo if not x.startswith("SchedulerType=")] == \
           [x for x in backfill if not x.startswith("SchedulerType=")]  # nothing else differs
    assert "SlurmctldHost=node0(10.213.0.1)" in backfill and "ProctrackType=proctrack/linuxproc" in backfill


def test_nodes_declare_their_cpus_and_fake_gpus():
    text = slurm.slurm_conf(_fake_cluster(3), SlurmConfig(gpus_per_node=4), slurm.state_dir("demo"))
    nodes = [x for x in text.splitlines() if x.startswith("NodeName=")]
    assert nodes == [f"NodeName=node{i} NodeAddr=10.213.0.{i + 1} CPUs=4 Gres=gpu:4 RealMemory=1000 State=UNKNOWN"
                     for i in range(3)]
    assert "CPUs=6 Gres=gpu:2" in slurm.slurm_conf(_fake_cluster(1), SlurmConfig(cpus_per_node=6), slurm.state_dir("d"))


def test_accounting_adds_slurmdbd_and_fair_share():
    d = slurm.state_dir("demo")
    plain = slurm.slurm_conf(_fake_cluster(), SlurmConfig(), d).splitlines()
    acct = slurm.slurm_conf(_fake_cluster(), SlurmConfig(accounting=True, priority_period=2), d).splitlines()
    assert "AccountingStorageType=accounting_storage/none" in plain and "PriorityType=priority/basic" in plain
    assert "AccountingStorageType=accounting_storage/slurmdbd" in acct and "PriorityType=priority/multifactor" in acct
    assert "PriorityCalcPeriod=2" in acct and "AccountingStorageEnforce=associations,limits" in acct
    assert not any(x.startswith("Priority") and x != "PriorityType=priority/basic" for x in plain)


def test_the_config_is_saved_for_another_process(tmp_path, monkeypatch):
    monkeypatch.setenv(slurm.STATE_ENV, str(tmp_path))
    config = SlurmConfig(scheduler="fifo", accounting=True, gpus_per_node=3, accounts=("ml", "nlp"))
    s = slurm.Slurm(_fake_cluster(4, "saved"), config)
    s.dir.mkdir()
    s._save()
    assert slurm.saved("saved") == (4, config) and slurm.state_names() == ["saved"]
    assert slurm.saved("other") is None
    with pytest.raises(SlurmError, match="no Slurm cluster named 'other'.*cluster up --slurm"):
        cl.attach("other")
    assert config.describe() == ("fifo (sched/builtin), 3 CPUs and 3 fake GPUs per node, "
                                 "accounting (slurmdbd) for ml, nlp")


def test_login_keeps_the_directory_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv(slurm.STATE_ENV, str(tmp_path))
    s = slurm.Slurm(_fake_cluster(2, "wd"), SlurmConfig())
    assert s.login(1) == ["nsenter", "--net=/run/netns/ns1", "env", f"SLURM_CONF={tmp_path}/wd/slurm.conf"]
    assert s.login(0, "/home/x")[1:3] == ["--net=/run/netns/ns0", "--wd=/home/x"]


def test_missing_packages_name_the_install_command(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda tool: None if "slurm" in tool or "maria" in tool else tool)
    plain, accounting = slurm.unavailable(), slurm.unavailable(accounting=True)
    assert plain.endswith(f"(not found; as root: {slurm.INSTALL})") and accounting.endswith(slurm.INSTALL + ")")
    assert plain.split(" (")[0].endswith("needs slurmctld, slurmd")
    assert accounting.split(" (")[0].endswith("needs slurmctld, slurmd, slurmdbd, mariadbd, mariadb-install-db")


def test_ci_installs_the_packages_of_install(capsys):
    from pathlib import Path

    text = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    code = text.split("slurm_packages=$(python3 -c '", 1)[1].split("')", 1)[0]
    cwd = os.getcwd()
    os.chdir(Path(__file__).parents[1])  # .ci/run runs from the repository root
    try:
        exec(code, {})
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out.split() == slurm.INSTALL.split("--no-install-recommends")[1].split()
    assert 'install -y -q --no-install-recommends chromium $slurm_packages' in text


def _cli_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


def test_cli_slurm_options_go_with_slurm(capsys):
    assert "--slurm" in _cli_error(capsys, ["cluster", "up", "--scheduler", "fifo"])
    assert "--accounting and --gpus-per-node" in _cli_error(capsys, ["cluster", "up", "--accounting",
                                                                     "--gpus-per-node", "2"])
    assert "1 to 8" in _cli_error(capsys, ["cluster", "up", "--slurm", "--gpus-per-node", "9"])


def test_cli_exec_needs_a_command_and_a_node_index(capsys):
    assert "after --" in _cli_error(capsys, ["cluster", "exec", "--"])
    assert "after --" in _cli_error(capsys, ["cluster", "exec"])
    assert "from 0" in _cli_error(capsys, ["cluster", "exec", "--node", "-1", "--", "sinfo"])


def test_cli_up_slurm_without_root_or_packages_says_why(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(ownership.CLUSTER_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(cl.sys, "platform", "linux")
    monkeypatch.setattr(cl.os, "geteuid", lambda: 1000)
    assert "need root" in _cli_error(capsys, ["cluster", "up", "--slurm"])
    monkeypatch.setattr(cl, "unavailable", lambda: None)  # as root with iproute2, without Slurm's packages
    monkeypatch.setattr(slurm.shutil, "which", lambda tool: None)
    assert slurm.INSTALL in _cli_error(capsys, ["cluster", "up", "--nodes", "3", "--slurm", "--accounting"])


def test_cli_help_names_the_slurm_options(capsys):
    for argv, words in ((["cluster", "up", "--help"], ["--slurm", "--scheduler {backfill,fifo}", "--accounting",
                                                       "--gpus-per-node N", "slurmctld on node 0", "cluster down"]),
                        (["cluster", "exec", "--help"], ["--name N", "--node I", "-- CMD", "SLURM_CONF",
                                                         "exit code"]),
                        (["cluster", "--help"], ["up", "down", "status", "exec"])):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert all(w in text for w in words), (argv, text)


# ---- real ----------------------------------------------------------------------------------------


def _cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "teraflops", "cluster", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


def _course_processes(name: str) -> list[psutil.Process]:
    """Live processes of cluster ``name``'s Slurm: daemons, job steps and job processes (their command
    line or environment names its files, e.g. SLURM_CONF)."""
    mark, found = str(slurm.state_dir(name)), []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and (mark in " ".join(p.cmdline()) or
                                                       any(mark in v for v in p.environ().values())):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _assert_nothing_left(name: str) -> None:
    assert psutil.wait_procs(_course_processes(name), timeout=5)[1] == []
    assert not [ns for ns in cl.namespaces() if cl.cluster_of(ns) == name]
    assert not slurm.state_dir(name).exists() and ownership.read(name) is None
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "port0" not in links and "br0" not in links  # nothing in the machine's own namespace


def _name(p: psutil.Process) -> str | None:
    try:
        return p.name()
    except psutil.Error:  # gone meanwhile
        return None


def _wait(ready, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return found


@NEEDS_SLURM
@pytest.mark.slow
def test_cli_up_slurm_exec_status_down(tmp_path):
    up = _cli("up", "--nodes", "3", "--slurm")  # its time: scripts/benchmark.py --clusters
    # the CLI's default: cli<the leader of its caller's login session> (this test's session), found by `exec`
    name = up.stdout.split("cluster '", 1)[1].split("'", 1)[0] if "cluster '" in up.stdout else "?"
    try:
        assert up.returncode == 0, up.stderr
        assert name == f"cli{ownership.read(name)['pid']}" and ownership.alive(ownership.read(name))
        assert "slurmctld (node0)" in up.stdout and "slurmd (node2)" in up.stdout
        sinfo = _cli("exec", "--", "sinfo", "-h", "-N", "-o", "%N %T")  # the daemons outlived `up`
        assert sinfo.returncode == 0 and sinfo.stdout.split() == ["node0", "idle", "node1", "idle", "node2", "idle"]
        shell = _cli("exec", "--node", "2", "--", "sh", "-c", "hostname; pwd; cat; exit 3", input="typed\n",
                     cwd=tmp_path)
        assert shell.returncode == 3 and shell.stdout.split() == ["node2", str(tmp_path), "typed"]
        batch = _cli("exec", "--name", name, "--", "sbatch", "-N3", "--wrap", "srun hostname", cwd=tmp_path)
        assert batch.returncode == 0 and batch.stdout.startswith("Submitted batch job"), batch.stderr
        out = tmp_path / f"slurm-{batch.stdout.split()[-1]}.out"  # written in the directory sbatch ran in
        hosts = _wait(lambda: out.exists() and len(found := sorted(out.read_text().split())) >= 3 and found, 60,
                      "the job did not finish")
        assert hosts == ["node0", "node1", "node2"]
        status = _cli("status").stdout
        mine = status[status.index(name):].split("\n")[:7]
        assert "backfill (sched/backfill)" in mine[1]
        assert [x.split()[0] + " " + x.split()[-1] for x in mine[2:]] == \
               ["munged node0", "slurmctld node0", "slurmd node0", "slurmd node1", "slurmd node2"]
        assert "no command" in _cli("exec", "--").stderr
    finally:
        down = _cli("down")
    assert down.returncode == 0 and f"teraflops-{name}-node2" in down.stdout, down.stderr
    _assert_nothing_left(name)


VICTIM = """
import sys, time
from teraflops.nodes.cluster import Cluster
from teraflops.nodes.slurm import SlurmConfig
s = Cluster(2, name=sys.argv[1], slurm=SlurmConfig(accounting=True)).up().slurm_
s.exec(["sbatch", "-o", "/dev/null", "--wrap", "sleep 3001"], check=True)
s.exec(["sbatch", "-o", "/dev/null", "--wrap", "(setsid sleep 3002 &)"], check=True)  # outlives its job
print("submitted", flush=True)
time.sleep(600)
"""


def _sleeps(name: str) -> set[str]:
    return {p.cmdline()[-1] for p in _course_processes(name) if p.name() == "sleep"}


@NEEDS_SLURM
@pytest.mark.slow
def test_down_after_the_owner_was_killed_mid_job_leaves_nothing(tmp_path):
    name = f"k{os.getpid()}"
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert victim.stdout.readline().strip() == "submitted", victim.stderr.read()
        _wait(lambda: _sleeps(name) == {"3001", "3002"}, 60, "the jobs did not start")
        sacct = _wait(lambda: (done := _cli("exec", "--name", name, "--", "sacct", "-n", "-X", "-o", "JobID,State"))
                      and done.stdout.split() == ["1", "RUNNING", "2", "COMPLETED"] and done, 60,
                      "sacct did not show the running and the finished job")
        assert sacct.returncode == 0
        names = {p.name() for p in _course_processes(name)}
        assert set(slurm.DAEMONS) <= names  # munged, mariadbd, slurmdbd, slurmctld, slurmd
    finally:
        os.kill(victim.pid, signal.SIGKILL)  # as a crashed notebook: its clean-up never runs
        victim.communicate()
    assert _sleeps(name) == {"3001", "3002"}  # left behind, the double-forked one outside any job
    # what keeps `down` short: slurmctld (saves its state on SIGTERM) and the job-step managers (ignore
    # SIGTERM) get SIGKILL at once instead of a grace period (tests/test_cluster.py tests the rounds on a fake
    # clock); its time is a figure of scripts/benchmark.py --clusters
    procs = {p.pid: p for p in _course_processes(name)}
    at_once = {_name(procs[pid]) for pid in slurm.kill_at_once(procs)} - {None}
    assert "slurmctld" in at_once and at_once <= {"slurmctld", "slurmstepd"}, at_once
    down = _cli("down")
    assert down.returncode == 0 and f"teraflops-{name}-node1" in down.stdout, down.stderr
    assert "Slurm daemons" in down.stdout
    _assert_nothing_left(name)
