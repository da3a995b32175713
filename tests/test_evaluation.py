"""The held-out evaluation (harness/loop/evaluation.py): ``train.eval_batch_size`` problems per call, the same
completions and metrics whatever the calls' size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import harness.loop.evaluation
from harness.loop.build import setup_run
from harness.loop.evaluation import evaluate
from harness.tasks import Score
from tests.helpers.tiny import tiny_run


@pytest.mark.slow
@pytest.mark.parametrize("pass_k", [0, 2])
def test_the_evaluation_decodes_eval_batch_size_problems_per_call_with_the_same_results(tmp_path, monkeypatch,
                                                                                         pass_k):
    calls, sampled_texts, real = [], [], harness.loop.evaluation.sample_problems

    def spy(policy, tokenizer, problems, *a, **k):
        calls.append((len(problems), k.get("group_size")))
        out = real(policy, tokenizer, problems, *a, **k)
        if not k.get("greedy"):
            sampled_texts[-1].extend(out.texts)
        return out

    monkeypatch.setattr(harness.loop.evaluation, "sample_problems", spy)
    results, sizes = [], []
    for size in (64, 3):
        run = tiny_run(tmp_path, f"train.eval_batch_size={size}", f"train.pass_k={pass_k}")  # 8 eval problems
        setup = setup_run(run, torch.device("cpu"))
        calls.clear()
        sampled_texts.append([])
        results.append(evaluate(setup.policy, setup.tokenizer, setup.task, run, step=0))
        sizes.append(list(calls))
    sampled = [] if not pass_k else [(8, 2)]  # pass@2: 32 completions per call at 64; 1 problem (2 of them) at 3
    assert sizes[0] == [(8, 1), *sampled]
    assert sizes[1] == [(3, 1), (3, 1), (2, 1), *([(1, 2)] * 8 if pass_k else [])]
    (row64, records64), (row3, records3) = results
    assert records3 == records64  # the same greedy completions, scores and problem numbers
    assert row3["eval_accuracy"] == row64["eval_accuracy"]
    if pass_k:  # sampled: other calls draw other completions (so with pass@k eval_batch_size is part of the run id:
        # harness/run/config.py memory_settings), only that it is measured
        assert 0 <= row3["eval_pass_at_2"] <= 1 and sampled_texts[0] != sampled_texts[1]


def test_pass_at_k_leaves_torch_random_stream_as_it_found_it(tmp_path):
    """pass@k samples from its own seeded stream; the global one, which TRL's generation draws the next rollout
    from, is left as it was, so a TRL run with train.pass_k trains as the same run without it."""
    run = tiny_run(tmp_path, "train.pass_k=2", "task.eval_size=4")
    setup = setup_run(run, torch.device("cpu"))
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = evaluate(setup.policy, setup.tokenizer, setup.task, run, step=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert evaluate(setup.policy, setup.tokenizer, setup.task, run, step=0) == first  # pass@k still seeded by step


class FakeEvalTask:
    """Five eval problems; a completion "<problem> <sample>" is correct for its own problem only: greedy (sample 0)
    for problems 0 and 2, pass@k's first sample for problem 1, its second for problem 4; formatted for problems 0-3;
    "strict" only problem 0."""

    def eval_problems(self):
        return [SimpleNamespace(id=i, answer=str(10 + i)) for i in range(5)]

    def score(self, text, problem):
        pid, sample = map(int, text.split())
        right = {0: pid in (0, 2), 1: pid == 1, 2: pid == 4}[sample]
        return Score(correct=float(pid == problem.id and right), format=float(pid < 4))

    def eval_scores(self, text, problem):
        return {"strict": float(text.startswith("0 "))}


def test_the_evaluation_scores_each_problem_greedily_and_pass_at_k_by_any_of_k(tmp_path, monkeypatch):
    """Greedy calls at train.eval_max_new_tokens; eval_accuracy from correctness (not format), each named scoring,
    eval_samples' records as sampled; pass@k solved when any of a problem's own k completions is correct; pass@k's
    draws seeded by the eval's step."""
    calls = []

    def sample(policy, tokenizer, problems, train, group_size, max_new_tokens, greedy=False):
        calls.append((len(problems), group_size, max_new_tokens, greedy, torch.initial_seed()))
        texts = [f"{p.id} {0 if greedy else j + 1}" for p in problems for j in range(group_size)]
        truncated = torch.tensor([p.id % 2 == 1 for p in problems for _ in range(group_size)])
        return SimpleNamespace(texts=texts, truncated=truncated)

    monkeypatch.setattr(harness.loop.evaluation, "sample_problems", sample)
    run = tiny_run(tmp_path, "train.eval_batch_size=4", "train.pass_k=2", "train.eval_max_new_tokens=5")
    policy = SimpleNamespace(device=torch.device("cpu"))
    row, records = evaluate(policy, None, FakeEvalTask(), run, step=2)
    assert row == {"eval_accuracy": 0.4, "eval_accuracy_strict": 0.2, "eval_pass_at_2": 0.4}
    assert [c[:4] for c in calls] == [(4, 1, 5, True), (1, 1, 5, True), (2, 2, 5, False), (2, 2, 5, False),
                                      (1, 2, 5, False)]
    assert [(r["problem"], r["correct"], r["correct_strict"], r["format"], r["truncated"]) for r in records] == [
        (0, 1.0, 1.0, 1.0, False), (1, 0.0, 0.0, 1.0, True), (2, 1.0, 0.0, 1.0, False), (3, 0.0, 0.0, 1.0, True),
        (4, 0.0, 0.0, 0.0, False)]
    assert all(r["step"] == 2 and r["answer"] == str(10 + r["problem"]) for r in records)
    seeded = calls[2][4]
    calls.clear()
    evaluate(policy, None, FakeEvalTask(), run, step=4)
    assert calls[2][4] != seeded  # another eval's pass@k draws


@pytest.mark.parametrize("overrides, rows, what, held", [
    (["train.eval_batch_size=64"], 8, "greedy calls of train.eval_batch_size=64", True),  # 8 eval problems
    (["train.eval_batch_size=3", "train.pass_k=4"], 4, "pass@k: train.pass_k=4 completions for each of 1 problem ",
     True),
    (["train.eval_batch_size=8", "train.pass_k=2"], 8, "greedy calls", True),  # 4 problems x 2 = 8, not more
    (["backend=trl"], 8, "greedy calls", False),  # TRL's processes hold the policy alone
])
def test_the_eval_memory_check_sizes_the_largest_call(tmp_path, monkeypatch, overrides, rows, what, held):
    seen = []
    monkeypatch.setattr(harness.loop.evaluation, "sampling_memory_problem",
                        lambda run, n, text, held: seen.append((n, text, held)))
    harness.loop.evaluation.check_eval_memory(tiny_run(tmp_path, *overrides))
    assert len(seen) == 1 and seen[0][0] == rows and seen[0][1].startswith(what) and seen[0][2] is held
