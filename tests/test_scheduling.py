"""The queue simulator: hand-checked tiny traces, the course trace's headline properties, errors."""


import pytest

from teraflops.errors import CourseError
from teraflops.orchestration.queue_sim import (ClusterView, Job, backfill, compare, fair_share, fifo, greedy,
    make_trace, plot_timeline, policy_table, simulate, user_table)


def starts(result):
    return {r.job.id: r.start for r in result.runs}


# Two nodes of 8. Job 0 holds node 0 for 10 h; job 1 needs both nodes (the blocked head);
# job 2 is short and small, job 3 small but long.
BLOCKED = [Job(0, "a", 8, 0.0, 10.0), Job(1, "b", 16, 0.0, 1.0), Job(2, "c", 1, 0.0, 2.0), Job(3, "c", 1, 0.0, 20.0)]


def test_fifo_blocks_behind_the_big_job():
    r = simulate(BLOCKED, fifo, nodes=2)
    assert starts(r) == {0: 0.0, 1: 10.0, 2: 11.0, 3: 11.0}
    assert r.head_delays == []
    assert r.idle_with_queue == pytest.approx(8 * 10 / 31)  # node 1 idle for 10 h of a 31 h window


def test_backfill_takes_the_short_job_and_refuses_the_long_one():
    r = simulate(BLOCKED, backfill, nodes=2)
    assert starts(r) == {0: 0.0, 1: 10.0, 2: 0.0, 3: 11.0}  # job 3 would push job 1 from 10 h to 20 h
    assert r.head_delays == []


def test_greedy_delays_the_head_and_the_delay_is_reported():
    r = simulate(BLOCKED, greedy, nodes=2)
    assert starts(r)[1] == 20.0
    (d,) = r.head_delays
    assert (d.job.id, d.head.id, d.before, d.after, d.time) == (3, 1, 10.0, 20.0, 0.0)
    assert str(d) == ("your policy started job 3 (1 GPU, 20.0 h) at t=0.0 h, "
                      "which pushed the head job 1 from t=10.0 h to t=20.0 h")


def test_backfill_allows_a_long_job_on_gpus_the_head_does_not_need():
    # Three nodes: jobs 0 and 1 hold nodes 0 and 1 until 10 h; head job 2 needs two whole nodes and
    # gets nodes 0 and 1 at 10 h, so a long 1-GPU job on node 2 does not delay it.
    trace = [Job(0, "a", 8, 0.0, 10.0), Job(1, "a", 8, 0.0, 10.0), Job(2, "b", 16, 0.0, 1.0), Job(3, "c", 1, 0.0, 50.0)]
    r = simulate(trace, backfill, nodes=3)
    assert starts(r) == {0: 0.0, 1: 0.0, 2: 10.0, 3: 0.0}
    assert r.run(3).nodes == (2,) and r.run(2).nodes == (0, 1)


def test_best_fit_packs_single_gpu_jobs_into_one_node():
    trace = [Job(i, "a", 1, 0.0, 5.0) for i in range(8)] + [Job(8, "b", 8, 0.0, 1.0)]
    r = simulate(trace, fifo)
    assert all(r.run(i).nodes == (0,) for i in range(8))
    assert r.run(8).start == 0.0 and r.run(8).nodes == (1,)
    assert sorted(g for i in range(8) for g in r.run(i).gpus_held) == list(range(8))
    # Spread one per node instead (a bad placement) and the 8-GPU job has nowhere to go.
    spread = ClusterView(free=(7,) * 8)
    assert spread.total_free == 56 and not spread.fits(trace[8]) and spread.fits(Job(9, "b", 7, 0.0, 1.0))


def test_fragmentation_is_counted():
    # Jobs 0 and 1 leave 2 free GPUs on each node for 10 h; head job 2 needs 4 on one node.
    trace = [Job(0, "a", 6, 0.0, 10.0), Job(1, "a", 6, 0.0, 10.0), Job(2, "b", 4, 0.0, 1.0)]
    r = simulate(trace, fifo, nodes=2)
    assert r.run(2).start == 10.0
    assert r.stranded_gpus == pytest.approx(4 * 10 / 11)
    assert r.stranded_fraction == pytest.approx(4 * 10 / 11 / 16)
    assert r.utilisation == pytest.approx((2 * 6 * 10 + 4) / (16 * 11))


def test_cluster_view_earliest_start_and_usage():
    big = Job(1, "b", 16, 0.0, 1.0)
    running = [(Job(0, "a", 8, 0.0, 10.0), 10.0, ((0, 8),))]
    v = ClusterView(free=(0, 8), now=2.0, running=running, usage={"a": 16.0})
    assert v.running == ((running[0][0], 10.0),)
    assert v.earliest_start(big) == 10.0
    assert v.earliest_start(Job(2, "c", 8, 0.0, 1.0)) == 2.0
    assert v.earliest_start(big, assuming=[Job(3, "c", 1, 0.0, 30.0)]) == 32.0
    assert v.earliest_start(Job(4, "c", 32, 0.0, 1.0)) == float("inf")
    assert v.usage("a") == 16.0 and v.usage("nobody") == 0.0
    with pytest.raises(CourseError, match="cannot assume"):
        v.fits(big, assuming=[Job(5, "c", 16, 0.0, 1.0)])


def test_fair_share_puts_the_light_user_first():
    # User a has used 8 GPU-hours by 1 h; b has used nothing, so b's later job goes first.
    trace = [Job(0, "a", 8, 0.0, 1.0), Job(1, "a", 8, 1.0, 1.0), Job(2, "b", 8, 1.0, 1.0)]
    r = simulate(trace, fair_share, nodes=1)
    assert starts(r) == {0: 0.0, 1: 2.0, 2: 1.0}
    assert simulate(trace, fifo, nodes=1).run(1).start == 1.0


# --------------------------------------------------------------------------- errors

def test_policy_errors_are_one_line_with_a_hint():
    cases = [(lambda q, c, now: [Job(99, "x", 1, 0.0, 1.0)], "not in the queue"),
             (lambda q, c, now: q[:1] * 2, "twice"),
             (lambda q, c, now: q, "does not fit"),
             (lambda q, c, now: None, "not a list"),
             (lambda q, c, now: [], "waiting forever")]
    for policy, words in cases:
        with pytest.raises(CourseError, match=words) as e:
            simulate(BLOCKED, policy, nodes=2)
        assert "\n" not in str(e.value) and "Hint:" in str(e.value)


def test_impossible_jobs_are_rejected():
    bad = [Job(0, "a", 12, 0.0, 1.0), Job(0, "a", 128, 0.0, 1.0), Job(0, "a", 0, 0.0, 1.0), Job(0, "a", 1, 0.0, -1.0)]
    for job in bad:
        with pytest.raises(ValueError, match="Hint:"):
            simulate([job], fifo)
    with pytest.raises(CourseError, match="unique"):
        simulate([Job(0, "a", 1, 0.0, 1.0)] * 2, fifo)
    with pytest.raises(ValueError, match="empty"):
        simulate([], fifo)


# --------------------------------------------------------------------------- the course trace

@pytest.fixture(scope="module")
def course():
    trace = make_trace()
    rows = compare(trace, {"FIFO": fifo, "backfill": backfill, "fair share": fair_share, "greedy": greedy})
    return trace, {r["policy"]: r for r in rows}


def test_course_trace_shape():
    trace = make_trace()
    assert len(trace) == 300 and [j.id for j in trace] == list(range(300))
    assert {j.gpus for j in trace} <= {1, 2, 4, 8, 16, 32, 64}
    assert sum(j.gpus == 1 for j in trace) > sum(j.gpus >= 16 for j in trace)
    assert all(j.estimate == j.duration for j in trace)
    big = [j for j in trace if j.user == "llm-team"]
    assert min(j.gpus for j in big) >= 8 and len(big) < len(trace) / 4


def test_course_trace_headline(course):
    _, rows = course
    fifo_, bf = rows["FIFO"], rows["backfill"]
    assert bf["utilisation"] > fifo_["utilisation"] + 0.05
    assert bf["mean_wait_h"] < fifo_["mean_wait_h"]
    assert fifo_["head_delays"] == 0 and bf["head_delays"] == 0
    assert rows["greedy"]["head_delays"] > 0
    assert fifo_["stranded_gpus"] > 0 and fifo_["idle_with_queue"] > fifo_["stranded_gpus"]
    fs, bfr = rows["fair share"]["result"], bf["result"]
    assert fs.users["alice"]["mean_wait_h"] < bfr.users["alice"]["mean_wait_h"]
    assert fs.users["llm-team"]["mean_wait_h"] > bfr.users["llm-team"]["mean_wait_h"]
    text = policy_table(list(rows.values()))
    assert "utilisation %" in text and "FIFO" in text
    assert "llm-team" in user_table(fs)


def test_every_job_runs_once_without_overbooking(course):
    trace, rows = course
    for row in rows.values():
        r = row["result"]
        assert sorted(x.job.id for x in r.runs) == [j.id for j in trace]
        events = sorted([(x.start, len(x.gpus_held)) for x in r.runs] + [(x.end, -len(x.gpus_held)) for x in r.runs],
                        key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
        busy = 0
        for _, g in events:
            busy += g
            assert busy <= 64
        assert all(x.start >= x.job.submit for x in r.runs)


def test_deterministic_and_the_policy_asked_only_at_events():
    """What keeps a 300-job simulation to a fraction of a second: the scheduler is an event loop, so the
    policy is consulted at most once per arrival instant and once per job end, never on a clock tick."""
    assert make_trace(seed=3) == make_trace(seed=3) and make_trace(seed=3) != make_trace(seed=4)
    trace = make_trace()
    calls = []

    def counted(queue, view, now):
        calls.append(now)
        return backfill(queue, view, now)

    a = simulate(trace, counted, name="backfill")
    assert 0 < len(calls) <= len({j.submit for j in trace}) + len(trace), len(calls)
    assert calls == sorted(calls)  # simulated time only moves forward
    b = simulate(trace, backfill)
    assert a.runs == b.runs and a.utilisation == b.utilisation


def test_plot_timeline_returns_a_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_timeline(simulate(BLOCKED, backfill, nodes=2))
    assert len(fig.axes) == 3
    plt.close(fig)


def test_holding_back_a_head_that_fits_is_a_head_delay():
    def lazy_head(queue, cluster, now):  # backfills around the head, starts it only when nothing else can
        chosen = [j for j in queue[1:2] if cluster.fits(j)]
        return chosen or [queue[0]]

    trace = [Job(0, "a", 4, 0, 1), Job(1, "b", 4, 0, 1), Job(2, "b", 4, 0, 1)]
    delays = simulate(trace, lazy_head, nodes=1).head_delays
    assert delays and delays[0].job is None and "left the head job 0" in str(delays[0])
