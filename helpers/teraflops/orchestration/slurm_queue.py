"""The queue on a real scheduler: a job mix run on Slurm, read back, and set beside the simulation.

Unit 3's :mod:`teraflops.orchestration.queue_sim` simulates FIFO, EASY backfill and fair share with SimPy. Here the
same kind of job mix runs on a real Slurm cluster on the emulated nodes (:mod:`teraflops.nodes.slurm`):
each job asks for nodes and fake GPUs (``sbatch --nodes --gres=gpu:N``) and a time limit
(``--time``, whole minutes: Slurm keeps limits in minutes), and its payload is ``sleep`` for its
runtime: the scheduler sees only the allocation and the limit, so the runtime is the variable under
study, not work done. The queue is filled while the partition is down (``scontrol update
PartitionName=main State=DOWN``: jobs queue, none starts) and opened at once, so every job is
eligible at the same instant ``t0`` and priorities follow submission order (``priority/basic``).

What comes back is Slurm's own record (``sacct`` on an accounting cluster, else ``scontrol show job``:
start and end times to the second; ``scontrol -d`` while a job runs: nodes and GPU indices per node),
turned into :class:`teraflops.orchestration.queue_sim.JobRun` rows and measured
with the same definitions as the simulation (:func:`teraflops.orchestration.queue_sim.measure`), in seconds.

Sources: sbatch(1), scontrol(1), slurm.conf(5) SchedulerType; Slurm's backfill
(https://slurm.schedmd.com/sched_config.html) and fair tree (https://slurm.schedmd.com/fair_tree.html).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime

from teraflops.errors import CourseError
from teraflops.nodes.cluster import Cluster
from teraflops.nodes.slurm import SlurmConfig
from teraflops.orchestration import queue_sim
from teraflops.orchestration.queue_sim import Job, JobRun, SimResult, fair_share, measure, simulate
from teraflops.tables import table


class QueueError(CourseError, RuntimeError):
    """A job mix could not be run or read back on Slurm; one line with a hint."""


@dataclass(frozen=True)
class MixJob:
    """One job of a mix: ``gpus`` fake GPUs (at most a node's, or whole nodes), running ``runtime_s``
    seconds under a limit of ``limit_min`` minutes, for ``account`` (a team; accounting clusters)."""

    id: int
    user: str
    gpus: int
    runtime_s: float
    limit_min: int
    account: str | None = None

    def job(self) -> Job:
        """This job for :func:`teraflops.orchestration.queue_sim.simulate`, times in seconds (the estimate is the
        limit: what Slurm plans with)."""
        return Job(self.id, self.user, self.gpus, 0.0, float(self.runtime_s), float(60 * self.limit_min))


# The lecture's mix on 3 nodes × 2 GPUs: a 2-node job runs, a 3-node job waits for it (the head),
# three 1-GPU jobs whose limits end before the head's reservation, a 1-node job whose limit does
# not, and a last 2-GPU job that under FIFO finds two free GPUs on two nodes (fragmentation).
# Runtimes in seconds, limits in minutes.
LECTURE_MIX = (
    MixJob(1, "alice", 4, 9, 3),
    MixJob(2, "llm-team", 6, 6, 2),
    MixJob(3, "bob", 1, 6, 1),
    MixJob(4, "chen", 1, 3, 1),
    MixJob(5, "bob", 2, 6, 5),
    MixJob(6, "chen", 1, 6, 1),
    MixJob(7, "alice", 2, 3, 1),
)


def sbatch_args(job: MixJob, gpus_per_node: int, output: str) -> list[str]:
    """The ``sbatch`` command of ``job`` (sbatch(1)): one node with ``--gres=gpu:G`` for a job of at
    most ``gpus_per_node`` GPUs, else ``gpus / gpus_per_node`` whole nodes.

    Raises:
        QueueError: a job bigger than a node that is not a multiple of ``gpus_per_node``.
    """
    if job.gpus > gpus_per_node and job.gpus % gpus_per_node:
        raise QueueError(f"job {job.id} asks for {job.gpus} GPUs: more than a node's {gpus_per_node} but not whole "
                         f"nodes. Hint: a multi-node job takes a multiple of {gpus_per_node} GPUs.")
    nodes, per_node = (1, job.gpus) if job.gpus <= gpus_per_node else (job.gpus // gpus_per_node, gpus_per_node)
    return ["sbatch", "--parsable", f"--job-name=j{job.id}-{job.user}", f"--nodes={nodes}",
            "--ntasks-per-node=1", f"--gres=gpu:{per_node}", f"--time={job.limit_min}", f"--output={output}",
            *([f"--account={job.account}"] if job.account else []), f"--wrap=sleep {job.runtime_s:g}"]


_FIELD = re.compile(r"(\w+)=(\S*)")
_DETAIL = re.compile(r"Nodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=gpu(?::\w+)?:(\d+)\(IDX:([\d,-]+)\)")


def _expand(spec: str, prefix: str = "node") -> list[int]:
    """``node[0-1,3]`` / ``node2`` / ``0-1,3`` → the integers."""
    m = re.fullmatch(re.escape(prefix) + r"\[([\d,-]+)\]", spec)
    body = m.group(1) if m else (spec[len(prefix):] if spec.startswith(prefix) else spec)
    out = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def parse_jobs(text: str) -> dict[int, dict]:
    """``scontrol -d -o show job`` output → per job id: ``state``, ``start``/``end`` (Unix s),
    ``nodes`` (ints) and ``gpus`` (per node, the GPU indices held)."""
    out = {}
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        if "JobId" not in fields:
            continue
        gpus = {}
        for node, _, idx in _DETAIL.findall(line):
            for n in _expand(node):
                gpus[n] = tuple(_expand(idx, ""))

        def stamp(key):
            value = fields.get(key, "Unknown")
            return None if value in ("Unknown", "None", "") else datetime.fromisoformat(value).timestamp()

        out[int(fields["JobId"])] = dict(state=fields.get("JobState"), start=stamp("StartTime"), end=stamp("EndTime"),
                                         name=fields.get("JobName"), nodes=tuple(sorted(gpus)), gpus=gpus)
    return out


def parse_sacct(text: str) -> dict[int, dict]:
    """``sacct -X -n -P -o JobID,State,Start,End,NodeList`` output → per job id: ``state``,
    ``start``/``end`` (Unix s; None while unknown), ``nodelist``."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5 or not parts[0].isdigit():
            continue

        def stamp(value):
            return None if value in ("Unknown", "None", "") else datetime.fromisoformat(value).timestamp()

        out[int(parts[0])] = dict(state=parts[1].split()[0], start=stamp(parts[2]), end=stamp(parts[3]),
                                  nodelist=parts[4])
    return out


def sacct_times(slurm, ids) -> dict[int, dict]:
    """Start and end of Slurm jobs ``ids`` from the accounting database (``sacct``; accounting clusters),
    retried for a few seconds while slurmdbd has not recorded an end yet."""
    ids = [int(i) for i in ids]
    deadline = time.monotonic() + 10
    while True:
        got = parse_sacct(slurm.exec(["sacct", "-X", "-n", "-P", "-j", ",".join(map(str, ids)),
                                      "-o", "JobID,State,Start,End,NodeList"]).stdout)
        if all(got.get(i, {}).get("end") for i in ids) or time.monotonic() > deadline:
            return {i: got[i] for i in ids if got.get(i, {}).get("end")}
        time.sleep(0.3)


@dataclass
class QueueRun:
    """A mix run on Slurm under one scheduler.

    Attributes:
        scheduler: ``"fifo"`` or ``"backfill"``.
        result: the real runs measured like the simulation (:func:`teraflops.orchestration.queue_sim.measure`;
            times in seconds from ``t0``, the instant the partition opened).
        simulated: the same mix simulated with the same policy (estimates = the limits).
        slurm_ids: course job id → Slurm job id.
    """

    scheduler: str
    result: SimResult
    simulated: SimResult
    slurm_ids: dict[int, int]


def run_mix(slurm, mix=LECTURE_MIX, timeout: float = 120) -> QueueRun:
    """Submit ``mix`` to ``slurm`` (a started :class:`teraflops.nodes.slurm.Slurm`), wait for every job to
    end, and read it back. The partition is down while submitting, then opened (see module doc).

    Raises:
        QueueError: a submission failed, a job failed, or not every job ended within ``timeout`` s.
    """
    gpn, nodes = slurm.config.gpus_per_node, slurm.cluster.nodes
    jobs = [j.job() for j in mix]
    queue_sim.check_trace(jobs, nodes, gpn)
    slurm.exec(["scontrol", "update", "PartitionName=main", "State=DOWN"], check=True)
    ids = {}
    try:
        for j in mix:
            done = slurm.exec(sbatch_args(j, gpn, f"{slurm.dir}/jobs/%j.out"), check=True)
            ids[j.id] = int(done.stdout.strip().split(";")[0])
    finally:
        t0 = time.time()
        slurm.exec(["scontrol", "update", "PartitionName=main", "State=UP"], check=True)
    deadline, held = time.monotonic() + timeout, {}
    while True:  # GPU indices are shown only while a job runs: kept from the polls
        found = parse_jobs(slurm.exec(["scontrol", "-d", "-o", "show", "job"]).stdout)
        for s, rec in found.items():
            if rec["state"] == "RUNNING" and rec["gpus"]:
                held[s] = rec["gpus"]
        states = {j: found.get(s, {}).get("state") for j, s in ids.items()}
        if all(s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") for s in states.values()):
            break
        if time.monotonic() > deadline:
            slurm.exec(["scancel", *map(str, ids.values())])
            raise QueueError(f"the mix did not finish within {timeout:g} s (states: {states}). "
                             "Hint: `teraflops cluster exec -- squeue` shows what waits and why.")
        time.sleep(0.5)
    bad = {j: s for j, s in states.items() if s != "COMPLETED"}
    if bad:
        raise QueueError(f"jobs {bad} did not complete. Hint: their output is in {slurm.dir}/jobs.")
    if slurm.config.accounting:  # the accounting record (sacct) where there is one: the same times
        found = {**found, **sacct_times(slurm, ids.values())}
    t0 = min(t0, min(found[ids[j.id]]["start"] for j in mix))  # a start stamped before t0 rounds down
    runs = []
    for j, job in zip(mix, jobs):
        rec = found[ids[j.id]]
        gpus = held.get(ids[j.id])
        if not gpus:
            raise QueueError(f"job {j.id} ran too briefly to read its GPUs (runtime {j.runtime_s:g} s). "
                             "Hint: give every job of a mix a runtime of 2 s or more.")
        rec_nodes = tuple(sorted(gpus))
        held_ids = tuple(n * gpn + g for n in rec_nodes for g in gpus[n])
        runs.append(JobRun(job, rec["start"] - t0, rec["end"] - t0, rec_nodes, held_ids))
    scheduler = slurm.config.scheduler
    policy = queue_sim.fifo if scheduler == "fifo" else queue_sim.backfill
    name = {"fifo": "FIFO", "backfill": "backfill"}[scheduler]
    return QueueRun(scheduler, measure(runs, nodes, gpn, f"Slurm {name}"),
                    simulate(jobs, policy, nodes, gpn, name=f"simulated {name}"), ids)


def start_order(result: SimResult, tolerance: float = 1.5) -> list[tuple[int, ...]]:
    """The jobs in order of start, those within ``tolerance`` s of the group's first start together
    (Slurm stamps starts to the second and schedules in passes)."""
    groups: list[list] = []
    for r in sorted(result.runs, key=lambda r: (r.start, r.job.id)):
        if groups and r.start - groups[-1][0] <= tolerance:
            groups[-1][1].append(r.job.id)
        else:
            groups.append([r.start, [r.job.id]])
    return [tuple(sorted(ids)) for _, ids in groups]


def compare_table(run: QueueRun) -> str:
    """Per job: GPUs, runtime, limit, start and nodes on Slurm and in the simulation (seconds)."""
    rows = []
    for real in sorted(run.result.runs, key=lambda r: r.job.id):
        sim = run.simulated.run(real.job.id)
        rows.append((real.job.id, real.job.user, real.job.gpus, real.job.duration, real.job.estimate / 60,
                     real.start, ",".join(map(str, real.nodes)), sim.start, ",".join(map(str, sim.nodes)),
                     real.start - sim.start))
    return table(rows, ["job", "user", "GPUs", "runtime s", "limit min", "Slurm start s", "Slurm nodes",
                        "sim start s", "sim nodes", "Slurm − sim s"])


def _submit(slurm, job: MixJob) -> int:
    done = slurm.exec(sbatch_args(job, slurm.config.gpus_per_node, f"{slurm.dir}/jobs/%j.out"), check=True)
    return int(done.stdout.strip().split(";")[0])


def _wait(slurm, ids, timeout: float) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = parse_jobs(slurm.exec(["scontrol", "-d", "-o", "show", "job"]).stdout)
        if all(found.get(i, {}).get("state") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") for i in ids):
            return found
        if time.monotonic() > deadline:
            slurm.exec(["scancel", *map(str, ids)])
            raise QueueError(f"jobs {list(ids)} did not finish within {timeout:g} s. "
                             "Hint: `teraflops cluster exec -- squeue` shows what waits and why.")
        time.sleep(0.5)


@dataclass(frozen=True)
class FairShareRun:
    """Fair share between two accounts on Slurm (``priority/multifactor``, Fair Tree).

    Attributes:
        heavy, light: the accounts (``heavy`` ran a history job first and holds the blocker).
        shares: ``sshare -P -a`` row of each account's association, read after the recalculation and
            before the contested jobs ran (strings by column: ``RawShares``, ``NormShares``,
            ``RawUsage``, ``EffectvUsage``, ``LevelFS``).
        priorities: ``sprio`` normalized fair-share factor (0-1) of each account's contested job then.
        starts: Unix start time (s, Slurm stamps whole seconds) of each contested job, by account; the
            heavy one was submitted first.
        waited_s: seconds from the contested submissions until ``sprio`` showed the recalculated
            factors (the controller restart, or up to one ``PriorityCalcPeriod`` without it).
        history_usage: ``RawUsage`` by account just after the history job ended, before the blocker
            (the finished job is charged at its end, not at the next recalculation).
    """

    heavy: str
    light: str
    shares: dict[str, dict]
    priorities: dict[str, float]
    starts: dict[str, float]
    waited_s: float
    history_usage: dict[str, float]

    @property
    def usage(self) -> dict[str, float]:
        """``RawUsage`` by account: billing-weighted seconds charged, decayed, whole units as ``sshare``
        prints them (truncated: 2 s on 2 CPUs shows 3). Billing = allocated CPUs here (no
        ``TRESBillingWeights``; slurm.conf(5))."""
        return {a: float(row["RawUsage"]) for a, row in self.shares.items()}

    @property
    def light_first(self) -> bool:
        """The light account's job started before the heavy one's, though submitted after it."""
        return self.starts[self.light] < self.starts[self.heavy]


def _account_rows(slurm, accounts) -> dict[str, dict]:
    """``sshare -P -a`` row of each account's own association (not its users'), strings by column."""
    rows = slurm.exec(["sshare", "-P", "-a", "-o", "Account,User,RawShares,NormShares,RawUsage,EffectvUsage,"
                       "LevelFS"]).stdout.splitlines()
    head, out = (rows[0].split("|") if rows else []), {}
    for row in rows[1:]:
        rec = {k: v.strip() for k, v in zip(head, row.split("|"))}
        if rec.get("Account") in accounts and not rec.get("User"):
            out[rec["Account"]] = rec
    return out


def _fair_share_factors(slurm, jobs: dict[str, int]) -> dict[str, float]:
    """``sprio``'s normalized fair-share factor of each pending job of ``jobs`` (account → job id)."""
    out = {}
    for line in slurm.exec(["sprio", "-h", "-o", "%i|%f"]).stdout.split():
        job, _, factor = line.partition("|")
        for acct, jid in jobs.items():
            if job.strip() == str(jid):
                out[acct] = float(factor)
    return out


def run_fair_share(slurm, runtime_s: float = 2, recompute: bool = True, timeout: float = 150) -> FairShareRun:
    """Fair share measured on an accounting cluster (``SlurmConfig(accounting=True)``).

    The heavy account (the first of ``config.accounts``) runs a history job of ``runtime_s`` s on
    every node (its usage is charged when it ends). Then a blocker job of the heavy account takes
    every node, and while it runs the heavy account submits a job needing every node and *after* it
    the light account does. Under FIFO order the heavy one would run first; fair share (Fair Tree:
    the account that used less of its share ranks higher, https://slurm.schedmd.com/fair_tree.html)
    runs the light one first once priorities are recalculated. Slurm recalculates fair-share factors
    and the priorities of pending jobs in one pass of its decay thread, which runs when ``slurmctld``
    starts and then every ``PriorityCalcPeriod`` (whole minutes, at least 1; slurm.conf(5)).

    ``recompute`` restarts the controller (:meth:`teraflops.nodes.slurm.Slurm.recompute_priorities`, ~2 s)
    instead of waiting up to a minute: the pass run at start-up is the same code as the periodic one
    (priority_multifactor.c ``_decay_thread``: decay over the seconds since the last pass, then the
    Fair Tree factors and every pending job's priority) on the same recorded usage (saved in the
    state directory across the restart), so the factors are what a periodic pass at that moment would
    compute; only the wait is skipped (``scontrol reconfigure`` does not run a pass). Without
    ``recompute`` it waits for the periodic pass. Either way it polls ``sprio`` until the contested
    jobs' factors differ, reads ``sprio`` and ``sshare``, then cancels the blocker so the pending
    jobs start in priority order.

    Raises:
        QueueError: the cluster has no accounting, or jobs did not start or finish within ``timeout`` s.
    """
    if not slurm.config.accounting:
        raise QueueError("fair share needs accounting. Hint: Cluster(3, slurm=SlurmConfig(accounting=True)) "
                         "or `teraflops cluster up --slurm --accounting`.")
    heavy, light = slurm.config.accounts[:2]
    every = slurm.cluster.nodes * slurm.config.gpus_per_node
    history = _submit(slurm, MixJob(0, heavy, every, runtime_s, 1, heavy))
    _wait(slurm, [history], timeout)
    charged = {a: float(row["RawUsage"]) for a, row in _account_rows(slurm, (heavy, light)).items()}
    limit = max(1, -(-int(timeout) // 60))  # whole minutes: the blocker is cancelled long before
    blocker = _submit(slurm, MixJob(0, heavy, every, timeout, limit, heavy))
    deadline = time.monotonic() + timeout
    while parse_jobs(slurm.exec(["scontrol", "-o", "show", "job", str(blocker)]).stdout).get(
            blocker, {}).get("state") != "RUNNING":
        if time.monotonic() > deadline:
            slurm.exec(["scancel", str(blocker)])
            raise QueueError(f"the blocker job {blocker} did not start within {timeout:g} s. "
                             "Hint: `teraflops cluster exec -- squeue` shows why it waits.")
        time.sleep(0.2)
    contested = {heavy: _submit(slurm, MixJob(0, heavy, every, runtime_s, 1, heavy))}
    contested[light] = _submit(slurm, MixJob(0, light, every, runtime_s, 1, light))
    t0 = time.monotonic()
    if recompute:
        slurm.recompute_priorities()
    deadline = time.monotonic() + (10 if recompute else 60 * slurm.config.priority_period + 10)
    while True:  # the recalculated factors differ (the light account has used less of its share)
        prio = _fair_share_factors(slurm, contested)
        if (len(prio) == 2 and prio[heavy] != prio[light]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    waited = time.monotonic() - t0
    shares = _account_rows(slurm, (heavy, light))
    slurm.exec(["scancel", str(blocker)], check=True)
    found = _wait(slurm, [blocker, *contested.values()], timeout)
    return FairShareRun(heavy, light, shares, prio, {a: found[j]["start"] for a, j in contested.items()}, waited,
                        charged)


def plot_gantt(runs: list[QueueRun]):
    """Per policy a row of two Gantt charts, Slurm (left) and the simulation (right): one line per GPU,
    grouped by node, each job a bar labelled with its id, coloured by user; x in seconds from the
    moment the queue opened. Returns the Figure."""
    import matplotlib.pyplot as plt

    users = sorted({r.job.user for q in runs for r in q.result.runs})
    colours = {u: plt.cm.tab10(i % 10) for i, u in enumerate(users)}
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 2.6 * len(runs) + 0.6), sharex=True, squeeze=False)
    end = max(max(r.end for r in res.runs) for q in runs for res in (q.result, q.simulated))
    for row, q in zip(axes, runs):
        for ax, res in zip(row, (q.result, q.simulated)):
            gpn, gpus = res.gpus_per_node, res.nodes * res.gpus_per_node
            for r in res.runs:
                for g in r.gpus_held:
                    ax.barh(g, r.end - r.start, left=r.start, height=0.9, color=colours[r.job.user],
                            edgecolor="white", linewidth=0.5)
                    ax.text(r.start + (r.end - r.start) / 2, g, str(r.job.id), ha="center", va="center", fontsize="small",
                            color="white")
            for n in range(1, res.nodes):
                ax.axhline(n * gpn - 0.5, color="black", linewidth=0.6)
            ax.set_yticks([n * gpn + (gpn - 1) / 2 for n in range(res.nodes)], [f"node{n}" for n in range(res.nodes)])
            ax.set_ylim(gpus - 0.5, -0.5)
            ax.set_xlim(0, end * 1.02)
            ax.set_title(f"{res.policy}: utilisation {100 * res.utilisation:.0f}%, mean wait {res.mean_wait_h:.1f} s",
                         fontsize="medium")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the queue opened")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[u]) for u in users]
    fig.legend(handles, users, loc="upper center", ncol=len(users), frameon=False, fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def mix_table(mix=LECTURE_MIX, gpus_per_node: int = 2) -> str:
    """The mix as a table: id, user, GPUs, nodes, runtime (s), time limit (min), and the sbatch line."""
    rows = []
    for j in mix:
        nodes = 1 if j.gpus <= gpus_per_node else j.gpus // gpus_per_node
        rows.append((j.id, j.user, j.gpus, nodes, j.runtime_s, j.limit_min,
                     " ".join(a for a in sbatch_args(j, gpus_per_node, "%j.out")[2:] if not a.startswith(("--job", "--out")))))
    return table(rows, ["job", "user", "GPUs", "nodes", "runtime s", "limit min", "sbatch"])


@dataclass(frozen=True)
class LectureRuns:
    """What Unit 3 runs on real Slurm (:func:`run_lecture`): the mix per scheduler, and fair share."""

    runs: tuple[QueueRun, ...]
    fair: FairShareRun | None


def _concurrently(tasks: dict, desc: str) -> dict:
    """Run each ``name: (nodes, SlurmConfig, fn)`` on a Slurm cluster of its own, all at once
    (threads: the jobs only sleep, so the clusters do not compete for the CPU); ``fn(slurm)``'s
    results by name. A progress bar counts finished clusters; every cluster is removed at the end,
    also on an error or Ctrl-C (the threads end within their timeouts). The first error is raised."""
    import threading

    from tqdm.auto import tqdm

    out, errors = {}, []
    bar = tqdm(total=len(tasks), desc=desc, unit="cluster")

    def one(name, nodes, config, fn):
        try:
            with Cluster(nodes, slurm=config) as cl:
                out[name] = fn(cl.slurm_)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            bar.update(1)

    threads = [threading.Thread(target=one, args=(name, *task), name=f"slurm-{name}") for name, task in tasks.items()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    finally:
        for t in threads:
            while t.is_alive():
                try:
                    t.join(0.2)
                except KeyboardInterrupt:
                    pass
        bar.close()
    if errors:
        raise errors[0]
    return out


def run_lecture(mix=LECTURE_MIX, with_fair_share: bool = True, timeout: float = 120) -> LectureRuns:
    """Unit 3's Slurm section at once: ``mix`` under FIFO and under backfill (3 nodes × 2 fake GPUs
    each) and, with ``with_fair_share``, :func:`run_fair_share` on a 2-node accounting cluster, three
    clusters side by side. About 35 s here.

    Raises:
        QueueError, teraflops.nodes.cluster.ClusterError, teraflops.nodes.slurm.SlurmError: from any of the runs.
    """
    tasks = {s: (3, SlurmConfig(scheduler=s, accounting=True), lambda sl: run_mix(sl, mix, timeout))
             for s in ("fifo", "backfill")}  # accounting: starts and ends from sacct
    if with_fair_share:
        tasks["fair share"] = (2, SlurmConfig(accounting=True), lambda sl: run_fair_share(sl, timeout=timeout))
    out = _concurrently(tasks, "Slurm: FIFO, backfill" + (", fair share" if with_fair_share else ""))
    return LectureRuns((out["fifo"], out["backfill"]), out.get("fair share"))


def head_job(result: SimResult, tolerance: float = 1.5) -> Job | None:
    """The first job in submission order that had to wait (started more than ``tolerance`` s after the
    first start of all), or None."""
    first = min(r.start for r in result.runs)  # on Slurm the first pass itself takes a moment
    waited = [r for r in sorted(result.runs, key=lambda r: (r.job.submit, r.job.id)) if r.start > first + tolerance]
    return waited[0].job if waited else None


def jumped_head(result: SimResult, tolerance: float = 1.5) -> list[int]:
    """Jobs submitted after the head job (:func:`head_job`) that started before it: what backfill does
    and FIFO must not."""
    head = head_job(result, tolerance)
    if head is None:
        return []
    start = result.run(head.id).start
    return [r.job.id for r in result.runs if r.job.id > head.id and r.start < start - tolerance]


def handovers(result: SimResult, tolerance: float = 1.5) -> list[float]:
    """Seconds from the end that freed a job's GPUs to that job's start, for every job that waited
    (started more than ``tolerance`` s after the first start): the scheduler's hand-over time. The
    freeing end is the latest end before the start on one of the job's GPUs."""
    first = min(r.start for r in result.runs)
    gaps = []
    for r in result.runs:
        if r.start <= first + tolerance:
            continue
        ends = [o.end for o in result.runs if o is not r and o.end <= r.start + 1e-9 and set(o.gpus_held) & set(r.gpus_held)]
        if ends:
            gaps.append(r.start - max(ends))
    return gaps


def head_delay(result: SimResult, tolerance: float = 1.5) -> float | None:
    """Seconds the head job (:func:`head_job`) started after the last job ahead of it on its GPUs
    ended: 0 in the simulation, Slurm's hand-over on Slurm, more if a backfilled job held it up.
    None without a head."""
    head = head_job(result, tolerance)
    if head is None:
        return None
    me = result.run(head.id)
    ends = [o.end for o in result.runs if o is not me and o.end <= me.start + 1e-9 and set(o.gpus_held) & set(me.gpus_held)]
    return me.start - max(ends) if ends else None


def differences(run: QueueRun, tolerance: float = 1.5) -> list[str]:
    """Where Slurm and the simulation differ for ``run``, one line each, with the reason.

    Always: Slurm's starts lag the simulation's (measured: mean and largest lag, and the hand-overs
    of :func:`handovers`). Then the start order, if it differs, and each job whose nodes differ.
    """
    lags = [r.start - run.simulated.run(r.job.id).start for r in run.result.runs]
    gaps = handovers(run.result)
    lines = [f"Slurm's starts lag the simulation's by {sum(lags) / len(lags):.1f} s on average (at most "
             f"{max(lags):.1f} s): its first pass came {min(r.start for r in run.result.runs):.1f} s after the queue "
             f"opened and each of its {len(gaps)} hand-overs (a job ends, its node reports it, the next scheduling "
             f"pass starts the waiting job) took {sum(gaps) / max(1, len(gaps)):.1f} s on average, where the simulation "
             "hands over instantly; the lag adds up along a chain of jobs."]
    real, sim = start_order(run.result, tolerance), start_order(run.simulated, tolerance)
    if real != sim:
        lines.append(f"start order differs: Slurm {real}, simulation {sim}. Slurm's backfill protects every "
                     "higher-priority job it cannot start (each gets a reservation), EASY backfill only the head, "
                     "and Slurm plans with time limits rounded to minutes.")
    for r in run.result.runs:
        s = run.simulated.run(r.job.id)
        if r.nodes != s.nodes:
            lines.append(f"job {r.job.id} ran on nodes {r.nodes} on Slurm, {s.nodes} in the simulation: Slurm's "
                         "select/cons_tres picks nodes its own way; the simulation places by best fit.")
    return lines


def fair_share_simulated(run: FairShareRun, nodes: int = 2, gpus_per_node: int = 2, runtime_s: float = 2) -> list[str]:
    """The same sequence as :func:`run_fair_share` through :func:`teraflops.orchestration.queue_sim.fair_share`:
    the accounts in the order their contested jobs started in the simulation."""
    every, heavy, light = nodes * gpus_per_node, run.heavy, run.light
    trace = [Job(0, heavy, every, 0.0, runtime_s), Job(1, heavy, every, runtime_s, 3 * runtime_s),
             Job(2, heavy, every, runtime_s + 0.1, runtime_s), Job(3, light, every, runtime_s + 0.2, runtime_s)]
    sim = simulate(trace, fair_share, nodes, gpus_per_node)
    return [r.job.user for r in sorted(sim.runs[2:], key=lambda r: r.start)]


def fair_share_table(run: FairShareRun) -> str:
    """Per account: usage (``sshare`` RawUsage, CPU·s) charged for the history job when it ended and
    in all before the contested jobs ran (the blocker so far added), their fair-share factor
    (``sprio``), the order they were submitted in, and their start (s after the first of them)."""
    first = min(run.starts.values())
    rows = [(a, run.history_usage.get(a, 0.0), run.usage.get(a, 0.0), run.priorities.get(a, float("nan")), i + 1,
             run.starts[a] - first) for i, a in enumerate((run.heavy, run.light))]
    return table(rows, ["account", "usage after history", "usage before", "fair-share factor", "submitted", "start s"])
