"""Unit 4 §1-2: KV-cache decode, launches per token, torch.compile (teraflops.compilation.decode)."""

import pytest
import torch

from teraflops.compilation import decode as D
from teraflops.errors import CourseError, ShapeError
from teraflops.models import GPT, Llama
from teraflops.sizing import PRESETS


@pytest.fixture(scope="module")
def model():
    """The Unit 4 decode model (Llama-style), small."""
    return Llama(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24, seed=0).eval()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24).eval()


def _cached_logits(m, tokens, split=7):
    cache = m.new_cache(tokens.shape[0])
    parts = [m(tokens[:, :split], cache=cache, input_pos=torch.arange(split))]
    for i in range(split, tokens.shape[1]):
        parts.append(m(tokens[:, i:i + 1], cache=cache, input_pos=torch.tensor([i])))
    return torch.cat(parts, 1)


@pytest.mark.parametrize("which", ["model", "gpt"])
def test_cached_logits_match_full_forward(which, request):
    m = request.getfixturevalue(which)
    tokens = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_cached_logits(m, tokens), m(tokens), atol=1e-5, rtol=1e-5)


def test_llama_is_causal_and_deterministic(model):
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 64)
    torch.testing.assert_close(a[:, :8], b[:, :8])  # no position sees the future
    again = Llama(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert model.head.weight is not model.tok.weight  # untied, as in LLaMA


def test_llama_rejects_odd_head_dim():
    with pytest.raises(ShapeError, match="even head_dim"):
        Llama(d_model=30, n_heads=2)


def test_uncached_gpt_forward_unchanged(gpt):
    tokens = torch.randint(0, 64, (2, 10))
    assert gpt(tokens).shape == (2, 10, 64)


@pytest.mark.parametrize("which", ["model", "gpt"])
def test_generate_greedy_matches_uncached_argmax(which, request):
    m = request.getfixturevalue(which)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    g = D.generate(m, prompt, 6)
    assert g.tokens.shape == (2, 11) and len(g.step_seconds) == 5
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(g.tokens, seq)


@pytest.mark.parametrize("prompt,new,err,match", [
    (torch.zeros(2, 4), 3, CourseError, "int64"),
    (torch.zeros(4, dtype=torch.long), 3, ShapeError, "batch, prompt_len"),
    (torch.zeros(1, 20, dtype=torch.long), 5, ShapeError, "max_seq_len 24"),
])
def test_prompt_errors(model, prompt, new, err, match):
    with pytest.raises(err, match=match):
        D.generate(model, prompt, new)


def test_eager_launch_count(model, gpt):
    n = D.launches_per_token(D.decode_step, model, model.new_cache(1))
    assert n.by_name["aten::linear"] == 7 * 2 + 1  # q, k, v, o, w1, w2, w3 per block, plus the head
    assert n.by_name["aten::rsqrt"] == 2 * 2 + 1  # one per RMSNorm
    assert not any(name[6:] in D.METADATA_OPS for name in n.by_name)  # views are not launches
    g = D.launches_per_token(D.decode_step, gpt, gpt.new_cache(1))
    assert g.by_name["aten::linear"] == 4 * 2 + 1 and g.total < n.total


def test_bytes_per_step(model, gpt):
    cache = gpt.new_cache(2)  # GPT: tied head reads the token table; the position table is a lookup
    expected = (gpt.num_params() - 24 * 32) * 4 + 2 * 2 * 2 * 24 * 32 * 4
    assert D.decode_bytes_per_step(gpt, cache) == expected
    cache = model.new_cache(2)  # Llama: untied, so the token table is the lookup
    expected = (model.num_params() - 64 * 32) * 4 + 2 * 2 * 2 * 24 * 32 * 4
    assert D.decode_bytes_per_step(model, cache) == expected


def test_decode_model_from_preset():
    from teraflops.sizing import preset

    p = preset("tiny")
    m = D.decode_model(p)
    assert isinstance(m, Llama) and not m.training and m.max_seq_len == p.decode.max_seq_len


def test_graph_break_from_item(model):
    r = D.graph_break_demo(model, model.new_cache(1))
    assert r.graph_break_count >= 1 and r.graph_count >= 2
    assert any("item" in reason for reason in r.reasons)


@pytest.mark.slow
def test_recompile_on_new_shape():
    assert D.recompile_demo((8, 9, 10), dynamic=False).compiles == 3
    assert D.recompile_demo((8, 9, 10), dynamic=None).compiles == 2


@pytest.mark.slow
def test_compiled_decode_3x_fewer_launches_same_tokens(model):
    """The acceptance: compiled decode launches ≤ 1/3 of eager's per token, same greedy tokens."""
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(2)
    compiled = D.compile_decode(model, cache)
    assert compiled.mode is None and compiled.compile_seconds > 0
    eager = D.generate(model, prompt, 10)
    fast = D.generate(model, prompt, 10, compiled.step, cache=cache)
    assert torch.equal(eager.tokens, fast.tokens)
    n_eager = D.launches_per_token(D.decode_step, model, cache)
    n_compiled = D.launches_per_token(compiled.step, model, cache)
    assert any("cpp_fused" in k for k in n_compiled.by_name)
    assert 3 * n_compiled.total <= n_eager.total, (n_eager.total, n_compiled.total)


def test_batch_sweep_stops_at_out_of_memory_with_a_warning():
    model = D.decode_model(PRESETS["tiny"])

    def step(m, cache, token, pos):  # stands in for a GPU running out of memory at batch 4
        if cache.batch >= 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return D.decode_step(m, cache, token, pos)

    with pytest.warns(UserWarning, match="batch 4: out of memory"):
        rows = D.batch_sweep(model, (1, 2, 4, 8), step_fn=step, bandwidth=1e10, min_run_time=0.01)
    assert [r.batch for r in rows] == [1, 2]


@pytest.mark.parametrize("make", [lambda: GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24),
                                  lambda: Llama(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24, seed=0)])
def test_num_params_counts_zero3_partitioned_parameters(make):
    """The Unit 6 trace worker counted parameters after ZeRO-3's initialize and read 0.
    DeepSpeed empties a partitioned parameter (numel() 0) and keeps its size as ds_numel."""
    model = make()
    full = model.num_params()
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    assert model.num_params() == full > 0


@pytest.mark.slow
def test_recompile_reasons_name_the_guard_of_the_graph_that_last_ran():
    """The second recompile was attributed to guard 0/0 (expected 8), not 0/1 (expected 9)."""
    assert D._newest_failure("Recompiling function f\n    triggered by the following guard failure(s):\n"
                             "    - 0/1: tensor 'x' size mismatch at index 0. expected 9, actual 10\n"
                             "    - 0/0: tensor 'x' size mismatch at index 0. expected 8, actual 10") \
        == "- 0/1: tensor 'x' size mismatch at index 0. expected 9, actual 10"
    reasons = D.recompile_demo((8, 9, 10), dynamic=False).reasons
    assert [r.split(":")[0] for r in reasons] == ["- 0/0", "- 0/1"] and "expected 9, actual 10" in reasons[1]


def test_generate_moves_a_prompt_to_the_model_device():
    # A GPU model with a prompt made by torch.randint on the CPU: `meta` stands in for the GPU.
    meta = Llama(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24, seed=0).to("meta").eval()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    out = D.generate(meta, prompt, 4)
    assert out.tokens.device.type == "meta" and tuple(out.tokens.shape) == (2, 9)
    logits = D.prefill(meta, meta.new_cache(2), prompt)
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, 64)


def test_batch_sweep_frees_each_cache_before_the_next_is_allocated():
    import gc
    import weakref

    model = D.decode_model(PRESETS["tiny"])
    made, alive_at_alloc = [], []
    new_cache = model.new_cache

    def tracked(batch, *args, **kwargs):  # records whether an earlier batch's cache is still alive
        gc.collect()
        alive_at_alloc.append([r() is not None for r in made])
        cache = new_cache(batch, *args, **kwargs)
        made.append(weakref.ref(cache))
        return cache

    model.new_cache = tracked
    rows = D.batch_sweep(model, (1, 2, 4), bandwidth=1e10, min_run_time=0.01)
    assert [r.batch for r in rows] == [1, 2, 4]
    assert alive_at_alloc == [[], [False], [False, False]], "the sweep kept a previous KV cache alive"


def test_batch_sweep_releases_memory_after_the_except_block(monkeypatch):
    import gc
    import sys
    import weakref

    from teraflops.model_definition import attention

    model = D.decode_model(PRESETS["tiny"])
    caches, seen = [], []

    class InjectedOOM(RuntimeError):  # stands in for torch.cuda.OutOfMemoryError
        pass

    def step(m, cache, token, pos):
        caches.append(weakref.ref(cache))
        if cache.batch >= 2:
            raise InjectedOOM("CUDA out of memory. Tried to allocate 2.00 GiB")
        return D.decode_step(m, cache, token, pos)

    def release(device):  # what empty_cache would see: no exception in flight, the failed cache gone
        gc.collect()
        seen.append((sys.exc_info()[0], caches[-1]() is None))

    monkeypatch.setattr(attention, "release_cached_memory", release)
    with pytest.warns(UserWarning, match="batch 2: out of memory"):
        rows = D.batch_sweep(model, (1, 2, 4), step_fn=step, bandwidth=1e10, min_run_time=0.01)
    assert [r.batch for r in rows] == [1]
    assert seen == [(None, True)], seen


def test_cuda_launches_are_the_cpu_side_launch_calls():
    # A synthetic GPU profile of a compiled, CUDA-graph step: one cudaGraphLaunch replays 40 kernels;
    # a Triton kernel outside the graph goes through cuLaunchKernelEx, an extern GEMM through cudaLaunchKernel.
    from types import SimpleNamespace as E

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = ([E(name="cudaGraphLaunch", cpu_parent=None, device_type=cpu)]
              + [E(name=f"triton_poi_fused_{i}", cpu_parent=None, device_type=cuda) for i in range(40)]
              + [E(name="cuLaunchKernelEx", cpu_parent=None, device_type=cpu),
                 E(name="cudaLaunchKernel_v7000", cpu_parent=None, device_type=cpu),
                 E(name="cudaMemcpyAsync", cpu_parent=None, device_type=cpu),
                 E(name="cudaStreamSynchronize", cpu_parent=None, device_type=cpu),
                 E(name="triton_red_fused_0", cpu_parent=None, device_type=cuda),
                 E(name="ampere_sgemm_64x32", cpu_parent=None, device_type=cuda)])
    n = D.count_launches(events, "cuda")
    assert n.total == 3, n
    assert n.by_name == {"cudaGraphLaunch": 1, "cuLaunchKernelEx": 1, "cudaLaunchKernel_v7000": 1}
    assert "42 kernels ran on the GPU" in n.what


@pytest.mark.slow
def test_compiled_batch_sweep_compiles_every_batch_size_past_the_recompile_limit():
    # 9 batch sizes at dynamic=False are 9 compiles of the same step: one more than dynamo's default
    # recompile limit of 8, past which the last batch would silently be timed in eager mode.
    from torch._dynamo.utils import counters

    model = Llama(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, seed=0).eval()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(D.decode_step, backend="eager", dynamic=False)  # dynamo only: no Inductor codegen
    batches = tuple(range(1, 10))
    rows = D.batch_sweep(model, batches, step_fn=step, bandwidth=1e10, min_run_time=0.0)
    assert [r.batch for r in rows] == list(batches)
    assert int(counters["stats"]["unique_graphs"]) == len(batches), dict(counters["stats"])
    torch._dynamo.reset()
