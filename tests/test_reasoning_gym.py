"""The reasoning_gym task: problems, answers and scores from the library, seeded, disjoint eval, clear errors."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("reasoning_gym")

import reasoning_gym  # noqa: E402
from reasoning_gym.factory import DATASETS  # noqa: E402

from harness.run.config import load_experiment, run_configs  # noqa: E402
from harness.run.errors import ConfigError
from harness.tasks import Problem, Score, available_tasks, get_task, reasoning_gym_datasets  # noqa: E402

PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def small(**kwargs):
    return get_task("reasoning_gym", **{"dataset": "chain_sum", "params": PARAMS, "train_size": 200,
                                        "eval_size": 16, **kwargs})


def test_problems_and_answers_come_from_the_library(capsys):
    task = small()
    library = reasoning_gym.create_dataset("chain_sum", **PARAMS, seed=0, size=10)
    first = task.eval_problems()[0]
    task.train_problems()  # generated once, said once: sudoku's 10000 took minutes without a line (the seventh pass)
    assert capsys.readouterr().err == ("reasoning_gym chain_sum: generating 16 eval and 200 training problems (once "
                                       "per process)\n")
    assert first.question == library[0]["question"] + ' Answer after "####".'
    assert first.answer == library[0]["answer"] and first.solution == f"#### {library[0]['answer']}"
    assert "reasoning_gym" in available_tasks()
    assert {"chain_sum", "countdown", "spell_backward"} <= set(reasoning_gym_datasets())


def test_scoring_calls_the_library_score_answer(monkeypatch):
    task = small()
    problem = task.eval_problems()[0]
    assert task.score(problem.solution, problem) == Score(1.0, 1.0)
    assert task.score(f"reasoning... ####  {problem.answer}\n", problem) == Score(1.0, 1.0)
    assert task.score(f"#### {problem.answer} #### {int(problem.answer) + 1}", problem) == Score(0.0, 1.0)
    assert task.score(f"#### {int(problem.answer) + 1} #### {problem.answer}", problem) == Score(1.0, 1.0)  # the last
    assert task.score(problem.answer, problem) == Score(0.0, 0.0)  # no marker: no answer
    assert task.score("####   ", problem) == Score(0.0, 0.0)
    calls = []

    def fake(self, answer, entry):
        calls.append((type(self).__name__, answer, entry["answer"], bool(entry["metadata"])))  # the library's item
        return 0.5

    monkeypatch.setattr(DATASETS["chain_sum"][0], "score_answer", fake)  # the library's class, not ours
    for threshold, correct in ((1.0, 0.0), (0.5, 1.0)):  # partial credit: correct only at or above threshold
        patched = small(threshold=threshold, score_timeout_s=0)  # in this process, where the patch is
        problem = patched.eval_problems()[0]
        assert patched.score("#### whatever", problem) == Score(correct, 1.0)
    assert calls == [("ChainSumDataset", "whatever", problem.answer, True)] * 2

def test_eval_is_disjoint_from_train_and_seeded():
    task = small(eval_size=64, train_size=2000)
    held_out = task.eval_problems()
    questions = {p.question for p in held_out}
    assert len(questions) == 64 and not questions & {p.question for p in task.train_problems()}
    assert len(task.train_problems()) == 2000
    assert held_out == small(eval_size=64, train_size=2000).eval_problems()
    assert task.train_problems()[:50] == small(eval_size=64, train_size=2000).train_problems()[:50]
    assert held_out != small(eval_size=64, train_size=2000, seed=1).eval_problems()
    assert all(task.score(p.solution, p) == Score(1.0, 1.0) for p in task.train_problems()[:200])


def test_errors_name_the_closest_generator_and_arguments():
    with pytest.raises(ValueError, match="Did you mean 'chain_sum'"):
        get_task("reasoning_gym", dataset="chain_sun")
    with pytest.raises(ValueError, match="no argument max_digit; its arguments: .*max_digits"):
        get_task("reasoning_gym", dataset="chain_sum", params={"max_digit": 2})
    with pytest.raises(ValueError, match="min_terms must be positive"):  # the library's own validate()
        get_task("reasoning_gym", dataset="chain_sum", params={"min_terms": 0})
    with pytest.raises(ValueError, match="task's seed"):
        get_task("reasoning_gym", dataset="chain_sum", params={"seed": 3})
    with pytest.raises(ValueError, match="threshold"):
        get_task("reasoning_gym", dataset="chain_sum", threshold=0)


def test_config_error_before_anything_runs():
    cfg = load_experiment("base", ["task.name=reasoning_gym", "task.args.dataset=chain_sun"])
    with pytest.raises(ConfigError, match="Did you mean 'chain_sum'"):
        run_configs(cfg)
    cfg = load_experiment("base", ["task.name=reasoning_gym", "task.args.dataset=chain_sum",
                                   "task.args.params.max_digits=2"])
    assert run_configs(cfg)


def test_hand_built_problem_is_scored_by_its_answer():
    task = small()
    problem = Problem(question="What is 2+2?", answer="4", solution="#### 4")
    assert task.score("#### 4", problem) == Score(1.0, 1.0)
    assert task.score("#### 5", problem) == Score(0.0, 1.0)


def test_a_completion_that_exits_through_the_librarys_eval_scores_zero_and_a_signal_still_stops_the_run(monkeypatch):
    """string_insertion's (and spiral_matrix's, n_queens') score_answer eval()s a wrong answer: "#### exit()" raised
    SystemExit out of the reward and ended the training run (scored in this process: ``score_timeout_s=0``). A
    SystemExit that a signal handler raises in the scorer (SIGTERM's, harness/apps/cli.py) still goes through."""
    task = get_task("reasoning_gym", dataset="string_insertion", train_size=4, eval_size=2, score_timeout_s=0)
    problem = task.eval_problems()[0]
    assert task.score(f"#### {problem.answer}", problem) == Score(1.0, 1.0)
    for completion in ("#### exit()", "#### quit(0)", "#### __import__('sys').exit(3)"):
        assert task.score(completion, problem) == Score(0.0, 1.0), completion

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    def scorer(self, answer, entry):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)  # the handler runs here, in the main thread
        return 1.0

    monkeypatch.setattr(DATASETS["string_insertion"][0], "score_answer", scorer)
    before = signal.signal(signal.SIGUSR1, terminate)
    try:
        with pytest.raises(SystemExit) as stopped:
            get_task("reasoning_gym", dataset="string_insertion", train_size=4, eval_size=2,
                     score_timeout_s=0).score("#### x", problem)
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert stopped.value.code == 128 + signal.SIGUSR1


@pytest.mark.slow  # scoring processes started and ended (seconds): make test
def test_an_answer_that_ends_the_scorers_process_scores_zero_and_the_run_goes_on(capsys):
    """string_insertion's scorer eval()s the answer: "os._exit" ended the training process. The library's scorer
    runs in a process of its own (harness/run/isolated.py): such an answer scores 0, is said on stderr, and the next
    answer is scored by a new process."""
    task = get_task("reasoning_gym", dataset="string_insertion", train_size=4, eval_size=2)
    problem = task.eval_problems()[0]
    for completion in ("#### exit()", "#### __import__('os')._exit(3)", "#### print('x')"):
        assert task.score(completion, problem) == Score(0.0, 1.0), completion
    assert "ended its process, exit code 3; it scores 0" in capsys.readouterr().err
    assert task.score(f"#### {problem.answer}", problem) == Score(1.0, 1.0)


@pytest.mark.slow  # a script that starts a scorer, times it out and is killed (seconds): make test
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the scorer's process ends with its parent on Linux")
def test_an_answer_that_never_ends_scores_zero_and_its_process_ends_with_the_training_process(tmp_path):
    """countdown's scorer sympy-parses the answer: "#### 9**9**9" never returned, and the training run hung in its
    reward. It scores 0 after ``score_timeout_s`` (said on stderr; the next answer gets a new process:
    tests/test_isolated.py), and a training process killed (SIGKILL) while its scorer is deep in such an answer takes
    that process with it."""
    script = tmp_path / "hang.py"
    # the 1-second limit only ever meets an answer that never ends; the right answer is scored without one (a
    # loaded machine may take more than a second over anything), so nothing here depends on the machine's speed
    script.write_text("from harness.tasks import get_task\n"
                      "task = get_task('reasoning_gym', dataset='countdown', train_size=4, eval_size=2, "
                      "score_timeout_s=1)\nproblem = task.eval_problems()[0]\n"
                      "slow = get_task('reasoning_gym', dataset='countdown', train_size=4, eval_size=2, "
                      "score_timeout_s=10**6)\n"
                      "print(task.score('#### 9**9**9', problem), slow.score('#### ' + problem.answer, problem))\n"
                      "print(slow._scorer()._process.pid, flush=True)\nslow.score('#### 9**9**9', problem)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              bufsize=0, env={**os.environ, "PYTHONPATH": os.getcwd()})

    def next_line() -> str:  # a bound for a hung scorer (for ever), not a timing: each line comes in seconds
        assert select.select([parent.stdout], [], [], 600)[0], "the script hung in its scorer"
        return parent.stdout.readline().decode()

    try:
        scores = next_line()
        assert scores == "Score(correct=0.0, format=1.0) Score(correct=1.0, format=1.0)\n", scores
        child = int(next_line())
    finally:
        parent.kill()
        err = parent.communicate(timeout=60)[1].decode()
    assert "scoring the answer '9**9**9' took over 1 s; it scores 0" in err
    for _ in range(6000):  # the kernel's signal to the child: waited for, not timed
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{child}/stat") as stat:
            if stat.read().split()[2] != "Z":  # alive (a zombie has ended, not yet reaped)
                time.sleep(0.01)
                continue
        break
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the scoring process outlived the process that started it")


def test_the_scoring_time_limit_leaves_the_warm_start_cache_key_as_it_was():
    """score_timeout_s (a task argument since the scorer runs in a process of its own) entered the warm start's cache
    key: every reasoning-gym starting policy cached before it was built again, and the key changed with the limit.
    The key is that of the code before the argument, whatever the limit."""
    from tests.helpers.tiny import empty_policy_key

    keys = {empty_policy_key(get_task("reasoning_gym", dataset="chain_sum", train_size=4, eval_size=2, **limit))
            for limit in ({}, {"score_timeout_s": 0}, {"score_timeout_s": 30})}
    assert keys == {"e71d663e7885a543"}  # the key of code ade77f9, before score_timeout_s


def test_a_process_keeps_the_scoring_processes_of_the_configs_it_used_last():
    """Every generator config had a scoring process for as long as the process lived: a worker training runs of many
    datasets, or a script scoring all of them (106 children, ~100 MB each), kept them all. The last
    SCORING_PROCESSES_KEPT stay; an ended one starts again when its config is used again."""
    from harness import tasks

    names = ["chain_sum", "basic_arithmetic", "leg_counting"]
    made = {name: get_task("reasoning_gym", dataset=name, train_size=2, eval_size=2) for name in names}
    for name in [*names, names[0]]:
        task = made[name]
        problem = task.eval_problems()[0]
        assert task.score(problem.solution, problem) == Score(1.0, 1.0), name
    running = [s for s in tasks._ISOLATED_SCORERS.values() if s._process is not None]
    assert len(tasks._ISOLATED_SCORERS) == len(running) == tasks.SCORING_PROCESSES_KEPT == 2


def test_a_tasks_answers_are_scored_by_one_process():
    """The scoring process is started once per generator config and kept: a new one per answer (seconds each) would
    make scoring a rollout take minutes."""
    task = small()
    task.eval_problems()
    assert task._scorer() is task._scorer()
