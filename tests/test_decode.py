"""Unit 4 §1-2: KV-cache decode, launches per token, torch.compile (teraflops.decode)."""

import pytest
import torch

from teraflops import decode as D
from teraflops.errors import CourseError, ShapeError
from teraflops.models import GPT


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=24).eval()


def test_cached_logits_match_full_forward(model):
    tokens = torch.randint(0, 64, (3, 20))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(3)
        parts = [model(tokens[:, :7], cache=cache, input_pos=torch.arange(7))]
        for i in range(7, 20):
            parts.append(model(tokens[:, i:i + 1], cache=cache, input_pos=torch.tensor([i])))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_uncached_forward_unchanged(model):
    tokens = torch.randint(0, 64, (2, 10))
    assert model(tokens).shape == (2, 10, 64)


def test_generate_greedy_matches_uncached_argmax(model):
    prompt = torch.randint(0, 64, (2, 5))
    g = D.generate(model, prompt, 6)
    assert g.tokens.shape == (2, 11) and len(g.step_seconds) == 5
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(g.tokens, seq)


@pytest.mark.parametrize("prompt,new,err,match", [
    (torch.zeros(2, 4), 3, CourseError, "int64"),
    (torch.zeros(4, dtype=torch.long), 3, ShapeError, "batch, prompt_len"),
    (torch.zeros(1, 20, dtype=torch.long), 5, ShapeError, "max_seq_len 24"),
])
def test_prompt_errors(model, prompt, new, err, match):
    with pytest.raises(err, match=match):
        D.generate(model, prompt, new)


def test_eager_launch_count(model):
    n = D.launches_per_token(D.decode_step, model, model.new_cache(1))
    assert n.by_name["aten::linear"] == 4 * 2 + 1  # 4 per block, plus the head
    assert n.total > 20


def test_bytes_per_step(model):
    cache = model.new_cache(2)
    expected = (model.num_params() - 24 * 32) * 4 + 2 * 2 * 2 * 24 * 32 * 4
    assert D.decode_bytes_per_step(model, cache) == expected


def test_graph_break_from_item(model):
    r = D.graph_break_demo(model, model.new_cache(1))
    assert r.graph_break_count >= 1 and r.graph_count >= 2
    assert any("item" in reason for reason in r.reasons)


@pytest.mark.slow
def test_recompile_on_new_shape():
    assert D.recompile_demo((8, 9, 10), dynamic=False).compiles == 3
    assert D.recompile_demo((8, 9, 10), dynamic=None).compiles == 2


@pytest.mark.slow
def test_compiled_decode_fewer_launches_same_tokens(model):
    prompt = torch.randint(0, 64, (2, 4))
    cache = model.new_cache(2)
    compiled = D.compile_decode(model, cache)
    assert compiled.mode is None and compiled.compile_seconds > 0
    eager = D.generate(model, prompt, 10)
    fast = D.generate(model, prompt, 10, compiled.step, cache=cache)
    assert torch.equal(eager.tokens, fast.tokens)
    n_eager = D.launches_per_token(D.decode_step, model, cache).total
    n_compiled = D.launches_per_token(compiled.step, model, cache).total
    assert any("cpp_fused" in k for k in D.launches_per_token(compiled.step, model, cache).by_name)
    assert n_compiled < n_eager
