"""``teraflops doctor`` on the GPUs' compute modes: a GPU that admits one CUDA process (EXCLUSIVE_PROCESS)
or none (PROHIBITED) gets one line naming it and the fix; nvidia-smi absent or failing is said so.

The nvidia-smi answers below are written in the format of ``nvidia-smi --query-gpu=index,compute_mode
--format=csv,noheader`` (``INDEX, MODE`` per GPU; the modes as ``nvidia-smi --help-query-gpu`` lists
them), not captured on a GPU box: none has run this course yet.
"""

from __future__ import annotations

import os

import pytest

from teraflops.course import doctor

DEFAULT = "0, Default\n1, Default\n"
EXCLUSIVE = "0, Exclusive_Process\n1, Default\n"
PROHIBITED = "0, Default\n1, Prohibited\n"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
             "latest NVIDIA driver is installed and running.\n")


def test_compute_modes_are_read_per_gpu():
    assert doctor.compute_modes(DEFAULT) == [(0, "Default"), (1, "Default")]
    assert doctor.compute_modes(EXCLUSIVE) == [(0, "Exclusive_Process"), (1, "Default")]
    assert doctor.compute_modes(" 3, Prohibited \n") == [(3, "Prohibited")]
    assert doctor.compute_modes(NO_DRIVER) == [] and doctor.compute_modes("") == []


def test_shared_gpus_are_one_plain_line_each():
    lines = doctor.compute_mode_lines(0, DEFAULT)
    assert lines == ["  GPU 0: Default", "  GPU 1: Default"]


def test_an_exclusive_process_gpu_is_one_line_naming_it_and_the_fix():
    first, second = doctor.compute_mode_lines(0, EXCLUSIVE)
    assert first.startswith("  GPU 0: Exclusive_Process: one CUDA process at a time")
    assert "kernel, rank 0 and the Triton server" in first and "GPU 0" in first
    assert "`sudo nvidia-smi -i 0 -c DEFAULT`" in first and "one process per GPU" in first
    assert second == "  GPU 1: Default"


def test_a_prohibited_gpu_is_named_with_its_fix():
    _, line = doctor.compute_mode_lines(0, PROHIBITED)
    assert line.startswith("  GPU 1: Prohibited: no CUDA process may use it")
    assert "`sudo nvidia-smi -i 1 -c DEFAULT`" in line and "CUDA_VISIBLE_DEVICES without 1" in line


def test_nvidia_smi_absent_or_failing_is_said_in_one_line():
    assert doctor.compute_mode_lines(None, "") == ["  nvidia-smi: absent, so the GPUs' compute modes are unknown"]
    line, = doctor.compute_mode_lines(9, NO_DRIVER)
    assert "failed (exit 9)" in line and "couldn't communicate with the NVIDIA driver" in line
    assert "\n" not in line


def test_the_doctor_asks_nvidia_smi_for_the_compute_modes(monkeypatch):
    asked = []
    monkeypatch.setattr(doctor.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "nvidia-smi" else None)
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=20: asked.append(cmd) or (0, EXCLUSIVE))
    lines = doctor._compute_modes()
    assert asked == [["/usr/bin/nvidia-smi", "--query-gpu=index,compute_mode", "--format=csv,noheader"]]
    assert lines[0].startswith("  GPU 0: Exclusive_Process") and len(lines) == 2
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor._compute_modes() == doctor.compute_mode_lines(None, "")


@pytest.mark.slow
def test_teraflops_doctor_reports_an_exclusive_gpu(tmp_path, monkeypatch, capsys):
    """The whole report, with a stand-in nvidia-smi on PATH answering as a box whose GPU 0 is in
    EXCLUSIVE_PROCESS mode."""
    from teraflops.course import cli

    smi = tmp_path / "nvidia-smi"
    (tmp_path / "modes.csv").write_text(EXCLUSIVE)
    smi.write_text(f'#!/bin/bash\ncase "$*" in *compute_mode*) cat {tmp_path}/modes.csv ;; *) echo "GPU0 X" ;; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("GPU compute modes"):]
    assert "GPU 0: Exclusive_Process" in section and "sudo nvidia-smi -i 0 -c DEFAULT" in section
