"""Unit 5 §5's NVMe offload: DeepSpeed's swap bytes on hand-worked cases, the parameter buffers on each side
of the swapped-parameter count, /proc/<pid>/io parsed from recorded text, the async_io op's one-line
reason, and one live ZeRO-3 run swapping to disk (slow; bytes and a finite loss, never a speed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from teraflops.hardware import offload
from teraflops.hardware.offload import (MIN_AIO_BYTES, OffloadError, SwapBuffers, buffers_short, io_delta,
                                        nvme_step_bytes, offload_config, parse_proc_io, sub_groups, swap_buffers)
from teraflops.launch import ops
from teraflops.sizing import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
ONE_MIB_FP32 = MiB // 4  # elements of a 1 MiB fp32 tensor: the smallest DeepSpeed swaps


def test_one_swappable_parameter_reads_six_and_writes_five_of_its_size():
    # params read for forward and backward, written after the step; the fp32 gradient written and read;
    # master + exp_avg + exp_avg_sq read and written: read 2 + 1 + 3, write 1 + 1 + 3 (MiB)
    m = nvme_step_bytes([ONE_MIB_FP32])
    assert (m.read, m.write) == (6 * MiB, 5 * MiB)
    assert m.parts == {"params": (2 * MiB, MiB), "grads": (MiB, MiB), "optimizer": (3 * MiB, 3 * MiB)}
    assert (m.swapped_params, m.kept_params) == (1, 0)


def test_a_partition_under_1_mib_stays_in_memory_and_the_sub_group_is_rounded_to_1024_bytes():
    m = nvme_step_bytes([ONE_MIB_FP32, 1000])
    group = 1028 * 1024  # (262,144 + 1,000) × 4 = 1,052,576 bytes, rounded up to 1,028 KiB
    assert m.parts["params"] == (2 * MiB, MiB)  # the 4,000-byte parameter is kept in CPU memory
    assert m.parts["grads"] == (MiB, MiB)  # its gradient too: 4,000 // 1,024 × 1,024 = 3,072 bytes < 1 MiB
    assert m.parts["optimizer"] == (3 * group, 3 * group)
    assert (m.read, m.write) == (3 * MiB + 3 * group, 2 * MiB + 3 * group)
    assert (m.swapped_params, m.kept_params) == (1, 1)


def test_two_ranks_split_each_parameter_into_padded_partitions():
    # 524,289 elements over 2 ranks: 262,145 each (1,048,580 bytes), swapped as 1,025 KiB, its gradient's
    # whole KiB (1 MiB) swapped and the 4-byte tail kept
    m = nvme_step_bytes([2 * ONE_MIB_FP32 + 1], nd=2)
    part = 1025 * 1024
    assert m.parts == {"params": (2 * part, part), "grads": (MiB, MiB), "optimizer": (3 * part, 3 * part)}
    assert (m.read, m.write) == (6_296_576, 5_246_976)


def test_without_deepspeeds_rules_it_is_the_papers_count():
    # every byte of every tensor: read (2·2 + 4 + 12)Ψ, write (2 + 4 + 12)Ψ with fp16 parameters
    m = nvme_step_bytes([600, 400], param_bytes=2, min_aio_bytes=0, align=1)
    assert (m.read, m.write) == (20 * 1000, 18 * 1000)


def test_a_model_too_small_to_swap_moves_nothing():
    m = nvme_step_bytes([1000, 2000])
    assert (m.read, m.write, m.swapped_params) == (0, 0, 0)


def test_sub_groups_close_once_they_reach_the_size():
    assert sub_groups([3, 3, 3], 5) == [[3, 3], [3]]
    assert sub_groups([3, 3], 10) == [[3, 3]]
    assert sub_groups([6, 1], 5) == [[6], [1]]


@pytest.mark.parametrize("bad", [[], [0], [1.5], "abc", [True]])
def test_bad_parameter_counts_are_refused(bad):
    with pytest.raises(OffloadError):
        nvme_step_bytes(bad)


def layered(layers: int) -> list[int]:
    """A model of ``layers`` blocks, each one swapped 1 MiB weight and a bias kept in memory."""
    return [n for _ in range(layers) for n in (ONE_MIB_FP32, 256)]


@pytest.mark.parametrize("layers", [1, 3, 8])
def test_buffers_cover_every_swapped_parameter(layers):
    b = swap_buffers(layered(layers))
    assert b == SwapBuffers(buffer_count=layers, buffer_size=ONE_MIB_FP32)
    assert buffers_short(b, layered(layers)) is None


@pytest.mark.parametrize("layers", [2, 5, 8])
def test_one_buffer_fewer_than_the_layers_is_the_not_enough_buffers_crash(layers):
    why = buffers_short(SwapBuffers(layers - 1, ONE_MIB_FP32), layered(layers))
    assert why is not None and "Not enough buffers" in why and str(layers) in why
    assert buffers_short(SwapBuffers(layers + 1, ONE_MIB_FP32), layered(layers)) is None


def test_a_buffer_smaller_than_the_largest_partition_is_refused():
    why = buffers_short(SwapBuffers(4, ONE_MIB_FP32 - 1), layered(2))
    assert why is not None and "buffer_size" in why


def test_the_buffer_size_is_rounded_to_whole_kib():
    assert swap_buffers([ONE_MIB_FP32 + 1]).buffer_size == ONE_MIB_FP32 + 256  # 1,025 KiB of fp32


def test_the_nvme_config_carries_the_buffers_and_the_cpu_config_no_path():
    b = SwapBuffers(3, ONE_MIB_FP32)
    nvme = offload_config("nvme", 4, "/swap", b)["zero_optimization"]
    assert nvme["stage"] == 3
    assert nvme["offload_param"] == {"device": "nvme", "nvme_path": "/swap", "buffer_count": 3,
                                     "buffer_size": ONE_MIB_FP32, "max_in_cpu": 0}  # else copied back to CPU memory
    assert nvme["offload_optimizer"]["buffer_count"] == 4  # master, exp_avg, exp_avg_sq and the gradient at once
    cpu = offload_config("cpu", 4, None, None)["zero_optimization"]
    assert cpu["offload_param"] == cpu["offload_optimizer"] == {"device": "cpu"}
    with pytest.raises(OffloadError):
        offload_config("disk", 4, "/swap", b)
    with pytest.raises(OffloadError):
        offload_config("nvme", 4, None, b)


RECORDED = """rchar: 323934931
wchar: 323929600
syscr: 632687
syscw: 632675
read_bytes: 4096
write_bytes: 323932160
cancelled_write_bytes: 0
"""


def test_proc_io_is_parsed_and_differenced():
    before = parse_proc_io(RECORDED)
    assert before["read_bytes"] == 4096 and before["write_bytes"] == 323932160 and len(before) == 7
    after = dict(before, read_bytes=4096 + 6 * MiB, write_bytes=323932160 + 5 * MiB)
    assert io_delta(before, after) == (6 * MiB, 5 * MiB)


@pytest.mark.parametrize("text", ["rchar: 1\nread_bytes 4\n", "rchar: 1\nwchar: 2\n", "read_bytes: -1\nwrite_bytes: 0"])
def test_proc_io_text_that_is_not_the_file_is_refused(text):
    with pytest.raises(OffloadError):
        parse_proc_io(text)


def test_this_process_io_is_readable():
    assert {"read_bytes", "write_bytes"} <= offload.proc_io().keys()


def test_direct_io_is_counted_where_the_probe_writes(tmp_path):
    try:
        d = offload.disk_bandwidth(tmp_path, nbytes=1 << 20, block=256 << 10)
    except OSError as e:  # a filesystem without O_DIRECT
        pytest.skip(f"no O_DIRECT under {tmp_path}: {e}")
    assert d.write > 0 and d.read > 0
    assert d.accounted_read == 1 << 20 and d.accounted_write >= 1 << 20
    assert not list(tmp_path.iterdir())


def test_a_missing_libaio_header_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "_include_dirs", lambda: [tmp_path])
    why = ops.aio_unavailable()
    assert why is not None and "\n" not in why and "apt-get install libaio-dev" in why
    with pytest.raises(ops.AioUnavailable, match="libaio-dev"):
        ops.prepare_aio_op()


def test_ci_installs_libaio():
    assert "libaio-dev" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a hang guard that outlasts the first build of the async_io op (26 min at load 9-13 here)
def test_a_zero3_run_swaps_to_disk_and_trains(tmp_path):
    why = ops.aio_unavailable()
    if why:
        pytest.skip(why)
    # one block whose MLP weights are 1 MiB each: the smallest GPT with something DeepSpeed swaps
    cfg = TrainConfig(vocab=64, d_model=256, layers=1, heads=4, seq_len=16, micro_batch=2, lr=1e-3)
    (run,) = offload.run_nvme_offload(cfg, steps=3, devices=("nvme",), folder=tmp_path, timeout=1800)
    assert run.device == "nvme" and run.read > 0 and run.write > 0
    assert run.result.nvme_params == run.model.swapped_params == 2
    assert all(math.isfinite(x) for x in run.result.losses)
    assert not list(tmp_path.iterdir())  # the swap files are removed


def test_warmup_skips_the_aio_op_in_one_line_with_the_fix(monkeypatch, tmp_path):
    from teraflops.course import warmup

    monkeypatch.setattr(ops, "_include_dirs", lambda: [tmp_path])
    line = warmup.build_warm_aio(tmp_path / "warm")
    assert line.startswith("skipped DeepSpeed's async_io op") and "apt-get install libaio-dev" in line
    assert "\n" not in line


def test_doctor_lists_the_missing_libaio_with_its_fix(monkeypatch, tmp_path):
    from teraflops.compilation import loadgen, serving
    from teraflops.course import doctor

    for module in (serving, loadgen):  # their checks start processes
        monkeypatch.setattr(module, "why_not", lambda: None)
    monkeypatch.setattr(ops, "_include_dirs", lambda: [tmp_path])
    lines = [s for s in doctor.skipped() if "NVMe offload" in s]
    assert len(lines) == 1 and "apt-get install libaio-dev" in lines[0]
    monkeypatch.setattr(ops, "_include_dirs", lambda: [Path("/usr/include")])
    if ops.aio_unavailable() is None:
        assert not any("NVMe offload" in s for s in doctor.skipped())
