"""A slow-link straggler vs a slow-compute one (detection.attribute), and finding the slow link (link_probe).

The tests here use synthetic timings. The real run (three emulated nodes, node 1's link at a tenth of
the others', the pair test and the attribution) is Unit 3's lecture section on links, checked where
CI executes that lecture once: tests/test_unit03_run.py.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from teraflops.orchestration import link_probe as lp
from teraflops.orchestration import stragglers as st
from teraflops.orchestration.detection import TRANSFER_RATIO, Attribution, TimingError, attribute



def timeline(compute, transfer, seed=0):
    """A synchronous run: each step ends when the slowest rank (by ``compute``, ``[steps, ranks]`` s)
    arrives, plus ``transfer`` s; each rank waits from its arrival to the end of the transfer."""
    compute = np.asarray(compute, np.float64)
    steps, ranks = compute.shape
    wait = compute.max(1, keepdims=True) - compute + transfer
    zeros, update = np.zeros_like(compute), np.full_like(compute, 1e-3)
    return st.Timeline("synthetic", st.Injection(), zeros, compute, zeros, wait, update, compute + wait + update,
                       np.ones((steps, ranks), np.int64), np.zeros(steps))


def jittered(steps=12, ranks=4, base=0.05, seed=0):
    return base + np.random.default_rng(seed).uniform(0, 0.004, size=(steps, ranks))


# ---- attribute ---------------------------------------------------------------------------------------


def test_a_slow_compute_rank_is_attributed_to_compute_and_named():
    compute = jittered()
    compute[:, 2] *= 3
    a = attribute(timeline(compute, 0.01), timeline(jittered(seed=1), 0.01))
    assert isinstance(a, Attribution) and a.verdict == "compute" and a.compute_flagged == (2,)
    assert a.busy_z[2] > 3.5 and a.transfer_ratio == pytest.approx(1.0, rel=0.05)
    assert "rank(s) 2" in a.reason and "\n" not in a.reason


def test_a_longer_transfer_with_even_busy_times_is_communication():
    a = attribute(timeline(jittered(), 0.06), timeline(jittered(seed=1), 0.01))
    assert a.verdict == "communication" and a.compute_flagged == ()
    assert a.transfer_ratio == pytest.approx(6.0, rel=0.05) and a.transfer_s == pytest.approx(0.06, rel=0.01)
    assert "6.0x" in a.reason


def test_the_same_job_twice_is_none():
    a = attribute(timeline(jittered(seed=2), 0.011), timeline(jittered(seed=1), 0.01))
    assert a.verdict == "none" and a.compute_flagged == () and a.transfer_ratio < TRANSFER_RATIO


def test_a_slow_rank_wins_over_a_slow_link():
    compute = jittered()
    compute[:, 0] *= 3
    assert attribute(timeline(compute, 0.06), timeline(jittered(seed=1), 0.01)).verdict == "compute"


def test_a_slow_link_outweighs_a_rank_that_stands_out_by_a_few_ms():
    # three ranks sharing two cores: rank 2 busy ~50 % longer on a ~12 ms step; the link adds 100 ms
    compute = jittered(ranks=3, base=0.01)
    compute[:, 2] *= 1.5
    a = attribute(timeline(compute, 0.11), timeline(jittered(ranks=3, base=0.01, seed=1), 0.01))
    assert a.compute_flagged == (2,) and a.verdict == "communication", a.reason
    assert "rank(s) 2 stand out" in a.reason and "grew 11.0x" in a.reason


@pytest.mark.parametrize("make, words", [
    (lambda tl: (SimpleNamespace(sweep=[tl], kinds=[]), tl), "StragglerRun"),  # the run, not a setting
    (lambda tl: (tl, timeline(jittered(ranks=3), 0.01)), "ranks"),  # a baseline of another job
    (lambda tl: (tl, timeline(jittered(), 0.0)), "transfer"),  # no time inside the all-reduce
])
def test_wrong_inputs_are_one_line_with_a_hint(make, words):
    with pytest.raises(TimingError, match=words) as info:
        attribute(*make(timeline(jittered(), 0.01)))
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)


# ---- the link test, on synthetic times -------------------------------------------------------------


def round_trips(rates, nbytes=1 << 20, repeats=5, seed=0):
    """``[repeats, nodes, nodes]`` ping-pong times over links of ``rates`` bytes/s, 2 % jitter."""
    r = np.asarray(rates, np.float64)
    t = 2 * nbytes / np.minimum(r[:, None], r[None, :])
    t = t * np.random.default_rng(seed).uniform(1, 1.02, size=(repeats, len(r), len(r)))
    t[:, np.arange(len(r)), np.arange(len(r))] = np.nan
    return lp.LinkProbe(nbytes, t)


def test_each_node_reads_its_own_link_through_its_fastest_peer():
    res = round_trips([50e6, 5e6, 50e6, 50e6])
    assert res.link_s.shape == (5, 4) and res.best_peer[1] != 1 and 1 not in res.best_peer[[0, 2, 3]]
    assert res.bandwidth == pytest.approx([50e6, 5e6, 50e6, 50e6], rel=0.03)
    assert res.link_median_s == pytest.approx(np.nanmin(res.pair_median_s, axis=1))
    assert lp.flag_slow_links(res) == [1]
    assert "slow link" in lp.probe_table(res) and "yes" in lp.probe_table(res)


def test_even_links_flag_nothing_and_a_node_only_a_bit_slower_is_not_flagged():
    assert lp.flag_slow_links(round_trips([50e6] * 3)) == []
    assert lp.flag_slow_links(round_trips([50e6, 45e6, 50e6])) == []  # 11 % slower: under the ~26 % floor


def test_results_are_placed_by_node_not_by_rank():
    results = [lp.LinkProbeResult(rank=r, world_size=3, backend="gloo", device="cpu", node=n, bytes=8, repeats=1,
                                  times={p: [0.1 * (n + 1) + 0.01 * (pn + 1)] for p, pn in enumerate((2, 0, 1)) if p != r})
               for r, n in enumerate((2, 0, 1))]
    res = lp.from_results(results)
    assert res.pair_s[0, 2, 0] == pytest.approx(0.31) and res.pair_s[0, 0, 1] == pytest.approx(0.12)
    assert np.isnan(res.pair_s[0, 1, 1])


@pytest.mark.parametrize("call", [
    lambda: lp.probe(SimpleNamespace(nodes=2, up_=True)),
    lambda: lp.LinkProbe(1 << 20, np.ones((3, 2, 2))),
    lambda: lp.flag_slow_links(np.ones((3, 3))),
])
def test_fewer_than_three_nodes_or_a_bare_matrix_is_one_line_with_a_hint(call):
    with pytest.raises(lp.LinkProbeError) as info:
        call()
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)
