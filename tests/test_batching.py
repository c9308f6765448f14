"""Tests for teraflops.compilation.batching: the dynamic-batching server on hand-checkable cases."""

from __future__ import annotations

import pytest
import torch

from teraflops.compilation import batching as bt
from teraflops.compilation.batching import BatchingError, dynamic_batch_policy, simulate_server


def const(seconds):
    return lambda b: seconds


def test_max_batch_1_latency_is_service_time():
    # one request every 10 ms, service 4 ms: never a queue, so latency == service time exactly
    r = bt.simulate_server(const(0.004), rate=100, max_batch=1, max_wait=0.0, duration=1.0, arrivals="uniform")
    assert r.requests == 100 and set(r.batch_sizes) == {1}
    assert r.p50_s == pytest.approx(0.004) and r.p99_s == pytest.approx(0.004)
    assert r.mean_queue_s == pytest.approx(0.0, abs=1e-12)


def test_deterministic_arrivals_form_full_batches():
    # arrivals every 1 ms; a batch of 4 forms when the 4th arrives (max_wait is long) and takes
    # 1 ms, during which the next request arrives: every batch is full, 25 of them in 100 ms
    r = bt.simulate_server(const(0.001), rate=1000, max_batch=4, max_wait=1.0, duration=0.1, arrivals="uniform")
    assert r.requests == 100
    assert r.batch_sizes == (4,) * 25
    # the first request of each batch waits 3 ms for company, the last 0: latencies 4, 3, 2, 1 ms
    assert sorted(set(round(x * 1e3, 6) for x in r.latencies)) == [1.0, 2.0, 3.0, 4.0]
    assert r.utilisation == pytest.approx(25 * 0.001 / r.makespan_s)


def test_max_wait_bounds_the_queueing_of_a_lone_request():
    r = bt.simulate_server(const(0.002), rate=1, max_batch=8, max_wait=0.005, arrival_times=[0.3])
    assert r.batch_sizes == (1,)
    assert r.latencies[0] == pytest.approx(0.005 + 0.002)
    r0 = bt.simulate_server(const(0.002), rate=1, max_batch=8, max_wait=0.0, arrival_times=[0.3])
    assert r0.latencies[0] == pytest.approx(0.002)


def test_requests_arriving_while_busy_go_together():
    # 0: alone (max_wait 0) runs 0..10 ms; 1, 2, 3 ms arrivals wait and run as one batch of 3
    r = bt.simulate_server(const(0.010), rate=1, max_batch=8, max_wait=0.0, arrival_times=[0, 0.001, 0.002, 0.003])
    assert r.batch_sizes == (1, 3)
    assert r.latencies == pytest.approx((0.010, 0.019, 0.018, 0.017))


def test_throughput_grows_with_max_batch_when_latency_is_sublinear():
    lat = bt.BatchLatency((1, 2, 4, 8, 16), (0.010, 0.011, 0.012, 0.014, 0.018))
    thr = [bt.simulate_server(lat, rate=2000, max_batch=mb, max_wait=0.001, duration=1.0, seed=1).throughput_rps
           for mb in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in zip(thr, thr[1:]))
    assert thr[0] == pytest.approx(100, rel=0.02)  # 1 / 10 ms when saturated
    assert thr[-1] == pytest.approx(16 / 0.018, rel=0.05)


def test_seed_determinism():
    lat = bt.BatchLatency((1, 4), (0.01, 0.02))
    a = bt.simulate_server(lat, rate=150, max_batch=4, max_wait=0.005, duration=2.0, seed=3)
    b = bt.simulate_server(lat, rate=150, max_batch=4, max_wait=0.005, duration=2.0, seed=3)
    c = bt.simulate_server(lat, rate=150, max_batch=4, max_wait=0.005, duration=2.0, seed=4)
    assert a == b and a.latencies != c.latencies


def test_poisson_rate_is_roughly_right():
    r = bt.simulate_server(const(1e-4), rate=200, max_batch=1, max_wait=0.0, duration=20.0, seed=0)
    assert r.requests == pytest.approx(4000, rel=0.05)


def test_latency_interpolation():
    lat = bt.BatchLatency((1, 4, 8), (0.010, 0.016, 0.024))
    assert lat(1) == 0.010 and lat(4) == 0.016
    assert lat(2) == pytest.approx(0.012) and lat(6) == pytest.approx(0.020)
    with pytest.raises(BatchingError, match="outside the measured range"):
        lat(9)
    with pytest.raises(BatchingError, match="start at 1"):
        bt.BatchLatency((2, 4), (0.1, 0.2))
    with pytest.raises(BatchingError, match="> 0"):
        bt.BatchLatency((1, 2), (0.1, 0.0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_batch=0), "max_batch"),
    (dict(max_batch=2.5), "max_batch"),
    (dict(rate=0), "rate"),
    (dict(max_wait=-1), "max_wait"),
    (dict(duration=0), "duration"),
    (dict(arrivals="bursty"), "arrivals"),
    (dict(max_batch=16), "larger than the largest measured"),
    (dict(latency=0.01), "callable"),
])
def test_input_validation(kwargs, match):
    args = dict(latency=bt.BatchLatency((1, 8), (0.01, 0.02)), rate=10, max_batch=4, max_wait=0.01, duration=1.0)
    args.update(kwargs)
    with pytest.raises(BatchingError, match=match) as e:
        bt.simulate_server(**args)
    assert "\n" not in str(e.value)


def test_cost_formula():
    assert bt.cost_per_million_tokens(1000, 3.6) == pytest.approx(1.0)
    # $2/h at 10,000 tokens/s: 36 M tokens per hour -> $0.0556 per million
    assert bt.cost_per_million_tokens(10_000, 2.0) == pytest.approx(2.0 / 36)
    with pytest.raises(BatchingError):
        bt.cost_per_million_tokens(0, 2.0)


def test_sweep_table_and_plot():
    lat = bt.BatchLatency((1, 2, 4), (0.01, 0.011, 0.013))
    rows = bt.sweep(lat, rate=150, max_batches=(1, 4), max_waits=(0.0, 0.005), duration=1.0, tokens_per_request=8,
                    price_per_hour=2.0)
    assert [(r["max_batch"], r["max_wait_s"]) for r in rows] == [(1, 0.0), (1, 0.005), (4, 0.0), (4, 0.005)]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(8 * r["throughput_rps"])
        assert r["cost_per_m"] == pytest.approx(bt.cost_per_million_tokens(r["tokens_per_s"], 2.0))
    text = bt.batching_table(rows)
    assert "p99 ms" in text and "$/M tokens" in text
    import matplotlib

    matplotlib.use("Agg")
    fig = bt.plot_tradeoff(rows)
    assert fig.axes


def test_measure_batch_latency_with_a_callable():
    lat = bt.measure_batch_latency(lambda x: x.sum(), (1, 2), make_input=lambda b: torch.ones(b, 10),
                                   min_run_time=0.01, label="sum")
    assert lat.batch_sizes == (1, 2) and all(s > 0 for s in lat.seconds) and lat.label == "sum"
    assert "time/call" in str(lat)
    with pytest.raises(BatchingError, match="start at 1"):
        bt.measure_batch_latency(lambda x: x, (4, 2))


def test_measure_batch_latency_default_gpt():
    lat = bt.measure_batch_latency(batch_sizes=(1, 2), seq_len=4, min_run_time=0.01)
    assert lat.batch_sizes == (1, 2) and "GPT" in lat.label


def test_policy_drives_the_server_and_bad_answers_are_named():
    lat = lambda b: 0.004 + 0.001 * b  # noqa: E731
    ref = simulate_server(lat, 300.0, 8, 0.01, duration=1.0, seed=2)
    same = simulate_server(lat, 300.0, 8, 0.01, duration=1.0, seed=2, policy=dynamic_batch_policy)
    assert ref.batch_sizes == same.batch_sizes
    for bad, match in [(lambda w, n, mb, mw: 0, "wait forever"), (lambda w, n, mb, mw: len(w) + 1, "between 0"),
                       (lambda w, n, mb, mw: 1.5, "must return an int")]:
        with pytest.raises(BatchingError, match=match):
            simulate_server(lat, 300.0, 8, 0.01, duration=1.0, seed=2, policy=bad)
