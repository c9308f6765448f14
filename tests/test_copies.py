"""Unit 5: the bandwidth ladder — memory copies, host↔device pageable vs pinned.

On CPU the host↔device probes must refuse in one line and the ladder must say which rows it skipped;
the GPU tests (marked gpu) measure the real ladder.
"""

import pytest
import torch

from teraflops import ceilings as ce
from teraflops import datasheets as ds
from teraflops.datasheets import PUBLISHED_LINKS
from teraflops.errors import CourseError
from teraflops.sizing import PRESETS, preset

MB = 2**20


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_host_device_copy_says_in_one_line_why_it_cannot_run_on_cpu(direction):
    with pytest.raises(ce.CopyProbeError, match="needs a CUDA GPU") as info:
        ce.measure_host_device_copy(MB, pinned=True, direction=direction)
    msg = str(info.value)
    assert "\n" not in msg and "PCIe" in msg and "Hint:" in msg and isinstance(info.value, CourseError)


@pytest.mark.parametrize("kwargs, words", [({"direction": "up"}, "direction"), ({"nbytes": 0}, "nbytes"),
                                           ({"nbytes": 1.5}, "nbytes")])
def test_host_device_copy_checks_its_arguments_first(kwargs, words):
    args = {"nbytes": MB, "pinned": False, **kwargs}
    with pytest.raises(ce.CopyProbeError, match=words):
        ce.measure_host_device_copy(**args)


def test_pcie_link_follows_the_datasheet_generation():
    assert ds.pcie_link(ds.published_for("NVIDIA A100-SXM4-80GB")).name == "PCIe Gen4 x16"
    assert ds.pcie_link(ds.published_for("NVIDIA H200")).name == "PCIe Gen5 x16"
    assert ds.pcie_link(None) is None
    assert ds.pcie_link(ds.published_for("NVIDIA H100 80GB HBM3")).bandwidth == pytest.approx(63.0e9, rel=1e-3)
    assert {l.name for l in PUBLISHED_LINKS} >= {"PCIe Gen4 x16", "PCIe Gen5 x16"}


@pytest.mark.parametrize("nbytes", [0, 2, 1.5, True])
def test_ladder_refuses_buffers_too_small_to_time(nbytes):
    with pytest.raises(ce.CopyProbeError, match="nbytes") as info:
        ce.bandwidth_ladder(nbytes=nbytes)
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)


def test_ladder_bytes_default_to_the_preset_at_call_time(monkeypatch):
    assert preset("cpu").copies.ladder_bytes == 64 * MB and PRESETS["gpu"].copies.ladder_bytes == 256 * MB
    seen = []
    monkeypatch.setattr(ce, "measure_copy_bandwidth", lambda nbytes, *a: seen.append(nbytes) or 1e9)
    monkeypatch.setattr(ce, "measure_host_device_copy", lambda nbytes, *a: seen.append(nbytes) or 1e9)
    monkeypatch.setenv("TERAFLOPS_PRESET", "tiny")
    ce.bandwidth_ladder()
    assert seen and set(seen) == {preset("tiny").copies.ladder_bytes}


@pytest.mark.parametrize("kwargs, words", [
    ({"matmul_n": 0}, "matmul_n"), ({"matmul_n": 1}, "matmul_n"), ({"matmul_n": 64.0}, "matmul_n"),
    ({"matmul_n": True}, "matmul_n"), ({"copy_bytes": 0}, "copy_bytes"), ({"copy_bytes": -8}, "copy_bytes"),
    ({"copy_bytes": "1MB"}, "copy_bytes"), ({"dtype": "float32"}, "dtype"), ({"device": ""}, "device")])
def test_measure_ceilings_refuses_bad_sizes_instead_of_using_the_default(kwargs, words):
    args = {"matmul_n": 64, "copy_bytes": MB, "dtype": torch.float32, "device": "cpu", **kwargs}
    with pytest.raises(ce.CeilingsError, match=words) as info:
        ce.measure_ceilings(**args)
    msg = str(info.value)
    assert "\n" not in msg and "Hint:" in msg and isinstance(info.value, CourseError)


def test_ladder_on_a_gpu_without_a_published_link_names_the_gpu(monkeypatch):
    machine = type("M", (), {"device": "cuda", "gpu_name": "NVIDIA Imaginary X1"})()
    monkeypatch.setattr(ce, "detect", lambda: machine)
    monkeypatch.setattr(ce, "measure_copy_bandwidth", lambda *a: 1e9)
    monkeypatch.setattr(ce, "measure_host_device_copy", lambda *a: 1e9)
    rows = ce.bandwidth_ladder(nbytes=MB)
    links = [r for r in rows if "host↔device" in r["what"]]
    assert len(links) == 4
    assert all(r["published"] is None and r["note"] == "no published host link figure for NVIDIA Imaginary X1"
               for r in links)


def test_ladder_rows_and_table():
    rows = ce.bandwidth_ladder(nbytes=8 * MB, min_run_time=0.05)
    whats = [r["what"] for r in rows]
    assert whats[0].startswith("device copy") and rows[0]["bandwidth"] > 0
    assert [w.split(" (")[0] for w in whats[-4:]] == ["H2D pageable", "H2D pinned", "D2H pageable", "D2H pinned"]
    assert set(rows[0]) == {"what", "bandwidth", "counts", "published", "source", "note"}
    text = ce.ladder_table(rows)
    assert "measured (GB/s)" in text and "published (GB/s)" in text
    if not torch.cuda.is_available():
        assert len(rows) == 5
        assert all(r["bandwidth"] is None and r["note"] == ce.NEEDS_GPU for r in rows[1:])
        assert text.count("skipped: needs a CUDA GPU") == 4


def test_ladder_table_numbers_published_sources():
    rows = [{"what": "device copy (GPU HBM, device to device)", "bandwidth": 4.0e12, "counts": "read + write",
             "published": 4.8e12, "source": "datasheet X", "note": "datasheet of the H200 SXM"},
            {"what": "H2D pinned (host↔device)", "bandwidth": 50e9, "counts": "once", "published": 63e9,
             "source": "PCI-SIG spec", "note": "PCIe Gen5 x16, per direction"},
            {"what": "H2D pageable (host↔device)", "bandwidth": None, "counts": "once", "published": None,
             "source": None, "note": ce.NEEDS_GPU}]
    text = ce.ladder_table(rows)
    assert "83%" in text and "79%" in text and "[1] datasheet X" in text and "[2] PCI-SIG spec" in text
    assert "4,000" in text and "skipped" in text


@pytest.mark.gpu
def test_every_rung_is_measured_on_a_gpu_and_no_link_beats_its_datasheet():
    """How far pinned beats pageable, and HBM beats PCIe, is the card's (and its load's) figure: printed.
    A measured rate above the link's published one would be a wrong byte count or clock, whatever the
    load (load only slows a copy)."""
    rows = ce.bandwidth_ladder(min_run_time=0.2)
    print("\n" + ce.ladder_table(rows))
    by = {r["what"].split(" (")[0]: r for r in rows}
    assert set(by) >= {"device copy", "H2D pageable", "H2D pinned", "D2H pageable", "D2H pinned"}
    assert all(r["bandwidth"] > 0 and r["note"] != ce.NEEDS_GPU for r in rows)
    for name in ("H2D pinned", "D2H pinned", "H2D pageable", "D2H pageable"):
        if by[name]["published"]:
            assert by[name]["bandwidth"] < 1.05 * by[name]["published"]
