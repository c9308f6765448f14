"""`teraflops run 0`: the course map runs headless and reports this machine's ceilings."""

import pytest

from teraflops import runner


@pytest.mark.slow
def test_run_unit_0_reports_the_machine_and_its_ceilings(tmp_path):
    [result] = runner.run_units([0], out_dir=tmp_path, html=False)
    assert result.ok, result.error
    assert set(result.headline) == {"peak_tflops", "bandwidth", "ridge_point"}
    assert result.headline["ridge_point"]["value"] == pytest.approx(
        result.headline["peak_tflops"]["value"] * 1e12 / (result.headline["bandwidth"]["value"] * 1e9), rel=1e-6)
    assert not runner.checked_output_mismatches(result.executed, runner.course_root() / "notebooks" / "00_the_map.ipynb")
