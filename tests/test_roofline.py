import math

import pytest
import torch

from teraflops import ceilings, datasheets
from teraflops.model_definition import roofline
from teraflops.ceilings import Ceilings


def test_matmul_intensity_square_fp32_is_n_over_6():
    assert roofline.matmul_intensity(1200, 1200, 1200, torch.float32) == pytest.approx(200)
    assert roofline.matmul_intensity(1200, 1200, 1200, torch.bfloat16) == pytest.approx(400)


def test_gemv_is_about_one_flop_per_byte_in_bf16():
    assert roofline.matmul_intensity(1, 8192, 8192, torch.bfloat16) == pytest.approx(1.0, rel=1e-3)


def test_softmax_intensity_convention():
    assert roofline.softmax_intensity(10, 10, torch.float32) == pytest.approx(5 / 8)
    assert roofline.softmax_intensity(10, 10, torch.float16) == pytest.approx(5 / 4)


def test_ridge_point_and_attainable():
    c = Ceilings(100e12, 2e12, torch.bfloat16, "cuda", 1, 1)
    assert c.ridge_point == pytest.approx(50)
    assert c.attainable(10) == pytest.approx(20e12)
    assert c.attainable(1000) == pytest.approx(100e12)


def test_published_lookup_matches_torch_device_names():
    assert datasheets.published_for("NVIDIA H200").name == "H200 SXM"
    assert datasheets.published_for("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert datasheets.published_for("NVIDIA A100-SXM4-80GB").name == "A100 SXM 80GB"
    assert datasheets.published_for(None) is None
    for g in datasheets.PUBLISHED:
        assert g.source.startswith("NVIDIA") and "http" in g.source


def test_measured_roofline_separates_matmul_from_elementwise():
    measured = ceilings.measure_ceilings(matmul_n=256, copy_bytes=32 * 2**20, dtype=torch.float32, device="cpu")
    assert math.isfinite(measured.ridge_point) and measured.ridge_point > 0  # FLOP/byte of two positive rates
    assert (measured.matmul_n, measured.copy_bytes, measured.device) == (256, 32 * 2**20, "cpu")
    points = roofline.measure_roofline((1024,), 1 << 20, torch.float32, "cpu", min_run_time=0.02, progress=False)
    assert all(p.seconds > 0 for p in points)
    # Verdicts depend only on intensity and the ceilings: use fixed CPU-like ceilings (ridge point 10)
    # so the test does not depend on how busy the machine was during the probe.
    c = Ceilings(1e11, 1e10, torch.float32, "cpu", 1, 1)
    verdicts = {p.name.split()[0]: p.bound(c) for p in points}
    assert verdicts == {"matmul": "compute", "add": "memory", "softmax": "memory", "copy": "memory"}
    assert "verdict" in roofline.roofline_table(points, c)


def test_roofline_labels_do_not_overlap_and_stay_inside():
    """"softmax 16384×1024" sat on "matmul 16×16"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from figure_checks import assert_texts_inside_and_apart
    from teraflops.ceilings import Ceilings
    from teraflops.model_definition.roofline import RooflinePoint, plot_roofline

    c = Ceilings(2e11, 1e10, torch.float32, "cpu", 512, 2**26)
    points = [RooflinePoint("matmul 16×16", 2 * 16**3, 3 * 16 * 16 * 4, 2 * 16**3 / 6e9),
              RooflinePoint("softmax 16384×1024", 5 * 2**24, 8 * 2**24, 5 * 2**24 / 6.2e9),
              RooflinePoint("add 2^24", 2**24, 12 * 2**24, 2**24 / 0.8e9),
              RooflinePoint("matmul 4096×4096", 2 * 4096**3, 3 * 4096**2 * 4, 2 * 4096**3 / 1.9e11),
              RooflinePoint("matmul 256×256", 2 * 256**3, 3 * 256**2 * 4, 2 * 256**3 / 1.5e11),
              RooflinePoint("copy 2^24", 0, 8 * 2**24, 8 * 2**24 / 9e9)]
    ax = plot_roofline(points, c)
    ax.figure.canvas.draw()
    assert_texts_inside_and_apart(ax)
    plt.close(ax.figure)


@pytest.mark.parametrize("device_name, entry, dense_tflops", [
    ("Tesla T4", "T4", 65.0), ("NVIDIA L4", "L4", 121.0), ("NVIDIA A10", "A10", 125.0),
    ("NVIDIA L40S", "L40S", 362.05), ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ("NVIDIA B200", "B200", 2250.0), ("NVIDIA GH200 480GB", "GH200 96GB", 989.5),
    ("NVIDIA GH200 144G HBM3e", "GH200 144GB", 989.5), ("NVIDIA H200", "H200 SXM", 989.5),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0)])
def test_datasheet_lookup_of_each_gpu_class(device_name, entry, dense_tflops):
    g = datasheets.published_for(device_name)
    assert g is not None and g.name == entry, (device_name, g)
    assert datasheets.published_peak(device_name)[0] == dense_tflops * 1e12
    assert (g.bf16_tflops is None) == (entry == "T4")  # Turing has no bf16 tensor cores


def test_unknown_gpu_has_no_datasheet_and_is_not_priced_as_an_h100():
    assert datasheets.published_for("NVIDIA Mystery X1") is None
    with pytest.raises(datasheets.NoDatasheetError, match="no datasheet for 'NVIDIA Mystery X1'"):
        datasheets.published_peak("NVIDIA Mystery X1")
    assert "no GPU here" in datasheets.published_peak(None)[1]
