"""Placement: where the ranks of each run go, for every machine shape, decided in one place.

Stand-in machines (``Machine`` with ``GPU`` entries) reach every GPU branch of the decision on the
CPU machine; the launch commands and the environment each rank gets are read from what
``launcher.launch`` builds, and two real DeepSpeed-launcher runs show the placement's GPU
visibility surviving the launcher's own ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import teraflops
from teraflops.launch import agents, placement as pl, selftest
from teraflops.machine import GPU, Machine
from teraflops.sizing import PRESETS
from teraflops.launch.placement import data_parallel_plan

PACKAGE = Path(teraflops.__file__).parent


def machine(gpus: int, *, memory_gib: int = 80, capability=(9, 0), cores: int = 16) -> Machine:
    """A stand-in machine with ``gpus`` GPUs of ``memory_gib`` GiB."""
    return Machine("cuda" if gpus else "cpu", tuple(GPU(i, "stand-in GPU", memory_gib << 30, capability)
                                                    for i in range(gpus)), cpu_cores=cores)


class FakeCluster:
    def __init__(self, nodes: int):
        self.nodes, self.up_ = nodes, True

    def node_name(self, i: int) -> str:
        return f"teraflops-fake-node{i}"

    def address(self, i: int) -> str:
        return f"10.213.0.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.node_name(i)]


def test_cpu_only_machine_gets_gloo_cpu_ranks_and_no_gpu_variables():
    where = pl.place(None, cpu_ranks=4, machine=machine(0), environ={})
    assert (where.world_size, where.backend, where.devices) == (4, "gloo", ("cpu",) * 4)
    env = where.rank_env()
    assert env[pl.BACKEND_ENV] == "gloo" and env["TRITON_INTERPRET"] == "1" and env["OMP_NUM_THREADS"] == "4"
    assert "CUDA_VISIBLE_DEVICES" not in env and env["GLOO_SOCKET_IFNAME"] == "lo" == env["NCCL_SOCKET_IFNAME"]


def test_one_gpu_gets_cpu_ranks_with_the_gpu_hidden_and_says_why():
    where = pl.place(None, cpu_ranks=2, min_ranks=2, machine=machine(1), environ={"TRITON_INTERPRET": "0"})
    assert where.backend == "gloo" and where.world_size == 2 and "one GPU" in where.note
    env = where.rank_env()
    # hidden twice: for torchrun, and for the rank wrapper to put back after DeepSpeed's launcher
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env[pl.VISIBLE_ENV] == ""
    assert env["TRITON_INTERPRET"] == "1"  # a hidden-GPU rank must not inherit the parent's compiled mode


def test_two_or_more_gpus_get_one_nccl_rank_each():
    where = pl.place(None, cpu_ranks=4, machine=machine(4), environ={})
    assert (where.world_size, where.backend) == (4, "nccl")
    assert where.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert where.rank_env()["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and where.rank_env()["TRITON_INTERPRET"] == "0"


def test_a_users_cuda_visible_devices_is_respected():
    where = pl.place(None, cpu_ranks=4, machine=machine(2), environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert where.backend == "nccl" and where.gpu_ids == (("2", "3"),)
    assert where.rank_env()["CUDA_VISIBLE_DEVICES"] == "2,3" and where.rank_env()[pl.VISIBLE_ENV] == "2,3"


def test_the_three_rank_detector_on_two_gpus_gets_cpu_ranks_and_says_so():
    where = pl.place(None, cpu_ranks=4, min_ranks=3, machine=machine(2), environ={})
    assert where.backend == "gloo" and where.world_size == 4
    assert "at least 3" in where.note and "2 GPUs" in where.note
    plan = data_parallel_plan(PRESETS["gpu"], ranks_cpu=4, min_ranks=3, machine=machine(2))
    assert plan.ranks == 4 and plan.preset.name == "cpu" and not plan.placement.on_gpus
    # with three GPUs it is one NCCL rank each, on the GPU preset
    plan = data_parallel_plan(PRESETS["gpu"], ranks_cpu=4, min_ranks=3, machine=machine(3))
    assert plan.ranks == 3 and plan.preset.name == "gpu" and plan.placement.on_gpus


def test_more_ranks_than_gpus_gives_cpu_ranks():
    where = pl.place(6, machine=machine(4), environ={})
    assert where.backend == "gloo" and where.world_size == 6 and "6 ranks" in where.note


def test_emulated_nodes_split_the_world_and_use_distinct_gpus():
    where = pl.place(None, cluster=FakeCluster(2), machine=machine(4), environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert (where.world_size, where.nodes, where.ranks_per_node, where.backend) == (4, 2, 2, "nccl")
    assert where.gpu_ids == (("4", "5"), ("6", "7"))
    envs = [where.rank_env(i) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]  # local rank 0 of each node: distinct GPUs
    assert [e[pl.NODE_ENV] for e in envs] == ["0", "1"] and envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert all(e["GLOO_SOCKET_IFNAME"] == "eth0" == e["NCCL_SOCKET_IFNAME"] for e in envs)
    cpu = pl.place(6, cluster=FakeCluster(3), machine=machine(0), environ={})
    assert cpu.ranks_per_node == 2 and cpu.backend == "gloo"


@pytest.mark.parametrize("kwargs, words", [
    ({"ranks": 5, "cluster": FakeCluster(2)}, "split evenly"), ({"ranks": 2, "min_ranks": 3}, "at least 3"),
    ({"ranks": 0}, "positive int"), ({"ranks": True}, "positive int"), ({"ranks": None}, "needs a world size")])
def test_runs_that_cannot_be_placed_are_one_line_errors(kwargs, words):
    with pytest.raises(pl.PlacementError, match=words) as info:
        pl.place(**kwargs, machine=machine(0), environ={})
    assert "\n" not in str(info.value)


def test_rank_side_reads_the_placement_not_the_gpu_count():
    assert pl.rank_device({pl.BACKEND_ENV: "gloo", "LOCAL_RANK": "1"}, gpu_count=4) == ("gloo", "cpu")
    assert pl.rank_device({pl.BACKEND_ENV: "nccl", "LOCAL_RANK": "1"}, gpu_count=2) == ("nccl", "cuda:1")
    with pytest.raises(pl.PlacementError, match="LOCAL_RANK=1"):
        pl.rank_device({pl.BACKEND_ENV: "nccl", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}, gpu_count=1)
    # started some other way: a GPU per local rank means NCCL
    assert pl.rank_device({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, gpu_count=2) == ("nccl", "cuda:0")
    assert pl.rank_device({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, gpu_count=1) == ("gloo", "cpu")


def test_launch_commands_per_launcher_and_node():
    where = pl.place(2, machine=machine(0), environ={})
    torchrun, = agents.launch_commands(where, "m", Path("/r/spec.json"), port=1234)
    assert torchrun[-3:] == ["m", "--spec", "/r/spec.json"]  # a rank's only argument: its Spec
    assert torchrun[1:6] == ["-m", "teraflops.launch.loopback", "torch.distributed.run", "--nproc-per-node", "2"]
    assert torchrun[torchrun.index("--master-addr") + 1] == "127.0.0.1"  # its stores on loopback only
    c10d, = agents.launch_commands(where, "m", port=1234, launcher_args=["--rdzv-backend", "c10d"])
    assert "127.0.0.1:1234" in c10d and c10d[c10d.index("--local-addr") + 1] == "127.0.0.1"
    ds, = agents.launch_commands(where, "m", launcher="deepspeed", port=1234)
    assert ds[-1] == "m"  # no Spec, no arguments
    assert ds[2] == "deepspeed.launcher.runner" and ds[ds.index("--num_gpus") + 1] == "2"
    spread = pl.place(4, cluster=FakeCluster(2), machine=machine(0), environ={})
    nodes = agents.launch_commands(spread, "m", cluster=FakeCluster(2), port=1234)
    assert len(nodes) == 2 and all(c[c.index("--nproc-per-node") + 1] == "2" for c in nodes)
    assert nodes[1][:4] == ["ip", "netns", "exec", "teraflops-fake-node1"] and "is_host=0" in nodes[1]


def test_no_caller_places_ranks_by_itself():
    """One home for placement: no module but placement.py hides GPUs, splits ranks per node or picks
    the backend from a GPU count."""
    patterns = [r'CUDA_VISIBLE_DEVICES"\s*:\s*""', r"\bper_node\(", r'"nccl" if .*gpu']
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("placement.py",):
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(PACKAGE)}: {p}" for p in patterns if re.search(p, text)]
    assert not offenders, offenders


@pytest.mark.slow
def test_gpu_visibility_survives_deepspeeds_launcher():
    """DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES=0..n-1 for every rank (also on CPU); the ranks
    must see the placement's value instead (measured before the fix: "0,1"). One launch, a user's
    list "2,3": the same mechanism keeps hidden GPUs ("") hidden."""
    visible = "2,3"
    base = pl.place(2, machine=machine(0), environ={})
    where = pl.Placement(2, 1, "gloo", ((),), base.env,
                         ({**base.node_env[0], "CUDA_VISIBLE_DEVICES": visible, pl.VISIBLE_ENV: visible},), "test")
    results = selftest.run(where, selftest.SelftestSpec(steps=1), launcher="deepspeed", timeout=240)
    assert [r.cuda_visible_devices for r in results] == [visible, visible]
    assert {r.backend for r in results} == {"gloo"} and {r.triton_interpret for r in results} == {"1"}


def test_too_few_gpu_ranks_per_cluster_fall_back_to_cpu_ranks():
    """3 GPUs, 2 nodes, a run needing 3 ranks: 2 GPU ranks would be too few, so CPU ranks."""
    where = pl.place(None, cpu_ranks=4, min_ranks=3, cluster=FakeCluster(2), machine=machine(3), environ={})
    assert where.backend == "gloo" and where.world_size == 4 and where.ranks_per_node == 2
