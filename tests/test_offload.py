import importlib.util
import math
from types import SimpleNamespace

import pytest

from teraflops import datasheets as ds
from teraflops.hardware import offload as off
from teraflops.datasheets import PUBLISHED_LINKS
from teraflops.errors import CourseError
from teraflops.sizing import preset
from teraflops.tables import GB

PSI = 7e9
GEN5 = next(l.bandwidth for l in PUBLISHED_LINKS if l.name == "PCIe Gen5 x16")
LAYER = 32_000 * 4_096  # a 7B model's embedding (vocab × hidden), its largest layer
NEEDS_DS = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(off, "detect", lambda: SimpleNamespace(device="cpu", gpu_name=None))


@pytest.mark.parametrize("nd", [1, 8])
def test_pcie_bytes_per_gpu_per_step(nd):
    assert off.pcie_bytes(PSI, nd, "none") == 0
    assert off.pcie_bytes(PSI, nd, "optimizer") == 4 * PSI / nd  # ZeRO-Offload: 2Ψ down + 2Ψ up
    assert off.pcie_bytes(PSI, nd, "params") == 6 * PSI / nd  # params up twice, grads down once
    assert off.pcie_bytes(PSI, nd, "params", recompute=True) == 8 * PSI / nd  # ZeRO-Infinity's count
    assert off.pcie_bytes(PSI, nd, "optimizer", recompute=True) == 4 * PSI / nd


@pytest.mark.parametrize("nd", [1, 8])
def test_memory_of_each_placement(nd):
    none, opt, par = (off.offload_memory(PSI, nd, m) for m in off.OFFLOAD_MODES)
    assert (none.stage, none.gpu_bytes, none.cpu_bytes) == (2, 2 * PSI + 14 * PSI / nd, 0)
    assert (opt.stage, opt.gpu_bytes, opt.cpu_bytes) == (2, 2 * PSI, 14 * PSI / nd)
    assert (par.stage, par.gpu_bytes, par.cpu_bytes) == (3, 0, 16 * PSI / nd)
    assert opt.cpu_node_bytes == 14 * PSI  # one node of nd GPUs holds all of it
    z3 = off.offload_memory(PSI, nd, "optimizer", stage=3, largest_layer_params=LAYER)
    assert (z3.gpu_bytes, z3.cpu_bytes) == (2 * PSI / nd + 4 * LAYER, 14 * PSI / nd)
    assert off.offload_memory(PSI, nd, "params", largest_layer_params=LAYER).gpu_bytes == 4 * LAYER


def test_two_nodes_split_the_cpu_memory():
    m = off.offload_memory(70e9, 16, "params", nodes=2)
    assert m.gpus_per_node == 8 and m.cpu_node_bytes == 16 * 70e9 / 2


def test_seconds_from_a_given_bandwidth():
    (row,) = off.offload_rows(PSI, nd=8, tokens_per_gpu=8192, bandwidth=50e9, peak_flops=1e15, mfu=0.5)
    assert row["pcie_bytes"] == 3.5e9 and row["pcie_s"] == pytest.approx(0.07)
    assert row["compute_s"] == pytest.approx(6 * PSI * 8192 / 5e14)
    assert row["ratio"] == pytest.approx(row["pcie_s"] / row["compute_s"]) and row["hidden"]
    assert (row["bandwidth_source"], row["peak_source"]) == ("given", "given")
    assert row["zero2_gpu_bytes"] == 2 * PSI + 14 * PSI / 8 and row["fits"] and row["offload_fits"]
    rc = off.offload_rows(PSI, 8, 8192, "params", 50e9, peak_flops=1e15, mfu=0.5, recompute=True)[0]
    assert rc["pcie_s"] == pytest.approx(8 * PSI / 8 / 50e9) and rc["compute_s"] == pytest.approx(8 * PSI * 8192 / 5e14)


def test_ratio_does_not_depend_on_model_size_and_table_gives_break_even(cpu_only):
    rows = off.offload_rows()
    assert [r["params"] for r in rows] == [1e9, 7e9, 13e9, 70e9]
    assert len({round(r["ratio"], 12) for r in rows}) == 1
    assert [r["fits"] for r in rows] == [True, True, True, False]  # 70B: 262.5 GB under ZeRO-2
    assert rows[-1]["gpu_bytes"] == 140e9 and not rows[-1]["offload_fits"]  # fp16 copy alone exceeds 80 GB
    # 4Ψ/Nd / B = 6Ψ·T / (peak·mfu)  =>  T = 4·peak·mfu / (6·Nd·B)
    tokens = 4 * 989.5e12 * 0.4 / (6 * 8 * GEN5)
    assert rows[0]["tokens_per_gpu"] * rows[0]["ratio"] == pytest.approx(tokens)
    printed = off.offload_table(rows)
    assert f"from {round(tokens)} tokens per GPU" in printed and "published PCIe Gen5 x16" in printed
    assert printed.splitlines()[-1].split()[0] == "70B"
    assert "hides" not in off.offload_table(off.offload_rows(mode="none"))


def test_cpu_machine_uses_the_published_link_and_h100_peak(cpu_only):
    assert off.host_link_bandwidth() == (GEN5, "published PCIe Gen5 x16, no GPU here")
    row = off.offload_rows(PSI)[0]
    assert row["bandwidth"] == GEN5 and row["bandwidth_source"] == "published PCIe Gen5 x16, no GPU here"
    assert row["peak_flops"] == 989.5e12 and "H100 SXM" in row["peak_source"]


def test_published_peak_of_a_detected_gpu():
    assert ds.published_peak("NVIDIA H200") == (989.5e12, "published H200 SXM dense 16-bit, detected")
    assert ds.published_peak("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert ds.published_peak("NVIDIA L40S")[0] == 362.05e12


def test_offload_of_an_unlisted_gpu_says_no_datasheet(monkeypatch):
    from teraflops.machine import GPU, Machine

    fake = Machine("cuda", (GPU(0, "NVIDIA Mystery X1", 32 * 2**30, (9, 0)),))
    monkeypatch.setattr(off, "detect", lambda: fake)
    row = off.offload_rows(7e9, bandwidth=63e9)[0]
    assert row["peak_source"].startswith("no datasheet for NVIDIA Mystery X1"), row["peak_source"]


def test_bandwidth_is_measured_once_per_call(monkeypatch):
    import teraflops.ceilings as ceilings

    calls = []
    monkeypatch.setattr(off, "detect", lambda: SimpleNamespace(device="cuda", gpu_name="NVIDIA H200"))
    monkeypatch.setattr(ceilings, "measure_host_device_copy", lambda n, pinned: calls.append((n, pinned)) or 50e9)
    rows = off.offload_rows()
    assert calls == [(preset().copies.ladder_bytes, True)] and len(rows) == 4
    assert rows[0]["bandwidth"] == 50e9 and rows[0]["bandwidth_source"].startswith("measured pinned H2D")
    assert "H200 SXM" in rows[0]["peak_source"]
    off.offload_rows(bandwidth=60e9)
    assert len(calls) == 1  # a given bandwidth is not measured


@NEEDS_DS
@pytest.mark.parametrize("psi, nd, layer, nodes", [(7_000_000_000, 8, LAYER, 1), (70_000_000_000, 16, None, 2)])
def test_deepspeed_rows_are_what_its_estimators_return(psi, nd, layer, nodes):
    from teraflops.parallelization.model_states import deepspeed_estimators

    zero2, zero3 = deepspeed_estimators()
    rows = off.deepspeed_offload_check(psi, nd, layer, nodes)
    assert [(r["stage"], r["mode"]) for r in rows] == [(2, "optimizer"), (3, "optimizer"), (3, "params")]
    n, lay = nd // nodes, layer or 0
    expect = [zero2(psi, n, nodes, cpu_offload=True),
              zero3(psi, lay, n, nodes, cpu_offload=True, cpu_offload_params=False, zero_init=True)[:2],
              zero3(psi, lay, n, nodes, cpu_offload=True, cpu_offload_params=True, zero_init=True)[:2]]
    assert [(r["deepspeed_cpu_bytes"], r["deepspeed_gpu_bytes"]) for r in rows] == expect
    # as the docstring states DeepSpeed's formulas
    assert rows[0]["deepspeed_gpu_bytes"] == 2 * psi
    assert rows[0]["deepspeed_cpu_bytes"] == int(psi * max(4 * nd, 16) * 1.5)  # N = all GPUs, per node
    assert rows[1]["deepspeed_gpu_bytes"] == 4 * lay + int(2 * psi / nd)
    assert rows[1]["deepspeed_cpu_bytes"] == int(psi * 16 * (1 / nodes) * 1.5)
    assert rows[2]["deepspeed_gpu_bytes"] == 4 * lay
    assert rows[2]["deepspeed_cpu_bytes"] == int(psi * 18 * (1 / nodes) * 1.5)
    # ours: same GPU bytes; CPU per node 14Ψ, 14Ψ, 16Ψ (over nodes)
    assert [r["gpu_ratio"] for r in rows[:2]] == [pytest.approx(1), pytest.approx(1)]
    assert [r["ours_cpu_bytes"] for r in rows] == [pytest.approx(c * psi / nodes) for c in (14, 14, 16)]
    assert rows[1]["cpu_ratio"] == pytest.approx(16 * 1.5 / 14) and rows[2]["cpu_ratio"] == pytest.approx(18 * 1.5 / 16)
    assert (rows[2]["gpu_ratio"] == pytest.approx(1)) if layer else math.isnan(rows[2]["gpu_ratio"])
    assert "DS CPU/node (GB)" in off.deepspeed_offload_table(rows)


@pytest.mark.parametrize("call", [
    lambda: off.pcie_bytes(0, 8),
    lambda: off.pcie_bytes(True, 8),
    lambda: off.pcie_bytes(PSI, 0),
    lambda: off.pcie_bytes(PSI, 8.0),
    lambda: off.pcie_bytes(PSI, 8, "cpu"),
    lambda: off.pcie_bytes(PSI, 8, "params", recompute="yes"),
    lambda: off.offload_memory(PSI, 8, "params", stage=2),
    lambda: off.offload_memory(PSI, 8, "optimizer", stage=1),
    lambda: off.offload_memory(PSI, 8, largest_layer_params=-1),
    lambda: off.offload_memory(PSI, 8, nodes=3),
    lambda: off.offload_rows(()),
    lambda: off.offload_rows(PSI, bandwidth=0),
    lambda: off.offload_rows(PSI, bandwidth=50e9, mfu=1.5),
    lambda: off.offload_rows(PSI, bandwidth=50e9, tokens_per_gpu=-1),
    lambda: off.offload_rows(PSI, bandwidth=50e9, peak_flops=float("inf")),
    lambda: off.deepspeed_offload_check(PSI, 8, largest_layer_params=2 * int(PSI)),
    lambda: off.offload_table([]),
])
def test_bad_input_raises_one_line_with_a_hint(call):
    with pytest.raises(off.OffloadError) as e:
        call()
    assert isinstance(e.value, CourseError) and isinstance(e.value, ValueError)
    assert "Hint:" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.gpu
def test_measured_pinned_h2d_on_a_gpu():
    bw, source = off.host_link_bandwidth(64 * 2**20)
    assert source == "measured pinned H2D, 64 MiB" and 1e9 < bw < 1e12  # PCIe or NVLink-C2C, not a cache
    row = off.offload_rows(70e9, bandwidth=None)[0]
    assert row["bandwidth_source"].startswith("measured pinned H2D")
    assert row["pcie_s"] == row["pcie_bytes"] / row["bandwidth"]
