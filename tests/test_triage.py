"""teraflops.triage.verdict: each unit's workload gets its unit's verdict; bad traces are one-line errors.

Verdicts are asserted on recorded traces only (tests/data/triage, recorded on the quiet CPU machine
with the workloads' own code, their ceilings and launch floor beside them in ``recorded.json``) or on
synthetic ones, against ceilings given as numbers: what a step's time splits into depends on the load
while it ran, so a verdict computed from live timings here would test the machine, not the code. Live
runs (Units 1 and 4, one gloo process) assert what does not depend on timing: the trace read, the shares'
invariants, the exact FLOPs and bytes and the category each operator gets from them.

Units 3 and 5 need several ranks, which these tests do not launch: their traces are synthetic, built as
torch 2.x writes a gloo DDP step (checked against a real single-process gloo trace in
``test_real_gloo_all_reduce_is_communication``, and the recorded rank traces in tests/test_rank_traces.py):
the main thread enqueues ``c10d::allreduce_`` (a TensorList argument) and then waits with no operator
running, while gloo's worker thread holds a ``gloo:all_reduce`` range (``cat == "user_annotation"``) for the transfer.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from teraflops.course import cli
from teraflops.model_definition import attention
from teraflops.triage import verdict as tr
from teraflops.ceilings import SPREAD_LIMIT, Ceilings
from teraflops.models import Llama

MiB = 2**20
NOMINAL = Ceilings(1e11, 1e10, torch.float32, "cpu", 0, 0)  # a CPU-like machine: ridge 10 FLOP/byte
FLOOR = 5e-6
DATA = Path(__file__).parent / "data" / "triage"
RECORDED = json.loads((DATA / "recorded.json").read_text())
# the recording's ceilings as numbers (peak FLOP/s, bytes/s) and its launch floor (s)
AT_RECORDING = Ceilings(RECORDED["ceilings"]["peak_flops"], RECORDED["ceilings"]["bandwidth"], torch.float32, "cpu",
                        0, 0, source="recorded")
RECORDED_FLOOR = RECORDED["launch_floor"]


def recorded(name: str, ceilings: Ceilings = AT_RECORDING, launch_floor: float = RECORDED_FLOOR, **kw) -> tr.Triage:
    """The triage of workload ``name``'s recorded trace (with its recorded waits)."""
    w = RECORDED["workloads"][name]
    return tr.triage(DATA / w["trace"], waits=w["waits"], ceilings=ceilings, launch_floor=launch_floor, **kw)


def _check_shape(r: tr.Triage):
    assert set(r.shares) == set(tr.CATEGORIES) and abs(sum(r.shares.values()) - 1) < 1e-9
    assert all(v >= 0 for v in r.shares.values()) and r.step_s > 0
    assert r.verdict == tr.VERDICTS[max(r.shares, key=r.shares.get)]
    assert r.evidence and r.evidence == tuple(sorted(r.evidence, key=lambda e: -e.seconds))
    assert r.verdict in r.summary() and "Act on: " + r.act_on in r.summary() and "of roof" in r.table()
    for e in r.evidence:  # a compute or memory row has an intensity and a fraction of its roof
        assert e.category not in ("compute", "memory") or (e.nbytes > 0 and e.intensity >= 0 and e.of_roof > 0)


# ---- the units' workloads, recorded ----------------------------------------------------------------

@pytest.mark.parametrize("name", list(RECORDED["workloads"]))
def test_the_trimmed_recordings_read_as_the_full_traces_did(name):
    """The fixtures keep what triage reads (tests/data/triage/README.md): the verdict and shares of each
    trimmed trace are those the full trace got when it was recorded, at the same ceilings."""
    r = recorded(name)
    _check_shape(r)
    assert r.verdict == RECORDED["workloads"][name]["verdict"]
    assert r.shares == pytest.approx(RECORDED["workloads"][name]["shares"], abs=1e-3)


def test_unit1_recorded_matmul_is_compute_bound_and_each_boundary_moves_it():
    r = recorded("matmul")
    assert r.verdict == "compute-bound" and r.act_on.startswith("Unit 1") and r.note == ""
    mm = r.evidence[0]
    n = round(math.sqrt(mm.nbytes / 12))  # three n × n fp32 matrices
    assert mm.name == "aten::mm" and mm.flops == 2 * n**3 and mm.intensity == pytest.approx(n / 6)
    # the ridge point on each side of the matmul's intensity (FLOP/byte): compute right of it, memory left
    c = AT_RECORDING
    left = replace(c, peak_flops=c.bandwidth * mm.intensity * 1.05)
    right = replace(c, peak_flops=c.bandwidth * mm.intensity * 0.95)
    assert recorded("matmul", left).verdict == "memory-bound"
    assert recorded("matmul", right).verdict == "compute-bound"
    # the launch floor on each side of one call's roofline ideal time: above it every call is overhead
    ideal = max(mm.flops / c.peak_flops, mm.nbytes / c.bandwidth) / mm.calls
    assert recorded("matmul", launch_floor=ideal * 1.05).verdict == "overhead-bound"
    assert recorded("matmul", launch_floor=ideal * 0.95).verdict == "compute-bound"


def test_unit1_recorded_naive_attention_is_memory_bound():
    r = recorded("naive_attention", top=50)
    assert r.verdict == "memory-bound" and "FlashAttention" in r.act_on
    rows = {e.name: e for e in r.evidence}
    assert rows["aten::_softmax"].category == "memory" and rows["aten::_softmax"].intensity == 0
    assert rows["aten::bmm"].flops > 0 and rows["aten::matmul"].flops == 0  # no double count via matmul
    assert 0 < rows["aten::_softmax"].of_roof


def test_unit4_recorded_small_batch_decode_is_overhead_bound():
    r = recorded("decode")
    assert r.verdict == "overhead-bound" and "CUDA graphs" in r.act_on and r.shares["overhead"] > 0.8
    assert sum(e.calls for e in recorded("decode", top=1000).evidence) > 50  # many small ops
    # with a launch floor far below every op's ideal time, nothing is launch-bound but the idle gaps
    assert recorded("decode", launch_floor=1e-15).shares["overhead"] < r.shares["overhead"]


@pytest.mark.parametrize("ceilings, says", [
    (replace(AT_RECORDING, spread=SPREAD_LIMIT - 0.01), ""),
    (replace(AT_RECORDING, spread=SPREAD_LIMIT), "inconclusive: the probe's repeats disagree"),
    (replace(AT_RECORDING, load=6.2), "inconclusive: machine busy (load 6.2)"),
    (replace(AT_RECORDING, of_quiet=0.61), ""),
    (replace(AT_RECORDING, of_quiet=0.59), "inconclusive: the probe read 59% of this machine's quiet figures"),
    (replace(AT_RECORDING, doubt="machine busy (load 5.0)"), "The ceilings are this machine's quiet figures"),
])
def test_a_verdict_on_ceilings_that_are_not_trusted_says_so(ceilings, says):
    r = recorded("matmul", ceilings)
    assert r.verdict == "compute-bound"  # the split stands; the note says what it rests on
    assert (says in r.note) if says else r.note == "", r.note
    assert (says in r.summary()) if says else "inconclusive" not in r.summary()


# ---- the units' workloads, live: what does not depend on the load -----------------------------------

def test_unit1_matmul_live_trace_counts_and_categories(tmp_path):
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    r = tr.triage(tr.record(lambda: a @ b, tmp_path / "mm.json"), ceilings=NOMINAL, launch_floor=FLOOR)
    _check_shape(r)
    mm = next(e for e in r.evidence if e.name == "aten::mm")
    assert mm.flops == 2 * 512**3 and mm.nbytes == 3 * 512**2 * 4 and mm.calls == 1
    assert mm.intensity == pytest.approx(512 / 6) and mm.category == "compute"  # 85 FLOP/byte, right of ridge 10


def test_unit1_naive_attention_live_trace_counts_and_categories(tmp_path):
    d = 8
    q, k, v = (torch.randn(1, 4, 512, d) for _ in range(3))
    r = tr.triage(tr.record(lambda: attention.naive_attention(q, k, v, causal=True), tmp_path / "attn.json"),
                  ceilings=NOMINAL, launch_floor=FLOOR, top=50)
    _check_shape(r)
    rows = {e.name: e for e in r.evidence}
    assert rows["aten::bmm"].flops == 2 * 2 * 4 * 512 * 512 * d  # QKᵀ and PV, no double count via matmul
    assert rows["aten::_softmax"].category == "memory" and rows["aten::_softmax"].intensity == 0
    assert rows["aten::matmul"].flops == 0


def test_unit4_small_batch_decode_live_trace_has_many_small_ops(tmp_path):
    """Unit 4's decode loop (the course's Llama, batch 1): every op moves a few KB, so at the nominal
    ceilings each op's ideal time is under the launch floor: overhead, whatever the load."""
    from teraflops.compilation.decode import generate

    model = Llama(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=32).eval()
    prompt = torch.randint(0, 32, (1, 4))
    r = tr.triage(tr.record(lambda: generate(model, prompt, 8), tmp_path / "decode.json"), ceilings=NOMINAL,
                  launch_floor=FLOOR, top=1000)
    _check_shape(r)
    assert sum(e.calls for e in r.evidence) > 50
    assert {e.category for e in r.evidence if e.flops or e.nbytes} == {"overhead"}


def _ddp_step(allreduce_ms: float, rank: int = 0) -> dict:
    """A synthetic trace of one data-parallel step on CPU with gloo (see the module docstring):
    forward/backward matmuls (~1 ms), ``c10d::allreduce_`` of a 512×512 fp32 gradient bucket on the
    main thread, ``gloo:all_reduce`` for ``allreduce_ms`` on gloo's thread, then the optimizer."""
    pid, main, worker = 4242, 4242, 4250
    f32 = {"Input type": ["float", "float"], "Input Dims": [[32, 512], [512, 512]]}
    ev, t = [], 1000.0

    def op(name, dur, args, tid=main, cat="cpu_op", at=None):
        nonlocal t
        start = t if at is None else at
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": start, "dur": dur, "args": args})
        if at is None:
            t += dur + 3.0  # 3 µs of Python between ops
        return start

    s = op("aten::linear", 320.0, {"Input type": ["float", "float", ""], "Input Dims": [[32, 512], [512, 512], []]})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::t", "pid": pid, "tid": main, "ts": s + 2, "dur": 4.0,
               "args": {"Input type": ["float"], "Input Dims": [[512, 512]]}})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": pid, "tid": main, "ts": s + 8, "dur": 310.0,
               "args": {"Input type": ["float", "float", "float", "Scalar", "Scalar"],
                        "Input Dims": [[512], [32, 512], [512, 512], [], []]}})
    op("aten::mm", 330.0, f32)
    op("aten::mm", 325.0, {"Input type": ["float", "float"], "Input Dims": [[512, 32], [32, 512]]})
    start = op("c10d::allreduce_", 45.0, {"Input type": ["TensorList", "", "", "", "Scalar", "Scalar"],
                                          "Input Dims": [[[512, 512]], [], [], [], [], []]})
    op("gloo:all_reduce", allreduce_ms * 1e3, {"Input type": ["float"], "Input Dims": [[262144]]},
       tid=worker, cat="user_annotation", at=start + 40)
    t = start + 40 + allreduce_ms * 1e3 + 20
    op("aten::div_", 250.0, {"Input type": ["float", "Scalar"], "Input Dims": [[512, 512], []]})
    op("aten::add_", 380.0, {"Input type": ["float", "float", "Scalar"], "Input Dims": [[512, 512], [512, 512], []]})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 4},
            "traceEvents": ev + [{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                                  "tid": "PyTorch Profiler", "ts": 1000.0, "dur": t - 1000.0}]}


def test_unit5_collective_dominated_step_with_even_waits_is_communication_bound():
    r = tr.triage(_ddp_step(30.0), waits=[0.030, 0.031, 0.029, 0.030], ceilings=NOMINAL, launch_floor=FLOOR)
    _check_shape(r)
    assert r.verdict == "communication-bound" and r.act_on.startswith("Unit 5") and "Unit 2" in r.act_on
    assert r.stragglers == () and r.shares["waiting"] == 0 and r.shares["communication"] > 0.9
    assert {e.name for e in r.evidence} >= {"gloo:all_reduce", "aten::addmm"}
    addmm = next(e for e in r.evidence if e.name == "aten::addmm")
    assert addmm.category == "compute" and addmm.flops == 2 * 32 * 512 * 512
    # without waits the same step is communication-bound too
    assert tr.triage(_ddp_step(30.0), ceilings=NOMINAL, launch_floor=FLOOR).verdict == "communication-bound"


def test_unit3_one_rank_waiting_least_is_a_straggler(tmp_path):
    waits = [[0.030, 0.031, 0.002, 0.030], [0.029, 0.030, 0.001, 0.031]]  # [steps, ranks]; rank 2 is late
    r = tr.triage(_ddp_step(30.0), waits=waits, ceilings=NOMINAL, launch_floor=FLOOR)
    _check_shape(r)
    assert r.verdict == "waiting (straggler)" and r.act_on == "Unit 3 (stragglers)" and r.stragglers == (2,)
    assert r.shares["waiting"] > 0.8 and "Rank(s) 2 wait least" in r.summary()
    # the same waits as a JSON dict rank -> per-step seconds, and the straggler's own trace
    f = tmp_path / "waits.json"
    f.write_text(json.dumps({str(k): [w[k] for w in waits] for k in range(4)}))
    own = tr.triage(_ddp_step(2.0, rank=2), waits=f, ceilings=NOMINAL, launch_floor=FLOOR)
    assert own.stragglers == (2,) and own.shares["waiting"] == 0 and "straggler itself" in own.summary()


def test_real_gloo_all_reduce_is_communication(tmp_path):
    """A real gloo trace, one process (world size 1): the names the synthetic traces use."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(1 << 16)
        r = tr.triage(tr.record(lambda: dist.all_reduce(x), tmp_path / "gloo.json"), ceilings=NOMINAL,
                      launch_floor=FLOOR, top=20)
    finally:
        dist.destroy_process_group()
    comm = {e.name for e in r.evidence if e.category == "communication"}
    assert {"c10d::allreduce_", "gloo:all_reduce"} & comm and r.shares["communication"] > 0


# ---- the accounting ------------------------------------------------------------------------------

def test_self_time_and_self_flops_do_not_double_count():
    mm = {"Input type": ["float", "float"], "Input Dims": [[64, 32], [32, 16]]}
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::matmul", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0, "args": mm},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 80.0, "args": mm},
          {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 150.0, "dur": 50.0,
           "args": {"Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"], "Input Dims": [[1024], [1024], []]}}]
    r = tr.triage({"traceEvents": ev}, ceilings=Ceilings(1e9, 1e8, torch.float32, "cpu", 0, 0), launch_floor=1e-7)
    rows = {e.name: e for e in r.evidence}
    assert r.step_s == pytest.approx(200e-6)
    assert rows["aten::mm"].seconds == pytest.approx(80e-6) and rows["aten::matmul"].seconds == pytest.approx(20e-6)
    assert rows["aten::mm"].flops == 2 * 64 * 32 * 16 and rows["aten::matmul"].flops == 0
    assert rows["aten::add"].nbytes == 3 * 1024 * 2  # bf16: 2 bytes, two inputs and one output
    assert rows["(idle: no operator running)"].seconds == pytest.approx(50e-6)
    assert r.shares["overhead"] == pytest.approx(0.25 + 0.1)  # the gap and matmul's own 20 µs


@pytest.mark.parametrize("name,dims,types,flops", [
    ("aten::addmm", [[16], [8, 4], [4, 16], [], []], ["float", "float", "float", "Scalar", "Scalar"], 2 * 8 * 16 * 4),
    ("aten::bmm", [[3, 8, 4], [3, 4, 5]], ["c10::Half", "c10::Half"], 2 * 3 * 8 * 4 * 5),
    ("aten::linear", [[2, 8, 4], [16, 4]], ["float", "float"], 2 * 16 * 16 * 4),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", [[1, 2, 8, 4]] * 3, ["float"] * 3,
     4 * 1 * 2 * 8 * 8 * 4),
])
def test_op_cost_uses_torch_flop_formulas(name, dims, types, flops):
    f, b = tr.op_cost(name, {"Input Dims": dims, "Input type": types})
    assert f == flops and b > 0


def test_gpu_kernels_take_the_time_of_the_op_that_launched_them():
    """Synthetic GPU trace: a GEMM kernel linked to aten::mm by External id, then the device idles."""
    mm = {"Input type": ["c10::BFloat16"] * 2, "Input Dims": [[4096, 4096], [4096, 4096]], "External id": 7}
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.0, "dur": 20.0, "args": mm},
          {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32", "pid": 0, "tid": 7, "ts": 15.0,
           "dur": 300.0, "args": {"External id": 7}},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "pid": 0, "tid": 20,
           "ts": 100.0, "dur": 260.0, "args": {}}]
    r = tr.triage({"traceEvents": ev}, ceilings=Ceilings(989e12, 3.35e12, torch.bfloat16, "cuda", 0, 0),
                  launch_floor=5e-6)
    rows = {e.name: e for e in r.evidence}
    assert r.verdict == "compute-bound" and rows["aten::mm"].seconds == pytest.approx(300e-6)
    assert rows["ncclDevKernel_AllReduce_Sum_bf16_RING_LL"].seconds == pytest.approx(45e-6)  # exposed part only
    assert rows["(idle: no operator running)"].seconds == pytest.approx(15e-6)


# ---- errors -------------------------------------------------------------------------------------

def _one_line(e):
    msg = str(e.value)
    assert "\n" not in msg and "Hint:" in msg
    return msg


@pytest.mark.parametrize("trace,words", [
    ({}, "traceEvents"),
    ({"traceEvents": []}, "no operator events"),
    ([{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 5}], "no operator events"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0}]}, "malformed"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5,
                       "args": {"Input type": ["float", "float"], "Input Dims": [[2, 3], [4, 5]]}}]}, "do not fit"),
    ("/nonexistent/trace.json", "not found"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": float("nan"), "dur": 5}]}, "finite"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": True}]}, "finite"),
    ({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "args": "oops"}]}, "args"),
])
def test_bad_traces_are_one_line_errors(trace, words):
    with pytest.raises(tr.TriageError) as e:
        tr.triage(trace, ceilings=NOMINAL, launch_floor=FLOOR)
    assert words in _one_line(e)


@pytest.mark.parametrize("waits,words", [
    ([0.1, -0.2, 0.1], ">= 0"), ([0.1, 0.2], "at least 3 ranks"), ([[0.1, 0.2, 0.3], [0.1]], "cannot read"),
    ({"a": 1}, "cannot read"),
])
def test_bad_waits_are_one_line_errors(waits, words):
    with pytest.raises(tr.TriageError) as e:
        tr.triage(_ddp_step(30.0), waits=waits, ceilings=NOMINAL, launch_floor=FLOOR)
    assert words in _one_line(e)


def test_waits_without_a_collective_in_the_trace():
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::relu", "pid": 1, "tid": 1, "ts": 0, "dur": 5,
           "args": {"Input type": ["float"], "Input Dims": [[4]]}}]
    with pytest.raises(tr.TriageError) as e:
        tr.triage({"traceEvents": ev}, waits=[0.1, 0.1, 0.1], ceilings=NOMINAL, launch_floor=FLOOR)
    assert "no exposed time in collectives" in _one_line(e)


# ---- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"traceEvents": []}', None])
def test_cli_bad_trace_exits_2_with_one_line(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["triage", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Hint:" in err


def test_cli_triage_prints_verdict_and_evidence(tmp_path, capsys):
    trace, waits = tmp_path / "step.json", tmp_path / "waits.json"
    trace.write_text(json.dumps(_ddp_step(30.0)))
    waits.write_text("[0.030, 0.031, 0.002, 0.030]")
    nominal = ["--peak-flops", "1e11", "--bandwidth", "1e10", "--launch-floor", "5e-6"]
    assert cli.main(["triage", str(trace), *nominal]) == 0
    assert "communication-bound" in capsys.readouterr().out
    assert cli.main(["triage", str(trace), "--waits", str(waits), *nominal]) == 0
    out = capsys.readouterr().out
    assert "waiting (straggler)" in out and "gloo:all_reduce" in out and "Unit 3" in out
    assert cli.main(["triage", str(trace), "--peak-flops", "1e11"]) == 2
    assert "--bandwidth" in capsys.readouterr().err
    assert cli.main(["triage", str(trace), "--waits", str(tmp_path / "none.json"), *nominal]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_an_op_with_no_work_waiting_on_a_collective_is_communication():
    """DeepSpeed ZeRO-3 waits for a parameter all-gather inside an autograd node (a non-aten range with
    no work of its own) while gloo's thread holds the transfer; the copy gloo runs inside its range is
    part of the transfer. Both times are communication, the matmul stays compute."""
    pid, main, gloo = 1, 1, 2
    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": main, "ts": 0.0, "dur": 1000.0,
         "args": {"Input type": ["float", "float"], "Input Dims": [[512, 512], [512, 512]]}},
        {"ph": "X", "cat": "cpu_op", "name": "PreBackwardFunctionForModuleBackward", "pid": pid, "tid": main,
         "ts": 1000.0, "dur": 4000.0, "args": {"Input type": ["float"], "Input Dims": [[4096, 4096]]}},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "pid": pid, "tid": gloo, "ts": 1010.0,
         "dur": 3980.0, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": pid, "tid": gloo, "ts": 4000.0, "dur": 900.0,
         "args": {"Input type": ["float", "float"], "Input Dims": [[4096, 4096], [4096, 4096]]}},
    ]
    assert tr.op_cost("PreBackwardFunctionForModuleBackward", ev[1]["args"]) == (0.0, 0.0)
    r = tr.triage(ev, ceilings=NOMINAL, launch_floor=FLOOR)
    assert r.verdict == "communication-bound"
    assert r.shares["communication"] == pytest.approx(3980 / 5000) and r.shares["compute"] == pytest.approx(0.2)
    assert "aten::copy_" not in {e.name for e in r.evidence}


def test_truncated_or_misnamed_gzip_traces(tmp_path):
    import gzip

    whole = json.dumps(_ddp_step(1.0)).encode()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(whole)[:200])
    with pytest.raises(tr.TriageError) as e:
        tr.load_trace(cut)
    assert "not a JSON trace" in _one_line(e)
    misnamed = tmp_path / "trace.json"  # gzipped, but not called .gz: read by its magic number
    misnamed.write_bytes(gzip.compress(whole))
    assert len(tr.load_trace(misnamed)[0]) == len(tr.load_trace(_ddp_step(1.0))[0])


def test_causal_sdpa_does_half_the_flops():
    args = {"Input Dims": [[1, 2, 64, 16]] * 3 + [[], []], "Input type": ["float"] * 3 + ["Scalar", "Scalar"]}
    full, _ = tr.op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", {**args, "Concrete Inputs": ["", "", "", "0.", "False"]})
    causal, _ = tr.op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", {**args, "Concrete Inputs": ["", "", "", "0.", "True"]})
    assert full == 4 * 2 * 64 * 64 * 16 and causal == full / 2


def test_a_kernel_of_an_op_with_no_estimate_is_classified_by_its_name():
    """A torch.compile'd kernel (launched by a non-aten range) is busy device time, never overhead."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "triton_poi_fused_add_mul_0", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0,
           "args": {"External id": 3}},
          {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_mul_0", "pid": 0, "tid": 7, "ts": 5.0,
           "dur": 10000.0, "args": {"External id": 3}},
          {"ph": "X", "cat": "kernel", "name": "odd", "pid": 0, "tid": 7, "ts": 10005.0, "dur": 1.0,
           "args": {"External id": [3]}}]  # an External id that is no id: a kernel of no op
    r = tr.triage(ev, ceilings=Ceilings(989e12, 3.35e12, torch.bfloat16, "cuda", 0, 0), launch_floor=5e-6)
    assert r.verdict == "memory-bound" and r.shares["overhead"] < 0.01


def test_the_straggler_s_own_trace_is_sent_to_unit_3_and_collective_rows_split():
    waits = [[0.030, 0.031, 0.002, 0.030], [0.029, 0.030, 0.001, 0.031]]
    own = tr.triage(_ddp_step(2.0, rank=2), waits=waits, ceilings=NOMINAL, launch_floor=FLOOR)
    assert own.act_on.startswith("Unit 3 (stragglers): this rank is the late one")
    other = tr.triage(_ddp_step(30.0), waits=waits, ceilings=NOMINAL, launch_floor=FLOOR, top=50)
    rows = {(e.name, e.category): e for e in other.evidence}
    waited, sent = rows[("gloo:all_reduce", "waiting")], rows[("gloo:all_reduce", "communication")]
    assert waited.seconds > 10 * sent.seconds  # not timed: a synthetic trace's durations
    assert sum(e.share for e in other.evidence if e.category == "waiting") == pytest.approx(other.shares["waiting"])
    assert all(e.of_roof != e.of_roof for e in other.evidence if e.flops == e.nbytes == 0)  # no work: no roof


def test_attention_backward_has_flops_and_a_corrupt_gzip_is_one_line(tmp_path):
    import gzip

    args = {"Input Dims": [[1, 2, 64, 16]] * 5 + [[1, 2, 64]], "Input type": ["float"] * 6,
            "Concrete Inputs": ["", "", "", "", "", "", "0.", "True"]}
    f, b = tr.op_cost("aten::_scaled_dot_product_flash_attention_for_cpu_backward", args)
    assert f == 2.5 * 4 * 2 * 64 * 64 * 16 / 2 and b > 0  # 2.5 × the forward (flop_counter), halved: causal
    raw = bytearray(gzip.compress(json.dumps(_ddp_step(1.0)).encode() * 50))
    raw[12:40] = bytes(28)
    bad = tmp_path / "corrupt.json.gz"
    bad.write_bytes(bytes(raw))
    with pytest.raises(tr.TriageError) as e:
        tr.load_trace(bad)
    assert "not a JSON trace" in _one_line(e)


def test_gpu_idle_time_inside_a_host_side_collective_is_communication():
    """Synthetic GPU trace: a GEMM, then a host-side all-reduce (c10d range) during which the device
    runs nothing for 900 µs, then a short NCCL kernel: communication, not overhead (the CPU rule)."""
    mm = {"Input type": ["c10::BFloat16"] * 2, "Input Dims": [[1024, 1024], [1024, 1024]], "External id": 7}
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0, "args": mm},
          {"ph": "X", "cat": "kernel", "name": "sm80_xmma_gemm_bf16bf16_bf16f32", "pid": 0, "tid": 7, "ts": 5.0,
           "dur": 95.0, "args": {"External id": 7}},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": 100.0, "dur": 1000.0,
           "args": {}},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "pid": 0, "tid": 20,
           "ts": 1000.0, "dur": 100.0, "args": {}},
          {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 1100.0, "dur": 20.0,
           "args": {"Input type": ["c10::BFloat16"] * 2, "Input Dims": [[1024], [1024]], "External id": 9}}]
    r = tr.triage({"traceEvents": ev}, ceilings=Ceilings(312e12, 2.0e12, torch.bfloat16, "cuda", 0, 0),
                  launch_floor=5e-6)
    assert r.verdict == "communication-bound", r.shares
    assert r.shares["communication"] == pytest.approx(1000 / 1120) and r.shares["overhead"] == pytest.approx(25 / 1120)
    rows = {e.name: e for e in r.evidence}
    assert rows["c10d::allreduce_"].seconds == pytest.approx(900e-6) and rows["c10d::allreduce_"].category == "communication"
    assert rows["ncclDevKernel_AllReduce_Sum_bf16_RING_LL"].seconds == pytest.approx(100e-6)


def test_device_idle_while_a_deepspeed_hook_waits_for_its_all_gather_is_communication():
    """Synthetic GPU trace of ZeRO-3's parameter fetch: DeepSpeed's module hook (no work
    of its own) launches an all-gather (``record_param_comms``, 20 µs on the host) whose NCCL kernel
    runs 800 µs later; the device idles under the hook meanwhile. That idle time is the collective's,
    as on a CPU trace, not launch overhead; the hook's bookkeeping after the kernel ends stays overhead."""
    mm = {"Input type": ["c10::BFloat16"] * 2, "Input Dims": [[8192, 8192], [8192, 8192]]}
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0,
           "args": {**mm, "External id": 7}},
          {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32", "pid": 0, "tid": 7, "ts": 5.0,
           "dur": 95.0, "args": {"External id": 7}},
          {"ph": "X", "cat": "cpu_op", "name": "pre_sub_module_forward_function", "pid": 1, "tid": 1, "ts": 100.0,
           "dur": 1000.0, "args": {}},
          {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": 110.0, "dur": 20.0,
           "args": {"External id": 11}},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 20, "ts": 900.0,
           "dur": 100.0, "args": {"External id": 11}},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1100.0, "dur": 10.0,
           "args": {**mm, "External id": 13}},
          {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16_bf16f32", "pid": 0, "tid": 7, "ts": 1105.0,
           "dur": 95.0, "args": {"External id": 13}}]
    r = tr.triage({"traceEvents": ev}, ceilings=Ceilings(989e12, 3.35e12, torch.bfloat16, "cuda", 0, 0),
                  launch_floor=5e-6)
    assert r.verdict == "communication-bound", r.shares
    # in flight from the launch (110 µs) to the kernel's end (1000 µs); 100-110 and 1000-1100 are the hook's own
    assert r.shares["communication"] == pytest.approx(890 / 1200) and r.shares["overhead"] == pytest.approx(120 / 1200)
    assert r.shares["compute"] == pytest.approx(190 / 1200)
