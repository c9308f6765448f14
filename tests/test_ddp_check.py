"""The hand-built DDP checks (Unit 2, exercises 8 and 9) pass the reference classes and name plausible mistakes.

Launched checks start real gloo ranks (~15-30 s each on 2 busy CPU cores); the mistakes the
acceptance criteria name are launched, the others judged from reports like the ranks write.
"""

import pytest
import torch

from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit02 as check
from teraflops.launch.placement import data_parallel_plan
from teraflops.parallelization.hand_ddp import DDPBucketed, DDPOverlap, DdpCheckResult, TiedLM, tied_lm

from test_zero1_check import notebook_class, solution_cell

# The solution notebook's answers, kept in the package for the lecture's overlap comparison.
OVERLAP, BUCKETED = check.class_source(DDPOverlap), check.class_source(DDPBucketed)


def edited(source: str, name: str, *old_new: str) -> type:
    for old, new in zip(old_new[::2], old_new[1::2]):
        assert old in source, old
        source = source.replace(old, new)
    return notebook_class(source, name)


def fails(check_fn, cls, *phrases: str) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check_fn(cls)
    msg = str(e.value)
    assert msg.startswith(f"Exercise {check_fn.exercise.number} ("), msg
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


# --- launched checks ------------------------------------------------------------------------------

@pytest.mark.slow
def test_references_pass(capsys):
    check.ddp_overlap(notebook_class(OVERLAP, "DDPOverlap"))
    check.ddp_bucketed(notebook_class(BUCKETED, "DDPBucketed"))
    out = capsys.readouterr().out
    assert "✓ Exercise 8 (DDP overlapped with backward): passed" in out
    assert "✓ Exercise 9 (DDP with gradient buckets): passed" in out


@pytest.mark.slow
def test_reference_passes_on_4_ranks(monkeypatch, capsys):
    monkeypatch.setattr(check, "data_parallel_plan", lambda ranks_cpu=None: data_parallel_plan(ranks_cpu=4))
    check.ddp_overlap(notebook_class(OVERLAP, "DDPOverlap"))
    assert "passed" in capsys.readouterr().out


@pytest.mark.slow
def test_hook_reading_grad_before_accumulation_fails():
    cls = edited(OVERLAP, "DDPOverlap", "p.register_post_accumulate_grad_hook(self._launch)",
                 "p.register_hook(lambda grad, p=p: self._launch(p))")
    fails(check.ddp_overlap, cls, "raised", "Hint: a hook registered with register_hook runs before the gradient")


@pytest.mark.slow
def test_no_wait_before_step_fails():
    cls = edited(OVERLAP, "DDPOverlap", "            handle.wait()\n", "")
    fails(check.ddp_overlap, cls, "not waited on", "call .wait() on every one")


@pytest.mark.slow
def test_summed_gradients_fail():
    cls = edited(OVERLAP, "DDPOverlap", "            p.grad /= self.world\n", "")
    fails(check.ddp_overlap, cls, "match DDP fed the sum of the gradients", "divide each gradient by the world size")


# --- without launching ----------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(check, "launch", lambda *a, **k: pytest.fail("the check launched ranks"))


@pytest.mark.parametrize("source, name, check_fn", [(OVERLAP, "DDPOverlap", check.ddp_overlap),
                                                    (BUCKETED, "DDPBucketed", check.ddp_bucketed)])
def test_placeholder_is_not_attempted_without_launching(no_launch, source, name, check_fn):
    from teraflops.course.labs import strip_solution

    with pytest.raises(NotAttempted, match="not attempted"):
        check_fn(notebook_class(strip_solution(solution_cell(source)), name))


def test_tied_model_has_one_parameter_for_two_uses():
    model = TiedLM()
    assert model.head.weight is model.emb.weight
    assert [p.numel() for p in model.parameters()] == [512, 384, 24, 384, 16]
    assert not torch.equal(tied_lm(0).emb.weight, tied_lm(1).emb.weight)  # only a broadcast makes ranks equal


def test_the_bucket_sizes_give_one_and_several_buckets():
    cap = [int(mb * 1e6 / 4) for mb in check.BUCKET_SIZES_MB]
    total, largest = sum(p.numel() for p in TiedLM().parameters()), 512
    assert cap[0] >= total and largest <= cap[1] < total


# --- judging reports, without launching ------------------------------------------------------------

SIZES = [512, 384, 24, 384, 16]


def reports(n: int = 2, bucket_mb=None, **change) -> list:
    from teraflops.launch.wire import from_json

    psi = sum(SIZES)
    g = torch.Generator().manual_seed(0)
    initial = torch.randn(psi, generator=g)
    ref = initial + 0.01 * torch.randn(psi, generator=g)
    calls = len(SIZES) if bucket_mb is None else (1 if bucket_mb >= 1 else 2)
    out = []
    for r in range(n):
        run = {"bucket_mb": bucket_mb, "wrapped": initial.tolist(), "params": ref.tolist(),
               "backward_calls": [calls] * 5, "finish_calls": [0] * 5,
               "largest": 512 if calls == len(SIZES) else (psi if calls == 1 else 808), "unwaited": 0,
               "ref": ref.tolist(), "single": ref.tolist(), "summed": (ref + 0.01).tolist(), "initial": initial.tolist()}
        run.update({k: v(r, run) if callable(v) else v for k, v in change.items()})
        out.append({"rank": r, "world_size": n, "backend": "gloo", "device": "cpu", "error": None, "runs": [run],
                    "sizes": SIZES})
    return [from_json(DdpCheckResult, rep) for rep in out]


def judged(results) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check._judge_ddp(results)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_judge_passes_correct_reports():
    for n in (2, 4):
        for mb in (None, 1.0, 0.004):
            check._judge_ddp(reports(n, mb))


@pytest.mark.parametrize("bucket_mb, change, phrase", [
    (None, {"wrapped": lambda r, run: [x + r for x in run["wrapped"]]},
     "right after wrapping, rank 1's parameters differ from rank 0's"),
    (None, {"unwaited": 5}, "5 asynchronous all-reduce(s) not waited on"),
    (None, {"backward_calls": [0] * 5, "finish_calls": [5] * 5}, "after backward(), in finish_gradient_synchronization()"),
    (None, {"backward_calls": [6] * 5}, "the tied embedding/output weight is one parameter"),
    (None, {"backward_calls": [4] * 5}, "some gradients were never averaged"),
    (None, {"params": lambda r, run: run["summed"]}, "match DDP fed the sum of the gradients"),
    (None, {"params": lambda r, run: run["ref"] if r == 0 else run["initial"]}, "the ranks hold different parameters"),
    (None, {"params": lambda r, run: [x + 1e-3 for x in run["ref"]]}, "differ from DistributedDataParallel's"),
    (None, {"single": lambda r, run: [x + 1e-3 for x in run["ref"]] if run["single"] else None},
     "differ from one process on the global batch"),
    (0.004, {"backward_calls": [5] * 5, "largest": 512}, "one per parameter, not per bucket"),
    (0.004, {"backward_calls": [1] * 5, "largest": 1320}, "a bucket may hold at most 1,000 fp32 elements"),
])
def test_judge_names_the_mistake(bucket_mb, change, phrase):
    assert phrase in judged(reports(2, bucket_mb, **change))


def test_judge_hints_register_hook_for_a_none_grad():
    from teraflops.launch.wire import from_json

    error = {"where": "backward() (your hooks)", "type": "TypeError",
             "message": "unsupported operand type(s) for /=: 'NoneType' and 'int'", "time": 1.0}
    results = [from_json(DdpCheckResult, {"rank": r, "world_size": 2, "backend": "gloo", "device": "cpu",
                                          "error": error, "runs": [], "sizes": SIZES}) for r in range(2)]
    assert "Hint: a hook registered with register_hook runs before" in judged(results)


@pytest.mark.slow
def test_overlap_comparison_counts_the_launches():
    from teraflops.models import GPT
    from teraflops.parallelization import hand_ddp
    from teraflops.sizing import dp_config

    after, per_param, bucketed = hand_ddp.overlap(ranks=2, steps=2)
    cfg = dp_config(data_parallel_plan(ranks_cpu=2).preset)
    params = len(list(GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len).parameters()))
    assert (after["mode"], per_param["mode"], bucketed["mode"]) == ("after backward", "per parameter", "bucketed")
    assert after["calls"] == per_param["calls"] == params and after["in_backward"] == 0
    assert per_param["in_backward"] == params
    assert 4 <= bucketed["calls"] < params and bucketed["in_backward"] == bucketed["calls"]
    assert all(r["backward_s"] > 0 and r["wait_s"] >= 0 and r["step_s"] > 0 for r in (after, per_param, bucketed))


def test_the_solution_notebook_answers_are_the_packages_references():
    """The lecture times the package's classes; the lab's answers must be the same code."""
    import nbformat
    from pathlib import Path

    from teraflops.course.labs import BEGIN, END

    nb = nbformat.read(Path(__file__).resolve().parents[1] / "solutions" / "02_parallelization.ipynb", as_version=4)
    for source in (OVERLAP, BUCKETED):
        cell = next(c.source for c in nb.cells if c.source.startswith(source.split("(", 1)[0]))
        answer = "\n".join(line for line in cell.splitlines() if line.strip() not in (BEGIN, END))
        assert answer.strip() == source.strip()
