"""The held-out evaluation (harness/loop/evaluation.py): ``train.eval_batch_size`` problems per call, the same
completions and metrics whatever the calls' size."""

from __future__ import annotations

import pytest
import torch

import harness.loop.evaluation
from harness.loop.build import setup_run
from harness.loop.evaluation import evaluate
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
