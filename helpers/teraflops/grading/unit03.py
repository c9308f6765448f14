"""Checks for Unit 3 (Runtime orchestration). Each takes the learner's function and nothing else.

Every check runs the learner's function on cases whose answer the package's reference gives
(:mod:`teraflops.orchestration.stragglers`, :mod:`teraflops.orchestration.detection`, :mod:`teraflops.orchestration.queue_sim`,
:mod:`teraflops.orchestration.ray_elastic`), and, on a
wrong answer, runs the plausible wrong versions too: a mistake is named only when it reproduces
every answer the learner gave.
"""

from __future__ import annotations

import contextlib
import io
import math
import numbers
import os
import re
import shlex
import shutil

import numpy as np

from teraflops.grading.core import exercise, fail, reveal
from teraflops.nodes import cluster as cl
from teraflops.nodes import ray as ray_nodes
from teraflops.nodes import slurm
from teraflops.orchestration import ray_elastic
from teraflops.orchestration.detection import flag_stragglers as reference_flags
from teraflops.orchestration.queue_sim import Job, fifo, make_trace, simulate
from teraflops.orchestration.checkpoint import best_interval, overhead
from teraflops.orchestration.slurm_queue import parse_jobs
from teraflops.orchestration.stragglers import idle_fraction as reference_idle


def _array(what: str, got, shape: tuple) -> np.ndarray:
    try:
        x = np.asarray(got.detach().cpu() if hasattr(got, "detach") else got, dtype=np.float64)
    except (TypeError, ValueError):
        fail(f"{what} should return numbers (a NumPy array or list), got {type(got).__name__}")
    if x.ndim == 0:
        fail(f"{what} returned one number, expected {shape[0]}: one value per rank. Hint: sum over the steps "
             "only (axis=0), keeping the ranks apart")
    if x.shape != shape:
        fail(f"{what} returned shape {x.shape}, expected {shape}: one value per rank. "
             "Hint: reduce over the steps (axis 0), not the ranks")
    return x


def _named_mistake(answers, mistakes, same) -> str | None:
    """The hint of the first wrong version that reproduces every learner answer, else None."""
    for wrong, hint in mistakes:
        try:
            if all(same(got, wrong(*case)) for got, _, case in answers):
                return hint
        except Exception:  # noqa: BLE001 - a wrong version may fail on a case; then it is not the mistake
            continue
    return None


# --- exercise 1: idle fraction from a per-rank timeline ------------------------------------------


def _timelines():
    """Per-step (step_s, wait_s) matrices [steps, ranks]: one straggler, a varying one, no straggler."""
    rng = np.random.default_rng(3)
    cases = []
    for steps, ranks, slow, delay in [(6, 4, 3, 0.1), (10, 8, 5, 0.05), (5, 3, None, 0.0)]:
        busy = 0.04 + rng.uniform(0, 0.01, size=(steps, ranks))
        if slow is not None:
            busy[:, slow] += delay * rng.uniform(0.2, 2.0, size=steps)  # varying delay: step times vary
        # everyone leaves together; a rank's step starts when it left the previous one (a few ms apart)
        step = busy.max(axis=1, keepdims=True) + 0.002 + rng.uniform(0, 0.004, size=(steps, ranks))
        cases.append((step, step - busy))
    return cases


@exercise(1, "idle fraction from a per-rank timeline")
def idle_fraction(fn) -> None:
    """``fn(step_s, wait_s) -> [ranks]``: per rank, seconds spent waiting in the collective over
    seconds of all steps (arrays ``[steps, ranks]``, seconds)."""
    answers = []
    for step, wait in _timelines():
        got = _array("idle_fraction", fn(step.copy(), wait.copy()), (step.shape[1],))
        answers.append((got, reference_idle(step, wait), (step, wait)))
    wrong = [a for a in answers if not np.allclose(a[0], a[1], rtol=1e-6, atol=1e-9)]
    if not wrong:
        return
    mistakes = [
        (lambda s, w: (w / s).mean(axis=0), "a long step weighs more than a short one: divide the total wait by "
                                             "the total step time, not the average of per-step ratios"),
        (lambda s, w: 1 - w.sum(0) / s.sum(0), "that is the busy fraction; idle = time waiting / time"),
        (lambda s, w: 100 * w.sum(0) / s.sum(0), "return a fraction between 0 and 1, not a percentage"),
        (lambda s, w: w.sum(0) / (s - w).sum(0), "divide by the step time, not the busy time"),
    ]
    got, want, (step, _) = wrong[0]
    hint = _named_mistake(answers, mistakes, lambda g, x: np.allclose(g, x, rtol=1e-6)) or reveal(
        "your fractions are none of the usual mistakes; check what you sum and what you divide by",
        "idle fraction of rank r = sum over steps of wait_s[:, r] / sum of step_s[:, r]")
    fail(f"on a {step.shape[0]}-step, {step.shape[1]}-rank timeline: got {np.round(got, 3).tolist()}, expected "
         f"{np.round(want, 3).tolist()}. Hint: {hint}")


# --- exercise 2: the straggler detector -----------------------------------------------------------


def _detector_cases():
    rng = np.random.default_rng(7)

    def jitter(steps, ranks, spread=0.003):
        return 0.04 + rng.uniform(0, spread, size=(steps, ranks))

    one = jitter(8, 4)
    one[:, 3] += 0.05
    two = jitter(8, 8)
    two[:, [1, 6]] += 0.08
    bursty = jitter(12, 4)
    bursty[::3, 0] += 0.12
    fast = jitter(8, 4)
    fast[:, 2] -= 0.03  # a faster rank is not a straggler
    spread = np.tile([1.0, 1.2, 0.8, 1.1, 0.9, 1.15, 0.85, 1.63], (6, 1)) * 0.04  # last: 4.2 MADs, z = 2.8
    spike = jitter(12, 4)
    spike[5, 1] += 0.02  # one slow step: 4 % on the mean, not a straggler
    equal = np.full((5, 4), 0.04)  # MAD = 0
    close = np.full((5, 4), 0.04) + [0, 1e-4, 0, 4e-4]  # rank 3 is 1 % slower: MAD ~ 0 makes that an outlier
    quiet = jitter(8, 6, spread=0.006)
    # three equal ranks and one 30 % slower: the median is 1 and the MAD 0 (floored at 5 %), so z = 4.05; a
    # detector centred on the mean (1.075) measures the straggler against itself and finds z = 2.0
    pulled = np.tile([1.0, 1.0, 1.0, 1.3], (5, 1)) * 0.04
    return [("three equal ranks, one 30 % slower", pulled), ("one rank 50 ms slower", one), ("two of eight ranks slow", two), ("rank 0 slow every third step", bursty),
            ("one rank faster than the rest", fast), ("identical ranks", equal), ("ranks within 1 %", close), ("jitter only", quiet),
            ("a rank 4 MADs above the median (z < 3.5)", spread), ("one slow step on rank 1", spike)]


def _mean_std(busy):
    m = busy.mean(axis=0)
    sd = m.std(ddof=1)
    return [] if sd == 0 else [int(r) for r in np.flatnonzero((m - m.mean()) / sd > 3.5)]


def _two_sided(busy):
    m = busy.mean(axis=0)
    med = np.median(m)
    mad = max(np.median(np.abs(m - med)), 0.05 * med)
    return [int(r) for r in np.flatnonzero(np.abs(0.6745 * (m - med) / mad) > 3.5)]


def _mean_centred(busy, floor=0.01):
    m = busy.mean(axis=0)
    centre = m.mean()
    mad = max(np.median(np.abs(m - centre)), floor * centre)
    return [int(r) for r in np.flatnonzero(0.6745 * (m - centre) / mad > 3.5)]


_MEAN_CENTRED = ("centre on the median, not the mean: a straggler pulls the mean (and the spread measured from it) "
                 "towards itself, so on [1, 1, 1, 1.3] it hides; use the median and the MAD")


def _no_floor(busy):
    m = busy.mean(axis=0)
    med = np.median(m)
    mad = np.median(np.abs(m - med))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = 0.6745 * (m - med) / mad
    return [int(r) for r in np.flatnonzero(np.nan_to_num(z, nan=0.0) > 3.5)]


def _z_scaled(busy, scale):
    m = busy.mean(axis=0)
    med = np.median(m)
    mad = max(np.median(np.abs(m - med)), 0.05 * med)
    return [int(r) for r in np.flatnonzero(scale * (m - med) / mad > 3.5)]


def _no_scale(busy):
    return _z_scaled(busy, 1.0)


def _inverse_scale(busy):
    return _z_scaled(busy, 1 / 0.6745)


def _any_step(busy):
    return sorted({r for row in busy for r in reference_flags(row)})


@exercise(2, "straggler detector (median / MAD)")
def straggler_detector(fn) -> None:
    """``fn(busy_s) -> list of ranks``: modified z-score 0.6745 (x − median) / max(MAD, 5 % of median)
    of each rank's mean busy time, flagged above 3.5 (Iglewicz & Hoaglin 1993)."""
    cases = _detector_cases()
    answers = []
    for name, busy in cases:
        got = fn(busy.copy())
        if np.asarray(got).dtype == bool or (len(np.shape(got)) == 1 and len(got) == busy.shape[1]
                                             and set(np.asarray(got).tolist()) <= {0, 1} and name.startswith("one rank 50")):
            fail(f"on '{name}': got {np.asarray(got).tolist()}, a mask. Hint: return the rank numbers, e.g. [3]")
        try:
            got = sorted(int(r) for r in (got.tolist() if hasattr(got, "tolist") else got))
        except (TypeError, ValueError):
            fail(f"flag_stragglers should return a list of rank numbers, got {type(got).__name__}")
        answers.append((got, reference_flags(busy), (busy,)))
    wrong = [(a, name) for a, (name, _) in zip(answers, cases) if a[0] != a[1]]
    if not wrong:
        return
    mistakes = [
        (_mean_centred, _MEAN_CENTRED),
        (lambda busy: _mean_centred(busy, 0.05), _MEAN_CENTRED),
        (_mean_std, "your detector flags nobody, even a rank 50 ms slower: with mean and standard deviation the "
                    "straggler inflates the spread it is measured against (z <= (n-1)/sqrt(n)); use the median and the MAD"),
        (_no_floor, "when the ranks agree, the MAD is ~0 and any jitter looks infinite: floor the MAD at 5 % of "
                    "the median"),
        (_two_sided, "only slow ranks are stragglers: flag z > 3.5, not |z| > 3.5"),
        (_no_scale, "multiply by 0.6745: it puts the MAD on the scale of a standard deviation"),
        (_inverse_scale, "multiply by 0.6745, do not divide by it"),
        (_any_step, "average each rank's busy time over the steps first: one slow step is not a straggler"),
    ]
    (got, want, _), name = wrong[0]
    hint = _named_mistake(answers, mistakes, lambda g, x: sorted(g) == sorted(x)) or reveal(
        "your detector is none of the usual mistakes; compare it step by step with the exercise text on this case",
        "per rank: the mean busy time over steps; z = 0.6745 (x - median) / max(MAD, 0.05 * median); flag z > 3.5")
    fail(f"on '{name}': flagged {got}, expected {want}. Hint: {hint}")


# --- exercise 3: micro-batch rebalancing ------------------------------------------------------------


@exercise(3, "micro-batch rebalancing by measured speed")
def rebalance(fn) -> None:
    """``fn(speeds, global_batch) -> list[int]``: micro-batch sizes proportional to each rank's
    speed (samples/s), integers that sum to ``global_batch``, each at least 1 and within one sample
    of its exact share."""
    cases = [([100.0, 100.0, 100.0, 50.0], 16), ([10.0, 20.0, 30.0, 40.0], 20), ([1.0, 1.0, 1.0], 7),
             ([300.0, 100.0], 9), ([5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 0.5], 64), ([100.0, 100.0, 100.0, 1.0], 8)]
    for speeds, batch in cases:
        got = fn(list(speeds), batch)
        try:
            got = list(got)
            sizes = [int(b) for b in got]
        except (TypeError, ValueError):
            fail(f"rebalance should return a list of integers, got {type(got).__name__}")
        if not all(isinstance(b, (numbers.Real, np.number)) and not isinstance(b, bool) for b in got):
            fail(f"rebalance should return a list of integers, got {got!r}")
        where = f"for speeds {speeds} and global batch {batch}: got {list(got)}"
        if any(float(b) != int(b) for b in got):
            fail(f"{where}. Hint: a micro-batch is a whole number of samples; round, then fix the sum")
        if len(sizes) != len(speeds):
            fail(f"{where}. Hint: return one size per rank")
        if any(sizes[i] < sizes[j] for i in range(len(speeds)) for j in range(len(speeds)) if speeds[i] > speeds[j]):
            fail(f"{where}. Hint: a faster rank should get more samples: sizes proportional to speed, not to time")
        share = np.asarray(speeds) / sum(speeds) * batch
        if sum(sizes) != batch:
            fail(f"{where}, which sums to {sum(sizes)}. Hint: the global batch must not change (the update would); "
                 "floor the shares, then hand the leftover samples to the largest remainders")
        if min(sizes) < 1:
            fail(f"{where}. Hint: every rank needs at least one sample, or it has no gradient to contribute; "
                 "raise it to 1 and take the sample from the largest micro-batch")
        if np.any(np.abs(np.asarray(sizes) - np.maximum(share, 1)) >= 1):
            fail(f"{where}; exact shares {np.round(share, 2).tolist()}. Hint: each size should be within one "
                 "sample of global_batch * speed / sum(speeds)")


# --- exercise 4: a backfill policy ------------------------------------------------------------------


@exercise(4, "backfill scheduling policy")
def backfill_policy(fn) -> None:
    """``fn(queue, cluster, now) -> list of jobs to start``, on the course trace: a utilisation
    above FIFO's and the head job never pushed later (no ``head_delays``)."""
    trap = simulate(_trap_trace(), fn, nodes=4)
    if trap.head_delays:
        _fail_delay(trap.head_delays[0], "on a 4-node trace: ", "test each candidate together with the jobs you "
                    "already chose: earliest_start(head, assuming=[*chosen, candidate])")
    trace = make_trace()
    base, mine = simulate(trace, fifo), simulate(trace, fn)
    if mine.head_delays:
        _fail_delay(mine.head_delays[0], "", "backfill a job only if starting it now leaves the head job's earliest "
                    "start where it was: cluster.earliest_start(head, assuming=[...jobs you start...])")
    if mine.utilisation <= base.utilisation + 1e-9:
        fail(f"utilisation {mine.utilisation:.1%} is not above FIFO's {base.utilisation:.1%}. Hint: after the jobs "
             "that start in order, start later jobs that fit now and do not delay the head (not later: <=)")


def _fail_delay(delay, where: str, hint: str):
    if delay.job is None:
        hint = "start jobs in queue order while they fit, the head first; backfill only behind a head that does not fit"
    fail(f"{where}{delay}. Hint: {hint}")


def _trap_trace() -> list[Job]:
    """Two whole-node jobs run to 5 h; a 3-node head waits for them; two 1-node, 20-h jobs arrive together.
    Either alone leaves the head a free node at 5 h; both together push it to 20.1 h."""
    return [Job(0, "a", 8, 0.0, 5.0), Job(1, "a", 8, 0.0, 5.0), Job(2, "b", 24, 0.05, 2.0),
            Job(3, "c", 8, 0.1, 20.0), Job(4, "c", 8, 0.1, 20.0)]


# --- exercise 5: a two-node batch script, submitted to a real Slurm cluster ------------------------

_SBATCH = re.compile(r"^#SBATCH\s+(.*)$")
_REPORT = "#!/bin/sh\necho \"$(hostname) gpus=${CUDA_VISIBLE_DEVICES:-none}\"\n"


def _seconds(limit: str) -> int | None:
    """A Slurm time limit (sbatch(1) ``--time``: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not m:
        return None
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-H[:M[:S]]
        return ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a * 60 + b) * 60 + c
    return a * 60 + (b or 0)  # M or M:S


def _options(script: str) -> dict[str, str]:
    """The ``#SBATCH`` options sbatch reads (those before the first command), long names."""
    short = {"-N": "--nodes", "-t": "--time", "-n": "--ntasks", "-G": "--gpus"}
    out = {}
    for line in script.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        m = _SBATCH.match(s)
        if not m:
            continue
        tokens = shlex.split(m.group(1), comments=True)
        i = 0
        while i < len(tokens):
            tok, value = tokens[i], ""
            if tok.startswith("--") and "=" in tok:
                tok, value = tok.split("=", 1)
            elif tok.startswith("-") and not tok.startswith("--") and len(tok) > 2:
                tok, value = tok[:2], tok[2:]
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                value, i = tokens[i + 1], i + 1
            out[short.get(tok, tok)] = value
            i += 1
    return out


def _read_script(script) -> dict[str, str]:
    if not isinstance(script, str):
        fail(f"batch_script should return the script as a str, got {type(script).__name__}")
    if not script.startswith("#!"):
        fail("the script does not start with a shebang line: sbatch accepts only scripts that do. "
             "Hint: begin with #!/bin/bash")
    body = script.splitlines()[1:]
    first_cmd = next((i for i, x in enumerate(body) if x.strip() and not x.strip().startswith("#")), len(body))
    late = [x.strip() for x in body[first_cmd:] if _SBATCH.match(x.strip())]
    if late:
        fail(f"sbatch stops reading #SBATCH lines at the first command, so {late[0]!r} is ignored. "
             "Hint: put every #SBATCH line right after the #! line, before any command")
    return _options(script)


def _static(script: str, opts: dict[str, str], command: str) -> None:
    """What reading the script can tell (everything when no Slurm is at hand)."""
    if opts.get("--nodes") not in ("2", "2-2"):
        fail(f"the job asks for {opts.get('--nodes') or 'no'} --nodes: it must have two. Hint: #SBATCH --nodes=2")
    gpus = opts.get("--gres") or (f"gpu:{opts['--gpus-per-node']}" if "--gpus-per-node" in opts else None)
    if gpus not in ("gpu:1",):
        fail(f"the job asks for {gpus or 'no GPUs'} per node, not one. Hint: #SBATCH --gres=gpu:1 (per node)")
    limit = _seconds(opts.get("--time", "")) if "--time" in opts else None
    if limit != 60:
        fail(f"the time limit is {opts.get('--time') or 'not set'}, not 1 minute (Slurm kills a job at its limit; "
             "backfill plans with it). Hint: #SBATCH --time=1 (minutes) or --time=0:01:00")
    if not any(re.search(r"\bsrun\b", x) and command in x for x in script.splitlines()):
        fail("the command is not started with srun: a batch script runs on the first node of the allocation "
             f"only. Hint: a line `srun {command}` starts it once per node (one task per node)")


@exercise(5, "a two-node batch script")
def batch_script(fn) -> None:
    """``fn(command) -> str``: an sbatch script that runs ``command`` once on each of 2 nodes with one
    GPU per node and a 1-minute limit. Read first, then submitted to a real 2-node Slurm cluster on
    emulated nodes (:mod:`teraflops.nodes.slurm`) where this machine can host one; where it cannot, the
    check says why and grades the script's text only."""
    import tempfile
    from pathlib import Path

    work = Path(tempfile.mkdtemp(prefix="teraflops-lab3-"))
    try:
        _submit_and_check(fn, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _submit_and_check(fn, work) -> None:
    """The learner's script for a command that reports each node's GPUs, read; then, where a Slurm
    cluster can run here, submitted to one and judged on what ran, then read to the letter."""
    report = work / "report.sh"
    report.write_text(_REPORT)
    report.chmod(0o755)
    command = str(report)
    script = fn(command)
    opts = _read_script(script)
    why = cl.unavailable() or slurm.unavailable()
    if why:
        _static(script, opts, command)
        print(f"(read, not submitted: {why})")
        return
    (work / "job.sh").write_text(script)
    with cl.Cluster(2, name=f"lab3{os.getpid() % 100000}", slurm=True) as nodes:
        state, info = _run_job(nodes.slurm_, work)
    output = (work / "out.txt").read_text(errors="replace") if (work / "out.txt").exists() else ""
    _judge_job(state, info, output, command)
    _static(script, opts, command)  # what ran right may still differ from the letter of the exercise


def _run_job(s, work) -> tuple[str | None, str]:
    """Submit ``work/job.sh`` with sbatch and wait (60 s at most) for it to end; its final state and
    ``scontrol show job``'s line."""
    import time

    done = s.exec(["sbatch", "--parsable", f"--output={work}/out.txt", str(work / "job.sh")])
    if done.returncode != 0:
        fail(f"sbatch refused the script: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    job = int(done.stdout.strip().split(";")[0])
    deadline = time.monotonic() + 60
    while True:
        rec = parse_jobs(s.exec(["scontrol", "-d", "-o", "show", "job", str(job)]).stdout).get(job, {})
        if rec.get("state") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if time.monotonic() > deadline:
            s.exec(["scancel", str(job)])
            fail("the job did not finish within 60 s. Hint: `squeue` shows why it waits (the cluster has 2 nodes "
                 "of 2 CPUs and 2 GPUs; ask for no more)")
        time.sleep(0.3)
    return rec.get("state"), s.exec(["scontrol", "-o", "show", "job", str(job)]).stdout


def _judge_job(state: str | None, info: str, output: str, command: str) -> None:
    """What the job did: completed, on 2 nodes, the command once on each with one GPU, a 1-minute limit."""
    lines = [x.split() for x in output.splitlines() if re.match(r"node\d+ gpus=", x)]
    if state != "COMPLETED":
        last = output.strip().splitlines()[-1] if output.strip() else "no output"
        fail(f"the job ended {state}: {last}")
    fields = dict(re.findall(r"(\w+)=(\S*)", info))
    if fields.get("NumNodes") != "2":
        fail(f"the job got {fields.get('NumNodes')} node(s), not 2. Hint: #SBATCH --nodes=2")
    hosts = sorted(x[0] for x in lines)
    if hosts != ["node0", "node1"]:
        if len(hosts) == 1:
            fail(f"the command ran once, on {hosts[0]} only: a batch script runs on the first node of the allocation. "
                 f"Hint: start it on every node with `srun {command}`")
        fail(f"the command ran on {hosts or 'no node'}, not once on each of node0 and node1. Hint: one task per node: "
             "#SBATCH --ntasks-per-node=1 and `srun <command>`")
    per_node = {x[0]: x[1].split("=", 1)[1] for x in lines}
    if any(g == "none" or "," in g for g in per_node.values()):
        fail(f"GPUs per node: {per_node}, not one each. Hint: #SBATCH --gres=gpu:1 asks for one GPU on every node")
    if fields.get("TimeLimit") != "00:01:00":
        fail(f"the job's time limit is {fields.get('TimeLimit')}, not 1 minute. Hint: #SBATCH --time=1")


# --- exercise 6: the checkpoint interval, given measured recovery times ------------------------------

_INTERVAL_CASES = [  # (step_s, checkpoint_s, mtbf_s, recovery_s): the lecture's scale, then a large job's
    (0.25, 0.5, 600.0, 20.0), (0.25, 0.05, 120.0, 45.0), (2.0, 60.0, 10_800.0, 300.0), (1.0, 30.0, 3_600.0, 0.0),
    (0.5, 2.0, 40.0, 10.0), (10.0, 0.01, 3_600.0, 60.0),
]
_INTERVAL_MISTAKES = [
    (lambda t, c, m, r: math.sqrt(2 * c * m), "that is the interval in seconds; the function returns steps: divide "
     "by the step time"),
    (lambda t, c, m, r: round(math.sqrt(c * m) / t), "the factor 2 is missing: a failure costs half an interval on "
     "average, so the optimum is sqrt(2·C·M), not sqrt(C·M)"),
    (lambda t, c, m, r: round(math.sqrt(2 * (c + r) * m) / t), "the restart time is paid once per failure whatever "
     "the interval: it does not move the optimum; only the checkpoint's cost does"),
    (lambda t, c, m, r: round(math.sqrt(2 * m / c) / t), "checkpoint cost and MTBF are the wrong way round: a dearer "
     "checkpoint should make the interval longer"),
    (lambda t, c, m, r: 1, "a checkpoint every step pays the checkpoint's cost every step to save at most one step "
     "per failure"),
    (lambda t, c, m, r: _NEVER, "never checkpointing (an interval longer than any run) redoes everything since the "
     "start at every failure"),
]
_NEVER = 10**6  # steps: an interval at least this long never checkpoints a run of this course
# The real run: the learner's interval on Ray Train, one node killed once. Its case is scaled so that the best
# interval (5 steps: sqrt(2·0.05·15) = 1.2 s of 0.25 s steps) falls well inside a 30-step run.
LIVE_CASE = (0.25, 0.05, 15.0, 30.0)  # step_s, checkpoint_s, mtbf_s, recovery_s
LIVE_STEPS, LIVE_KILL = 30, 17
last_run: dict = {}  # the last real run's measurements (what the lab's next cell prints; the check prints none)


@exercise(6, "checkpoint interval from measured recovery times")
def checkpoint_interval(fn) -> None:
    """``fn(step_s, checkpoint_s, mtbf_s, recovery_s) -> int``: the steps between checkpoints that
    minimise the expected time lost (:func:`teraflops.orchestration.checkpoint.overhead`), checked against
    :func:`~teraflops.orchestration.checkpoint.best_interval`; an answer whose overhead is within 0.1 % of the
    best one's also passes."""
    answers = []
    for case in _INTERVAL_CASES:
        got = fn(*case)
        if isinstance(got, bool) or not isinstance(got, (numbers.Integral, np.integer)):
            if isinstance(got, numbers.Real) and float(got) != int(got):
                fail(f"for step {case[0]} s, checkpoint {case[1]} s, MTBF {case[2]:g} s, restart {case[3]} s: got "
                     f"{got!r}. Hint: a checkpoint is taken after a whole number of steps; round to the better "
                     "neighbour (compare the overhead of floor and ceil)")
            if not isinstance(got, numbers.Real):
                fail(f"checkpoint_interval should return an int (steps), got {type(got).__name__}")
        answers.append((int(got), None, case))
    measured = _live_run(int(fn(*LIVE_CASE))) if all(got >= 1 for got, _, _ in answers) else ""
    for got, _, case in answers:
        best = best_interval(*case)
        if got < 1 or overhead(got, *case) > overhead(best, *case) * 1.001:
            mistake = _named_mistake(answers, _INTERVAL_MISTAKES,
                                     lambda a, b: abs(a - b) <= 1 or min(a, b) >= _NEVER)
            if mistake and measured:
                mistake += f" (measured on Ray: {measured})"
            where = (f"for step {case[0]} s, checkpoint {case[1]} s, MTBF {case[2]:g} s, restart {case[3]} s: got "
                     f"{got} steps (expected time lost {100 * overhead(max(got, 1), *case):.2f} %), the best is {best} "
                     f"({100 * overhead(best, *case):.2f} %)")
            fail(f"{where}. Hint: " + (mistake or reveal(
                "minimise C/(k·T) + (R + k·T/2)/M over whole k ≥ 1",
                "Young's optimum is k·T = sqrt(2·C·M): k = sqrt(2·C·M) / T, rounded to the better neighbour")))


def _live_run(k: int) -> str:
    """Train on Ray with a checkpoint every ``k`` steps (:data:`LIVE_CASE`'s run: :data:`LIVE_STEPS` steps, a
    node killed after :data:`LIVE_KILL`; :func:`teraflops.orchestration.ray_elastic.run` without the regrow)
    and check that it resumed where the interval says; the measured cost in one line (also in
    :data:`last_run`), or "" where this machine cannot run Ray on emulated nodes (the formula's verdict stands
    alone, and ``last_run["skipped"]`` says why)."""
    last_run.clear()
    why = cl.unavailable() or ray_nodes.unavailable()
    if why:
        last_run["skipped"] = why
        return ""
    notes = io.StringIO()
    with contextlib.redirect_stdout(notes):  # Ray's slow-start notes: a checked cell shows only the verdict
        r = ray_elastic.run(steps=LIVE_STEPS, checkpoint_every=k, kill_step=LIVE_KILL, rejoin_after=None,
                            step_s=LIVE_CASE[0])
    m = ray_elastic.measured_cost(r)
    last_run.update(m, k=k, notes=notes.getvalue().splitlines())
    # Ray resumes from the last checkpoint its controller had *registered*, which can trail the last one written
    # by a step or two when checkpoints come every step (measured: k = 1, killed after step 17, resumed from 15)
    if m["resumed_from"] is None or m["resumed_from"] % k or m["resumed_from"] > m["predicted_resume"]:
        fail(f"with a checkpoint every {k} steps the run resumed from step {m['resumed_from']}, not a checkpoint of "
             f"your interval at or before {m['predicted_resume']} (the last multiple of {k} up to step "
             f"{m['last_before_kill']}, the last step before the kill). Hint: return the interval in steps")
    return (f"{m['checkpoints']} checkpoints cost {m['checkpoint_total_s']:.1f} s ({1e3 * m['checkpoint_s']:.0f} ms "
            f"each); the kill after step {m['last_before_kill']} redid {m['steps_redone']} steps "
            f"({m['redo_s']:.1f} s)")
