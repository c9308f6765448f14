"""The course's multi-node runs as Slurm batch jobs (teraflops.launch.sbatch, launch on a Slurm cluster).

The script's text is checked without Slurm. The real tests need root, Linux, iproute2 and Slurm
(CI installs it; they skip with the reason elsewhere) and share one 2-node Slurm cluster; their
torchrun references are the session's one-node runs (conftest), the ones test_cluster shows the
2-node agent path matches. Measured on the 2-core CPU machine (shared, loaded): DDP 16-18 s,
ZeRO-2 11-22 s, killed rank 7-12 s, a job that waits 3.5-5 s, one that cannot start 2 s, the
cluster ~1.5 s (the one-node references are the session's, shared with test_zero and test_remedies).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys

import psutil
import pytest

from teraflops.launch import sbatch, selftest
from teraflops.nodes import slurm as slurm_mod
from teraflops.launch.faults import FAULT_ENV
from teraflops.launch.launcher import LaunchFailed, launch
from teraflops.launch.wire import RESULTS_ENV
from teraflops.errors import CourseError
from teraflops.machine import GPU, Machine
from teraflops.launch.placement import place
from teraflops.launch.sbatch import BatchJob, BatchJobError, Follower, JobState, parse_job

SELFTEST = "teraflops.workers.selftest"


class FakeCluster:
    def __init__(self, nodes: int, slurm_=None):
        self.nodes, self.up_, self.slurm_ = nodes, True, slurm_

    def node_name(self, i: int) -> str:
        return f"teraflops-fake-node{i}"


def machine(gpus: int, cores: int = 2) -> Machine:
    return Machine("cuda" if gpus else "cpu", tuple(GPU(i, "stand-in GPU", 80 << 30, (9, 0)) for i in range(gpus)),
                   cpu_cores=cores)


def job(gpus: int = 0, ranks: int = 4, program=("/w/rank_wrapper.py", "teraflops.workers.selftest"), **kw) -> BatchJob:
    where = place(ranks, cluster=FakeCluster(2), machine=machine(gpus), environ={})
    return BatchJob.of(where, program, torchrun=["/venv/bin/torchrun"], port=29400, time_s=kw.pop("time_s", 120),
                       output="/tmp/r/slurm-%j.out", name="teraflops.workers.selftest",
                       env={RESULTS_ENV: "/tmp/r", **kw.pop("env", {})}, cpus_per_node=kw.pop("cpus_per_node", 2), **kw)


# ---- pure -----------------------------------------------------------------------------------------


def test_the_script_allocates_k_nodes_and_sruns_one_torchrun_each_meeting_on_the_first_node():
    text = job().script()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "--time=0:02:00",
                   "--output=/tmp/r/slurm-%j.out", "--job-name=teraflops.workers.selftest"):
        assert f"#SBATCH {option}" in lines, option
    assert not any("--gpus" in x for x in lines)  # CPU ranks ask for no GPU
    first = 'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'
    srun = next(i for i, x in enumerate(lines) if x.startswith("srun "))
    assert lines.index(first) < srun and "--kill-on-bad-exit=1" in lines[srun]
    step = "\n".join(lines[srun:])
    assert "exec /venv/bin/torchrun" in step and "--nnodes 2 --nproc-per-node 2" in step
    assert '--rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:29400" --rdzv-id "$SLURM_JOB_ID"' in step
    assert all(x in step for x in sbatch.ADDRESS_RULE) and '--local-addr "$addr"' in step  # the node's own address
    assert 'export TERAFLOPS_LISTEN_ADDRS="$addr"' in step  # where its stores listen (teraflops.launch.loopback)
    assert step.rstrip().endswith("/w/rank_wrapper.py teraflops.workers.selftest'")
    assert 'export TERAFLOPS_NODE="$SLURM_NODEID"' in step
    assert 'if [ "${TERAFLOPS_EMULATED_NODES:-}" = 1 ]; then\n    export NCCL_HOSTID="$SLURMD_NODENAME"' in step
    # the course's environment, once for all nodes, before srun (which passes it on)
    for var in ("export TERAFLOPS_BACKEND=gloo", "export OMP_NUM_THREADS=1",
                "export TERAFLOPS_RESULTS_DIR=/tmp/r", "export TRITON_INTERPRET=1", "  export GLOO_SOCKET_IFNAME=eth0"):
        assert var in lines[:srun], var
    assert 'case "$SLURM_NODEID"' not in step  # nothing differs per node but what Slurm says


def test_gpu_ranks_ask_for_gpus_and_each_node_gets_its_share():
    text = job(gpus=4).script()
    assert "#SBATCH --gpus-per-node=2" in text.splitlines()
    assert "      0) export CUDA_VISIBLE_DEVICES=0,1 TERAFLOPS_CUDA_VISIBLE_DEVICES=0,1 ;;" in text
    assert "      1) export CUDA_VISIBLE_DEVICES=2,3 TERAFLOPS_CUDA_VISIBLE_DEVICES=2,3 ;;" in text
    assert "export TERAFLOPS_BACKEND=nccl" in text


def _run_script_on_node(tmp_path, text: str, node: int, emulated: bool) -> dict:
    """Run the script as node ``node`` of a job would, with stand-ins for scontrol, srun (runs its
    step here) and torchrun (writes the environment it got): the environment a rank would start with."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, body in (("scontrol", "echo gpu-node-0"),
                       ("srun", 'while [ "$1" != bash ]; do shift; done; exec "$@"'),
                       ("torchrun", f'env -0 > {tmp_path}/env.bin')):
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text.replace("/venv/bin/torchrun", str(stubs / "torchrun")))
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "gpu-node-[0-1]", "SLURM_JOB_ID": "7",
           "SLURM_NODEID": str(node), "SLURMD_NODENAME": f"gpu-node-{node}",
           **({sbatch.EMULATED_ENV: "1"} if emulated else {})}
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    return dict(kv.split("=", 1) for kv in (tmp_path / "env.bin").read_text().split("\0") if "=" in kv)


# getent as glibc's files backend answers it, from the hosts file $FAKE_HOSTS: ``hosts`` the first
# line naming the host, ``ahostsv4`` each of its IPv4 addresses (STREAM, DGRAM and RAW lines)
FAKE_GETENT = r"""db=$1 name=$2 found=
while read -r ip names; do
  case "$ip" in ""|"#"*) continue ;; esac
  for n in $names; do
    [ "$n" = "$name" ] || continue
    case "$db" in
      hosts) echo "$ip $names"; exit 0 ;;
      ahostsv4) case "$ip" in *:*) ;; *) printf "%-15s STREAM %s\n%-15s DGRAM\n%-15s RAW\n" "$ip" "$name" "$ip" "$ip"; found=1 ;; esac ;;
    esac
  done
done < "$FAKE_HOSTS"
[ -n "$found" ] || exit 2"""


def _address_on(tmp_path, hosts: str, interfaces: str) -> tuple[str, str, str]:
    """Run the rendered script as node ``node1`` whose hosts file is ``hosts`` and whose interfaces'
    addresses (``hostname -I``) are ``interfaces``: (its ``--local-addr``, the address its stores may
    listen on, the script's stderr)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in (("scontrol", "echo node0"), ("srun", 'while [ "$1" != bash ]; do shift; done; exec "$@"'),
                       ("getent", FAKE_GETENT),
                       ("hostname", f'if [ "${{1:-}}" = -I ]; then echo "{interfaces} "; else echo node1; fi'),
                       ("torchrun", f'printf "%s\\n" "$@" > {tmp_path}/args; echo "$TERAFLOPS_LISTEN_ADDRS" > {tmp_path}/listen')):
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    (tmp_path / "hosts").write_text(hosts)
    script = tmp_path / "job.sbatch"
    script.write_text(job().script().replace("/venv/bin/torchrun", str(stubs / "torchrun")))
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_ID": "7",
           "SLURM_NODEID": "1", "SLURMD_NODENAME": "node1", "FAKE_HOSTS": str(tmp_path / "hosts")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True, timeout=30)
    args = (tmp_path / "args").read_text().splitlines()
    return args[args.index("--local-addr") + 1], (tmp_path / "listen").read_text().strip(), done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("hosts, interfaces", [
    ("127.0.0.1 localhost\n127.0.1.1 node1\n10.1.2.3 node1\n", ""),  # files hold both: the network one
    ("127.0.0.1 localhost\n127.0.1.1 node1\n", "10.1.2.3 172.17.0.1 fe80::1"),  # Debian's: from the interfaces
])
def test_a_node_named_127_0_1_1_by_its_hosts_file_still_gives_its_network_address(tmp_path, hosts, interfaces):
    """Debian's and Ubuntu's installers write ``127.0.1.1 HOSTNAME`` into /etc/hosts: the address the
    agent gives the others (``--local-addr``) and its stores listen on must be one they can reach."""
    local, listen, err = _address_on(tmp_path, hosts, interfaces)
    assert local == listen == "10.1.2.3" and not err


@pytest.mark.slow
def test_a_node_with_only_loopback_falls_back_to_its_name_and_says_so(tmp_path):
    local, listen, err = _address_on(tmp_path, "127.0.0.1 localhost\n127.0.1.1 node1\n", "")
    assert local == listen == "node1"
    assert err.count("\n") == 1 and "node1 has no address but loopback" in err and "Hint:" in err


@pytest.mark.slow
def test_the_script_on_a_real_cluster_leaves_gpus_and_network_to_slurm_and_nccl(tmp_path):
    """The archived job.sbatch is the script to take to a real cluster. Rendered for 2 nodes ×
    2 GPUs and run as node 1 of a real cluster, its ranks get neither the emulation's sockets, nor
    InfiniBand off, nor NCCL's socket transport, nor GPUs 2,3 of the login machine; on the emulated
    nodes (TERAFLOPS_EMULATED_NODES=1, as the course submits it) they get all of them."""
    text = job(gpus=4).script()
    real = _run_script_on_node(tmp_path, text, 1, emulated=False)
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_HOSTID",
                "CUDA_VISIBLE_DEVICES", "TERAFLOPS_CUDA_VISIBLE_DEVICES"):
        assert var not in real, f"{var}={real[var]} reaches a real cluster's ranks"
    assert real["TERAFLOPS_BACKEND"] == "nccl" and real["TERAFLOPS_NODE"] == "1"
    emulated = _run_script_on_node(tmp_path, text, 1, emulated=True)
    assert emulated["CUDA_VISIBLE_DEVICES"] == "2,3" and emulated["NCCL_IB_DISABLE"] == "1"
    assert emulated["NCCL_NET"] == "Socket" and emulated["NCCL_SOCKET_IFNAME"] == "eth0"
    assert emulated["NCCL_HOSTID"] == "gpu-node-1"


def test_cpus_threads_time_and_quoting():
    assert job(cpus_per_node=1).cpus_per_task == 1  # at most what a node declares
    assert job(ranks=2, cpus_per_node=8).cpus_per_task == 1  # 1 rank per node x 1 thread
    assert job(time_s=61).time_limit == "0:02:00" and job(time_s=7200).time_limit == "2:00:00"
    assert job(time_s=5).time_limit == "0:01:00"  # Slurm's unit is the minute
    odd = "/tmp/it's a file.json"
    text = job(program=("/w/rank_wrapper.py", "m", "--spec", odd), env={"X": "a b"}).script()
    assert "export X='a b'" in text
    step = text[text.index("bash -c "):]
    body = shlex.split(step[len("bash -c "):])[0]  # what bash -c runs on each node
    assert shlex.split(body.splitlines()[-1])[-2:] == ["--spec", odd]


@pytest.mark.parametrize("changes, words", [
    ({"name": "no spaces here"}, "job name"), ({"nodes": 0}, "nodes"), ({"port": 70000}, "port"),
    ({"time_s": 0}, "time_s"), ({"cpus_per_task": 1.5}, "cpus_per_task"), ({"env": (("1X", "v"),)}, "identifiers"),
    ({"node_env": ((),)}, "node_env"),
])
def test_a_bad_job_is_one_line(changes, words):
    from dataclasses import replace

    with pytest.raises(BatchJobError, match=words) as info:
        replace(job(), **changes)
    assert "\n" not in str(info.value)


def test_scontrol_lines_and_exit_codes():
    line = ("JobId=7 JobName=selftest UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
            "ExitCode=1:0 NodeList=node[0-1] BatchHost=node0")
    state = parse_job(7, line)
    assert state == JobState(7, "FAILED", 1, 0, "NonZeroExitCode", "node[0-1]") and state.ended
    assert state.describe() == "Slurm job 7 FAILED (exit code 1) on node[0-1]"
    pending = parse_job(8, "JobId=8 JobState=PENDING Reason=Resources ExitCode=0:0 NodeList=(null)")
    assert not pending.ended and pending.describe() == "Slurm job 8 PENDING, Resources"
    assert parse_job(9, "slurm_load_jobs error: Invalid job id specified") is None

    class Fake:
        def __init__(self, text):
            self.text = text

        def exec(self, cmd, **kw):
            return subprocess.CompletedProcess(cmd, 0, self.text, "")

    assert Follower(Fake("JobState=RUNNING ExitCode=0:0"), 1).poll() is None
    assert Follower(Fake("JobState=COMPLETED ExitCode=0:0"), 1).poll() == 0
    assert Follower(Fake("JobState=CANCELLED ExitCode=0:15"), 1).poll() == -15
    assert Follower(Fake("JobState=FAILED ExitCode=2:0"), 1).poll() == 2
    assert Follower(Fake("JobState=PENDING Reason=Resources"), 1).poll() is None  # waits for the nodes
    assert Follower(Fake("JobState=PENDING Reason=PartitionConfig"), 1).poll() == 1  # waiting will not help


def test_submit_needs_a_slurm_cluster():
    with pytest.raises(CourseError, match="submit=True needs a cluster that runs Slurm"):
        launch(SELFTEST, 1, cluster=FakeCluster(2), submit=True)


# ---- real ----------------------------------------------------------------------------------------


def _unavailable() -> str | None:
    if sys.platform != "linux":
        return "needs Linux"
    from teraflops.nodes import cluster

    return cluster.unavailable() or slurm_mod.unavailable()


REASON = _unavailable()
NEEDS_SLURM = pytest.mark.skipif(REASON is not None, reason=f"Slurm on emulated nodes unavailable: {REASON}")


@pytest.fixture(scope="module")
def slurm_cluster():
    from teraflops.nodes.cluster import Cluster

    with Cluster(2, name="sbt", slurm=True) as c:
        yield c


def _left_in_nodes(c) -> list[str]:
    """Processes in the cluster's node namespaces that are not its Slurm daemons."""
    from teraflops.nodes import cluster

    out = []
    for i in range(c.nodes):
        for pid in cluster.pids(c.node_name(i)):
            try:
                proc = psutil.Process(pid)
                name, status = proc.name(), proc.status()
            except psutil.Error:
                continue
            if status == psutil.STATUS_ZOMBIE:  # dead; a slurmstepd stays one ~1 s until slurmd reaps it
                continue
            if name not in (*slurm_mod.DAEMONS, "slurmscriptd"):  # slurmctld's helper (runs its scripts)
                out.append(f"{name} ({pid}) on node{i}")
    return out


def _assert_nothing_left(c) -> None:
    assert sbatch.queued(c.slurm_) == []  # nothing allocated, nothing waiting
    assert _left_in_nodes(c) == []


def _last_job(c) -> tuple[str, JobState]:
    script = sbatch.archived(c.slurm_)[-1]
    return script.read_text(), sbatch.job_state(c.slurm_, int(script.stem))


@NEEDS_SLURM
@pytest.mark.slow
def test_ddp_through_sbatch_trains_as_the_torchrun_path(slurm_cluster, remedies_tiny_run):
    """2-node DDP submitted with sbatch: the losses of the torchrun launch (conftest) within 1e-4."""
    from teraflops.hardware import remedies
    from teraflops.sizing import PRESETS
    from teraflops.launch.placement import data_parallel_plan

    tiny = PRESETS["tiny"]
    one = next(r for r in remedies_tiny_run.rows if r["setting"] == "baseline")
    two = remedies.run(settings=("baseline",), plan=data_parallel_plan(tiny, ranks_cpu=tiny.remedy.ranks_cpu),
                       cluster=slurm_cluster)
    text, state = _last_job(slurm_cluster)
    assert "#SBATCH --nodes=2" in text and "--nproc-per-node 2" in text and "remedies" in text
    assert state.state == "COMPLETED" and state.nodes == "node[0-1]"  # Slurm ran it, on both nodes
    losses = two.rows[0]["losses"]
    print(f"DDP losses, torchrun: {one['losses'][:3]}..., sbatch: {losses[:3]}...")
    assert two.ranks == remedies_tiny_run.ranks == 4 and len(losses) == len(one["losses"])
    assert max(abs(x - y) for x, y in zip(one["losses"], losses)) < 1e-4
    _assert_nothing_left(slurm_cluster)


@NEEDS_SLURM
@pytest.mark.slow
def test_zero2_through_sbatch_trains_as_the_torchrun_path(slurm_cluster, zero_tiny_runs):
    from teraflops.parallelization import zero
    from teraflops.sizing import PRESETS
    from teraflops.launch.placement import data_parallel_plan

    one = zero_tiny_runs[0][2]  # stages (0, 1, 2, 3): ZeRO-2, one node
    two = zero.run_zero(stages=(2,), plan=data_parallel_plan(PRESETS["tiny"]), steps=3, cluster=slurm_cluster)[0]
    text, state = _last_job(slurm_cluster)
    assert "zero_train" in text and state.state == "COMPLETED" and state.nodes == "node[0-1]"
    assert two.stage == one.stage == 2 and two.world_size == one.world_size == 2
    print(f"ZeRO-2 losses, torchrun: {one.losses}, sbatch: {two.losses}")
    for a, b in zip(one.losses, two.losses):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    _assert_nothing_left(slurm_cluster)


@NEEDS_SLURM
@pytest.mark.slow
def test_a_killed_rank_ends_the_job_in_one_line_naming_rank_and_node(slurm_cluster):
    with pytest.raises(LaunchFailed) as info:
        selftest.run(1, cluster=slurm_cluster, timeout=60, env={FAULT_ENV: "kill:rank=1:step=1"})
    msg, logs = str(info.value), info.value.logs
    assert "\n" not in msg and info.value.rank == 1, msg
    assert "rank 1 of 2 on node1 was killed by SIGKILL" in msg and "FAILED" in msg, msg
    assert "nothing left allocated" in msg and str(logs) in msg, msg
    assert (logs / "job.sbatch").exists()  # kept with the logs, for the learner to read and resubmit
    _assert_nothing_left(slurm_cluster)
    assert not [p for p in psutil.process_iter() if _env(p).get(RESULTS_ENV) == str(logs)]
    shutil.rmtree(logs)


@NEEDS_SLURM
@pytest.mark.slow
def test_a_job_that_never_starts_is_cancelled_at_the_timeout(slurm_cluster):
    s = slurm_cluster.slurm_
    blocker = s.exec(["sbatch", "--parsable", "-N2", "--exclusive", "--wrap", "sleep 120"], check=True)
    try:
        with pytest.raises(LaunchFailed) as info:
            selftest.run(1, cluster=slurm_cluster, timeout=3)
        msg = str(info.value)
        assert "\n" not in msg and "was still PENDING (Resources)" in msg and info.value.rank is None, msg
        assert sbatch.queued(s) == [int(blocker.stdout.strip())]  # ours is gone, the blocker still runs
        shutil.rmtree(info.value.logs)
    finally:
        sbatch.cancel(s, int(blocker.stdout.strip()))
    _assert_nothing_left(slurm_cluster)


def _env(p) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


@NEEDS_SLURM
@pytest.mark.slow
def test_a_job_asking_for_more_than_a_node_has_fails_at_once(slurm_cluster, monkeypatch):
    from dataclasses import replace

    of = BatchJob.of.__func__
    monkeypatch.setattr(BatchJob, "of", classmethod(lambda cls, *a, **k: replace(of(cls, *a, **k), cpus_per_task=64)))
    with pytest.raises(LaunchFailed) as info:
        selftest.run(1, cluster=slurm_cluster, timeout=60)
    msg = str(info.value)
    assert "\n" not in msg and "cannot start: it is PENDING (PartitionConfig)" in msg and "sinfo" in msg, msg
    assert "#SBATCH --cpus-per-task=64" in (info.value.logs / "job.sbatch").read_text()
    shutil.rmtree(info.value.logs)
    _assert_nothing_left(slurm_cluster)
