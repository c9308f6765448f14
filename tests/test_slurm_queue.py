"""The queue on real Slurm: what is read back from scontrol and sacct, and how it is compared with the simulation.

The real runs (FIFO, backfill and fair share on Slurm) are checked once, from the Unit 3 lecture's output
(tests/test_unit03_run.py): the lecture runs exactly them, and CI runs each lecture once.
"""

import pytest

from teraflops.orchestration import queue_sim
from teraflops.orchestration import slurm_queue as q

RUNNING = ("JobId=7 JobName=j3-bob UserId=root(0) JobState=RUNNING Reason=None SubmitTime=2026-12-02T06:00:00 "
           "StartTime=2026-12-02T06:00:01 EndTime=2026-12-02T06:01:01 NodeList=node[0-1] NumNodes=2 "
           "JOB_GRES=gpu:4   Nodes=node[0-1] CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1) MinCPUsNode=1 "
           "TresPerNode=gres:gpu:2\n"
           "JobId=8 JobName=j4 JobState=PENDING StartTime=Unknown EndTime=Unknown NodeList=(null)\n"
           "JobId=9 JobName=j5 JobState=RUNNING StartTime=2026-12-02T06:00:02 EndTime=2026-12-02T06:01:02 "
           "Nodes=node2 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:1)\n")


def test_scontrol_records_are_read_with_gpu_indices():
    jobs = q.parse_jobs(RUNNING)
    assert jobs[7]["state"] == "RUNNING" and jobs[7]["nodes"] == (0, 1) and jobs[7]["gpus"] == {0: (0, 1), 1: (0, 1)}
    assert jobs[7]["end"] - jobs[7]["start"] == 60
    assert jobs[8]["start"] is None and jobs[8]["gpus"] == {}
    assert jobs[9]["gpus"] == {2: (1,)}
    assert q._expand("node[0-2,5]") == [0, 1, 2, 5] and q._expand("node3") == [3]


def test_sbatch_lines_ask_for_one_node_or_whole_nodes():
    one = q.sbatch_args(q.MixJob(1, "bob", 1, 6, 1), 2, "/x/%j.out")
    assert "--nodes=1" in one and "--gres=gpu:1" in one and "--time=1" in one and "--wrap=sleep 6" in one
    big = q.sbatch_args(q.MixJob(2, "llm", 6, 6, 2, account="teama"), 2, "/x/%j.out")
    assert "--nodes=3" in big and "--gres=gpu:2" in big and "--account=teama" in big
    with pytest.raises(q.QueueError, match="not whole nodes"):
        q.sbatch_args(q.MixJob(3, "x", 3, 1, 1), 2, "o")


def test_the_lecture_mix_separates_the_policies_in_the_simulation():
    """What the lecture claims of its mix, on the simulation alone: backfill runs small jobs ahead of
    the blocked 3-node head without delaying it; FIFO runs none and strands GPUs by fragmentation."""
    jobs = [j.job() for j in q.LECTURE_MIX]
    fifo, bf = (queue_sim.simulate(jobs, p, 3, 2) for p in (queue_sim.fifo, queue_sim.backfill))
    assert q.head_job(fifo).id == q.head_job(bf).id == 2
    assert q.jumped_head(fifo) == [] and q.jumped_head(bf) == [3, 4, 6]
    assert q.head_delay(fifo) == q.head_delay(bf) == 0
    assert fifo.stranded_gpus > 0 == bf.stranded_gpus and bf.utilisation > fifo.utilisation
    assert q.start_order(bf) == [(1, 3, 4), (6,), (2,), (5, 7)]


def test_differences_name_the_lag_and_a_changed_order():
    jobs = [j.job() for j in q.LECTURE_MIX]
    sim = queue_sim.simulate(jobs, queue_sim.fifo, 3, 2)
    late = [queue_sim.JobRun(r.job, r.start + (1.0 if r.start else 0.4), r.end + (1.0 if r.start else 0.4),
                              r.nodes, r.gpus_held) for r in sim.runs]
    real = queue_sim.measure(late, 3, 2, "Slurm FIFO")
    run = q.QueueRun("fifo", real, sim, {})
    lines = q.differences(run)
    assert len(lines) == 1 and "first pass came 0.4 s" in lines[0] and "hand-overs" in lines[0]
    swapped = [queue_sim.JobRun(r.job, r.start + (30 if r.job.id == 2 else 0), r.end + (30 if r.job.id == 2 else 0),
                                 r.nodes, r.gpus_held) for r in sim.runs]
    lines = q.differences(q.QueueRun("fifo", queue_sim.measure(swapped, 3, 2, "x"), sim, {}))
    assert any(line.startswith("start order differs") for line in lines)


def test_measure_reads_a_hand_made_schedule():
    """2 nodes × 2 GPUs; job 1 holds GPUs 0 and 2 (one per node) for 2 s, job 2 (2 GPUs, one node)
    waits for it though 2 GPUs are free: stranded 2 GPUs for 2 of 3 s."""
    j1, j2 = queue_sim.Job(1, "a", 1, 0.0, 2.0), queue_sim.Job(2, "b", 2, 0.0, 1.0)
    k = queue_sim.Job(3, "a", 1, 0.0, 2.0)
    runs = [queue_sim.JobRun(j1, 0.0, 2.0, (0,), (0,)), queue_sim.JobRun(k, 0.0, 2.0, (1,), (2,)),
            queue_sim.JobRun(j2, 2.0, 3.0, (0,), (0, 1))]
    r = queue_sim.measure(runs, 2, 2, "hand")
    assert r.makespan_h == 3.0 and r.utilisation == pytest.approx((2 + 2 + 2) / (4 * 3))
    assert r.stranded_gpus == pytest.approx(2 * 2 / 3) and r.mean_wait_h == pytest.approx(2 / 3)


def test_sacct_records_are_read():
    got = q.parse_sacct("12|COMPLETED|2026-12-02T06:00:01|2026-12-02T06:00:07|node[0-1]\n"
                        "13|CANCELLED by 0|2026-12-02T06:00:02|Unknown|node2\nnot a row\n")
    assert got[12]["state"] == "COMPLETED" and got[12]["end"] - got[12]["start"] == 6 and got[12]["nodelist"] == "node[0-1]"
    assert got[13]["state"] == "CANCELLED" and got[13]["end"] is None and 14 not in got
