import torch

from teraflops.memory import peak_memory
from teraflops.timing import benchmark, format_seconds

MiB = 2**20


def test_benchmark_orders_small_and_large_work():
    a, b = torch.randn(16, 16), torch.randn(1024, 1024)  # 250,000× the FLOPs
    small = benchmark(lambda: a @ a, min_run_time=0.05)
    large = benchmark(lambda: b @ b, min_run_time=0.05)
    assert 0 < small.median < large.median
    assert small.runs >= 1 and small.iqr >= 0


def test_format_seconds():
    assert format_seconds(1.5) == "1.5 s"
    assert format_seconds(2.5e-6) == "2.5 µs"


def test_cpu_peak_counts_a_live_allocation():
    peak, out = peak_memory(lambda: torch.empty(8 * MiB // 4), "cpu")
    assert 8 * MiB <= peak < 9 * MiB
    assert out.numel() == 8 * MiB // 4


def test_cpu_peak_counts_temporaries_at_their_highest_level():
    def work():
        for _ in range(3):
            t = torch.ones(4 * MiB // 4)
            del t  # freed before the next one: the level never exceeds one tensor
        a = torch.ones(2 * MiB // 4)
        b = torch.ones(2 * MiB // 4)
        return a + b

    peak, _ = peak_memory(work, "cpu")
    assert 6 * MiB <= peak < 7 * MiB  # a, b and the sum live at once


def test_a_run_measures_the_ceilings_once_and_every_unit_reads_them(tmp_path, monkeypatch):
    """Unit 0 and Unit 1 of one run measured their own, different ceilings."""
    import json

    import torch

    from teraflops import ceilings
    from teraflops.sizing import preset

    p = preset()
    shared = ceilings.Ceilings(1.5e11, 7e9, p.dtype, "cpu", p.probe.matmul_n, p.probe.copy_bytes)
    path = tmp_path / "ceilings.json"
    path.write_text(json.dumps(shared.to_json()))
    monkeypatch.setenv(ceilings.SHARED_ENV, str(path))
    got = ceilings.measure_ceilings(device="cpu")
    assert (got.peak_flops, got.bandwidth) == (1.5e11, 7e9) and got.source == ceilings.SHARED_SOURCE
    assert "measured once" in str(got)
    other = ceilings.measure_ceilings(matmul_n=64, copy_bytes=2**16, dtype=torch.float64, device="cpu")
    # another probe is measured (on a busy machine: this machine's quiet values of that probe, labelled so)
    assert other.source != ceilings.SHARED_SOURCE and other.peak_flops != 1.5e11


def test_cpu_peak_counts_the_regions_own_allocations_not_frees_of_earlier_tensors():
    """The docstring promised "above what was live before"; on a CPU frees of tensors from
    before the region are not recorded, so the region's own allocations are what is counted."""
    import torch

    from teraflops.memory import peak_memory

    earlier = [torch.empty(2**20, dtype=torch.uint8)]

    def region():
        earlier.pop()  # live memory falls by 1 MiB here, unseen by the profiler
        return torch.empty(2**20, dtype=torch.uint8)

    peak, _ = peak_memory(region, "cpu")
    assert peak >= 2**20  # the documented upper bound, not the 0 bytes of rise above what was live
    assert "above what was live before it" not in peak_memory.__doc__


def test_cpu_peak_skips_the_free_of_a_block_an_earlier_profiler_saw_allocated():
    """A block allocated under an earlier profiler has a size the allocator knows, so its free inside
    the region is reported (seen in the full suite as a peak 256 bytes short of the region's 1 MiB)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from teraflops.memory import peak_memory

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        earlier = [torch.empty(256, dtype=torch.uint8)]

    def region():
        earlier.pop()
        mine = torch.empty(2**20, dtype=torch.uint8)
        del mine
        return torch.empty(2**20, dtype=torch.uint8)

    peak, _ = peak_memory(region, "cpu")
    assert peak == 2**20


def test_fake_memory_counts_live_and_peak_bytes_without_allocating():
    from teraflops.memory import fake_memory

    with fake_memory() as mem:
        a = torch.empty(2**40, dtype=torch.uint8)  # 1 TiB: counted, never allocated
        assert mem.live == 2**40
        b = a[:10]  # a view shares the storage: no new bytes
        c = torch.ones(1000, dtype=torch.float32) * 2  # the ones are freed at once
        del a, b
        assert mem.live == 4000 and mem.peak == 2**40 + 8000
        assert mem.reset_peak() == 4000 and mem.peak == 4000
        del c


def test_fake_memory_of_a_training_step_is_weights_grads_and_saved_activations():
    from teraflops.memory import fake_memory

    with fake_memory() as mem:
        lin = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weight
        assert mem.live == 4 * MiB
        x = torch.empty(256, 1024)  # 1 MiB
        lin(x).sum().backward()  # output (1 MiB, freed) and the weight's gradient (4 MiB, kept)
        assert mem.live == 9 * MiB and 9 * MiB <= mem.peak <= 11 * MiB
