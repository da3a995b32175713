"""Tasks: GSM8K loading, validation and scoring; the procedural arithmetic task."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from harness.run.errors import ConfigError
from harness.tasks import (
    GSM8K_INSTRUCTION,
    Problem,
    Score,
    Task,
    available_tasks,
    check_prompts_fit,
    get_task,
    problems_digest,
    register_task,
    task_arguments,
)
from objectives.registry import UnknownNameError

GSM8K_ROW = {"question": "Tom has 3 apples and buys 5. How many?", "answer": "3+5=<<3+5=8>>8\n#### 8"}


def write_gsm8k(folder, train_lines, test_lines=None):
    folder.mkdir(exist_ok=True)
    for split, lines in (("train", train_lines), ("test", test_lines or [json.dumps(GSM8K_ROW)])):
        (folder / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def test_registry_and_argument_errors():
    assert {"arith", "gsm8k"} <= set(available_tasks())
    with pytest.raises(UnknownNameError, match="Did you mean 'gsm8k'"):
        get_task("gsm8")
    with pytest.raises(TypeError, match=r"no argument digit; its arguments: .*digits=2"):
        get_task("arith", digit=3)



class Lacking(Task):
    """A task that implements its problems but not its verifier (unregistered)."""

    def train_problems(self):
        return [Problem("1+1=", "2", "2")]

    eval_problems = train_problems


@pytest.mark.parametrize("name, cls, said", [
    ("Parity", dataclass(type("Named", (Lacking,), {"score": lambda self, c, p: Score(1.0, 1.0)})),
     r"task name 'Parity': use lower-case letters, digits and _, starting with a letter"),
    ("plain", type("Plain", (), {}), r"task 'plain': <class '.*Plain'> is not a subclass of harness.tasks.Task"),
    ("undecorated", type("Undecorated", (Lacking,), {}), "task 'undecorated': Undecorated is not a dataclass: put "
     "@dataclass under @register_task"),
    ("lacking", dataclass(type("NoScore", (Lacking,), {})), "task 'lacking': NoScore does not implement score$"),
], ids=["name", "not_a_task", "not_a_dataclass", "no_score"])
def test_a_task_declared_wrong_is_refused_when_it_registers(name, cls, said):
    """A new task's declaration errors are one line when it registers, not a TypeError from dataclasses.fields when
    a run is configured or a NotImplementedError at the first reward; nothing is registered."""
    with pytest.raises((TypeError, ValueError), match=f"^{said}"):
        register_task(name)(cls)
    assert name not in available_tasks()


@pytest.mark.slow
def test_gsm8k_loads_local_copy_from_env(gsm8k_dir, monkeypatch):
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))
    task = get_task("gsm8k", eval_size=16)
    train, held_out = task.train_problems(), task.eval_problems()
    assert len(train) == 7473 and len(held_out) == 16
    assert held_out == get_task("gsm8k", data_dir=str(gsm8k_dir), eval_size=16).eval_problems()
    first = held_out[0]
    assert first.question.startswith("Janet") and first.question.endswith('output the final answer after "####".')
    assert first.answer == "18" and "<<" not in first.solution and first.solution.endswith("#### 18")
    assert all(task.score(p.solution, p) == Score(1.0, 1.0) for p in train)


def test_gsm8k_kwarg_wins_over_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "nowhere"))
    task = get_task("gsm8k", data_dir=str(write_gsm8k(tmp_path / "d", [json.dumps(GSM8K_ROW)])), eval_size=1)
    assert task.train_problems()[0] == Problem(
        question=GSM8K_ROW["question"] + ' Let\'s think step by step and output the final answer after "####".',
        answer="8",
        solution="3+5=8\n#### 8",
    )


# (completion, reference answer, strict, flexible, format), each expected value decided by hand from the
# conventions in GSM8K's docstring (verl gsm8k.py strict, lm-eval flexible-extract).
GSM8K_CASES = [
    ("so 72 in total.\n#### 72", "72", 1, 1, 1),
    ("#### 1,080", "1080", 1, 1, 1),  # commas removed in both
    ("####18", "18", 0, 1, 1),  # strict needs "#### " with one space; the marker still counts as format
    ("####  18", "18", 0, 1, 1),  # two spaces: no strict match either
    ("#### $18", "18", 0, 1, 1),  # strict's regex cannot capture "$"; flexible's can, then drops it
    ("The answer is 18.", "18", 0, 1, 0),  # no marker: no strict credit; flexible drops the trailing "."
    ("The answer is 18...", "18", 0, 0, 0),  # lm-eval drops one trailing ".": "18.." != "18"
    ("so the answer is \\boxed{18}", "18", 0, 1, 0),
    ("she makes 9 * 2 = $18.", "18", 0, 1, 0),
    ("#### 5 wait, no: #### 18", "18", 1, 1, 1),  # two markers: the last one counts (verl)
    ("#### 5 wait, no: #### 18", "5", 0, 0, 1),  # (lm-eval strict-match would take the first, 5)
    ("#### -3", "-3", 1, 1, 1),
    ("it drops 3 degrees, to -3.\n#### -3.", "-3", 1, 1, 1),
    ("#### 19", "18", 0, 0, 1),  # a wrong number after the marker
    ("#### 18\nNext question: 5 + 7 = 12", "18", 1, 0, 1),  # right number followed by other numbers
    ("#### 18.", "18", 1, 1, 1),  # a trailing "." is removed (lm-eval; verl would refuse it)
    ("#### 18.00", "18", 0, 0, 1),  # strings are compared, not values
    ("I don't know", "18", 0, 0, 0),
    ("", "18", 0, 0, 0),
    ("#### eighteen", "18", 0, 0, 0),
    ("#### 1.2.3", "18", 0, 0, 0),
    ("#### 1000", "1000", 1, 1, 1),  # the gold "1,000" is "1000"; "#### 1,000" is above
    ("#### 3.0", "3", 0, 0, 1),
    ("#### .5", "0.5", 0, 0, 0),  # ".5" != "0.5" (a gold answer's canonical form); format wants a digit first
    ("#### \u22123", "-3", 0, 0, 0),  # a unicode minus is no minus: no marker match, and flexible reads "3"
    ("#### \u22123", "3", 0, 1, 0),
    ("####\n18", "18", 0, 1, 1),  # a newline is whitespace to format, not the one space strict needs
    ("#### ,18", "18", 1, 1, 0),  # strict captures ",18" (as verl does); format wants a digit first
    ("#### 18 #### eighteen", "18", 1, 1, 1),  # a marker without a number does not hide the earlier one
    ("#### 18" + " and then" * 100, "18", 1, 1, 1),  # verl searches the last 300 characters only; here, all
    ("The numbers 3, 4 and 18", "18", 0, 1, 0),  # several numbers: flexible takes the last
]


@pytest.mark.parametrize("completion, answer, strict, flexible, has_format", GSM8K_CASES)
def test_gsm8k_scorings(completion, answer, strict, flexible, has_format):
    problem = Problem(question="q", answer=answer, solution="")
    for scoring, correct in (("strict", strict), ("flexible", flexible)):
        assert get_task("gsm8k", scoring=scoring).score(completion, problem) == Score(correct, has_format), scoring
    assert get_task("gsm8k").score(completion, problem).correct == strict  # strict is the default
    assert get_task("gsm8k", scoring="flexible").eval_scores(completion, problem) == {
        "strict": strict, "flexible": flexible}


def test_a_number_of_thousands_of_digits_is_scored_not_raised():
    """A degenerate completion's answer past Python's 4300-digit limit on int-to-text: its format was read through
    int(), whose str() raised ValueError in the reward and ended the training run."""
    from harness.tasks import canonical_number

    long = "9" * 5000
    assert canonical_number(long) == long and canonical_number(f"-{long}.00") == f"-{long}"
    assert canonical_number(f"{long}.50") == f"{long}.5"
    # Decimal's other spellings are not numbers here ("1e999999999" was taken for a billion-digit answer)
    assert [canonical_number(text) for text in ("1e3", "1E+3", "1_000", "+5", "\u0661\u0662", "Infinity", "NaN")] == [
        None] * 7
    assert [canonical_number(text) for text in (" $1,080 . ", "-0.0", ".5", "-007.50")] == ["1080", "0", "0.5", "-7.5"]
    problem = Problem(question="q", answer=long, solution="")
    for scoring in ("strict", "flexible"):
        assert get_task("gsm8k", scoring=scoring).score(f"#### {long}", problem) == Score(1.0, 1.0)
        assert get_task("gsm8k", scoring=scoring).score(f"#### 1{long}", problem) == Score(0.0, 1.0)


def test_gsm8k_unknown_scoring_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown scoring 'lenient'; choose one of strict, flexible"):
        get_task("gsm8k", scoring="lenient")
    assert get_task("gsm8k", scoring="flexible").config()["scoring"] == "flexible"


def test_single_scoring_tasks_have_no_eval_scores():
    problem = get_task("arith", eval_size=1).eval_problems()[0]
    assert get_task("arith", eval_size=1).eval_scores(problem.solution, problem) == {}


@pytest.mark.parametrize(
    "lines, message",
    [
        (None, r"train\.jsonl does not exist"),
        ([], r"train\.jsonl is empty"),
        ([json.dumps(GSM8K_ROW), "{not json"], r"train\.jsonl, line 2: malformed JSON"),
        ([json.dumps(GSM8K_ROW), "", json.dumps({"question": "q"})], r"train\.jsonl, line 3: missing .*'answer'"),
        ([json.dumps({"answer": "#### 1"})], r"line 1: missing string field 'question'"),
        ([json.dumps({"question": "q", "answer": "it is 4"})], r"line 1: the answer does not end with '#### <number>'"),
        ([json.dumps({"question": "q", "answer": "#### 1e999999999"})], r"line 1: the answer does not end with"),
    ],
)
def test_gsm8k_bad_data_names_file_and_line(tmp_path, lines, message):
    folder = write_gsm8k(tmp_path / "d", lines or [])
    if lines is None:
        (folder / "train.jsonl").unlink()
    with pytest.raises(ValueError, match=message):
        get_task("gsm8k", data_dir=str(folder)).train_problems()


def test_gsm8k_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        get_task("gsm8k", data_dir=str(tmp_path / "missing")).eval_problems()
    (tmp_path / "train.jsonl").write_text("")  # a data file given for the folder: it said "does not exist"
    with pytest.raises(ValueError, match=rf"^gsm8k: task.data_dir={tmp_path / 'train.jsonl'} is a file, not a folder; "
                       "point it at a folder with train.jsonl and test.jsonl"):
        get_task("gsm8k", data_dir=str(tmp_path / "train.jsonl"))


def test_arith_is_deterministic_and_eval_is_disjoint():
    task = get_task("arith", train_size=5000, eval_size=200)
    again = get_task("arith", train_size=5000, eval_size=200)
    assert task.train_problems() == again.train_problems() and task.eval_problems() == again.eval_problems()
    assert task.eval_problems() != get_task("arith", seed=1, eval_size=200).eval_problems()
    held_out = {p.question for p in task.eval_problems()}
    assert len(held_out) == 200
    assert not held_out & {p.question for p in task.train_problems()}
    operands = [int(x) for p in task.train_problems() for x in re.findall(r"\d+", p.question.split("?")[0])]
    assert min(operands) == 0 and max(operands) == 99


def test_a_later_eval_set_is_new_problems_and_leaves_the_train_problems_and_the_first_set_as_they_were():
    """task.eval_set k: problems that no other set and no train problem holds (the zoo's confirmation evaluates on
    set 1, which the screen's selection never saw); set 0 is the default's, the train problems and the warm start's
    cache key are every set's."""
    from harness.tasks import _arith_problems
    from tests.helpers.tiny import empty_policy_key

    sets = [get_task("arith", eval_size=128, eval_set=k) for k in range(3)]
    default = get_task("arith", eval_size=128)
    assert sets[0].eval_problems() == default.eval_problems()
    assert all(s.train_problems() == default.train_problems() for s in sets)
    questions = [{p.question for p in s.eval_problems()} for s in sets]
    train = {p.question for p in default.train_problems()}
    assert [len(q) for q in questions] == [128] * 3
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    assert not (questions[1] | questions[2]) & train
    assert get_task("arith", eval_size=128, eval_set=2).eval_problems() == sets[2].eval_problems()  # deterministic
    _arith_problems.cache_clear()  # built again, not read from the cache: the same problems
    assert get_task("arith", eval_size=128, eval_set=1).eval_problems() == sets[1].eval_problems()

    # the key of code before eval sets (d21d60c): cached starting policies keep theirs
    assert {empty_policy_key(s) for s in sets} == {"6165dd6cdb54d87d"}  # the same policy for any eval set
    assert empty_policy_key(get_task("arith", eval_size=64)) != empty_policy_key(
        sets[1])  # eval_size is: set 0 leaves its problems out of the train problems
    with pytest.raises(ValueError, match=r"eval_set=1: set 1 found \d+ of its 8 problems: the train problems and the "
                       r"earlier sets hold nearly all 200 there are; lower train_size"):
        get_task("arith", digits=1, eval_size=8, eval_set=1)  # 10000 draws of 200 problems leave none
    assert len(get_task("arith", digits=2, train_size=100000, eval_size=128, eval_set=1).eval_problems()) == 128
    with pytest.raises(ValueError, match="eval_set must be"):
        get_task("arith", eval_set=-1)


def test_a_later_gsm8k_eval_set_is_the_next_rows_of_the_test_split(tmp_path):
    rows = [json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) for i in range(5)]
    folder = write_gsm8k(tmp_path / "d", [json.dumps(GSM8K_ROW)], rows)
    first, second = (get_task("gsm8k", data_dir=str(folder), eval_size=2, eval_set=k) for k in (0, 1))
    assert [p.answer for p in first.eval_problems()] == ["0", "1"]
    assert [p.answer for p in second.eval_problems()] == ["2", "3"]
    with pytest.raises(ValueError, match=r"asked for 6 test problems \(eval_set 2 of eval_size 2\), the split has 5"):
        get_task("gsm8k", data_dir=str(folder), eval_size=2, eval_set=2).eval_problems()


def test_arith_problem_text_and_precedence():
    problem = get_task("arith", eval_size=1).eval_problems()[0]
    expression = problem.question.removeprefix("What is ").removesuffix('? Answer after "####".')
    assert problem.solution == f"{expression}={problem.answer} #### {problem.answer}"
    for p in get_task("arith", num_operands=3, operators="+-*", eval_size=50, train_size=1).eval_problems():
        assert p.answer == str(eval(p.solution.split("=")[0]))  # noqa: S307 (our own digits and operators)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("37+45=82 #### 82", (1, 1)),
        ("#### 82.", (1, 1)),
        ("#### 81 #### 82", (1, 1)),
        ("#### 82 #### 81", (0, 1)),
        ("#### 82 #### eighty-one", (1, 1)),  # the last "####" followed by a number counts
        ("#### 82...", (1, 1)),
        ("#### 82, since 37+45=82", (0, 0)),  # "82," is not an integer
        ("#### 082", (0, 1)),  # an integer, not the answer's string
        ("#### 1,082", (0, 0)),
        ("#### $82", (0, 0)),
        ("####\n 82", (1, 1)),
        ("#### \u221282", (0, 0)),
        ("", (0, 0)),
        ("#### 82.0", (0, 0)),
        ("#### 1,2", (0, 0)),
        ("37+45=82", (0, 0)),
        ("####", (0, 0)),
    ],
)
def test_arith_verifier(completion, expected):
    problem = Problem(question="What is 37+45?", answer="82", solution="37+45=82 #### 82")
    assert get_task("arith", train_size=1, eval_size=1).score(completion, problem) == Score(*map(float, expected))


def test_arith_rejects_bad_arguments():
    with pytest.raises(ValueError, match="operators"):
        get_task("arith", operators="+/")
    with pytest.raises(ValueError, match="eval_size"):
        get_task("arith", digits=1, eval_size=150)
    with pytest.raises(ValueError, match="digits must be an integer >= 1, got True"):  # a YAML true is not 1
        get_task("arith", digits=True)


def test_the_training_problems_a_task_makes_are_known_without_making_them(tmp_path, monkeypatch):
    """The config check refuses more prompts per step than this before any folder: arith's and reasoning_gym's
    train_size; a local GSM8K folder's rows, counted (a sweep on a 3-row folder made every run's folder, then each
    run failed: a hostile pass), at most train_size; the hub's GSM8K: unknown until loaded."""
    folder = write_gsm8k(tmp_path / "g", [json.dumps(GSM8K_ROW)] * 3 + [""])
    assert get_task("gsm8k", data_dir=str(folder)).known_train_size() == 3
    assert get_task("gsm8k", data_dir=str(folder), train_size=2).known_train_size() == 2
    assert get_task("arith", train_size=50).known_train_size() == 50
    monkeypatch.delenv("GSM8K_DIR", raising=False)
    assert get_task("gsm8k").known_train_size() is None


def test_gsm8k_questions_are_stripped_before_the_instruction(tmp_path):
    """A local file's question with surrounding whitespace gets the instruction after one space, as the hub's rows."""
    row = {**GSM8K_ROW, "question": "  " + GSM8K_ROW["question"] + " \n"}
    task = get_task("gsm8k", data_dir=str(write_gsm8k(tmp_path / "d", [json.dumps(row)])), eval_size=1)
    assert task.train_problems()[0].question == GSM8K_ROW["question"] + GSM8K_INSTRUCTION


def test_arith_verifier_takes_a_negative_answer():
    """operators "+-" (the default) make negative answers: "#### -8" is formatted and correct."""
    problem = Problem(question="What is 37-45?", answer="-8", solution="37-45=-8 #### -8")
    task = get_task("arith", train_size=1, eval_size=1)
    assert task.score("37-45=-8 #### -8", problem) == Score(1.0, 1.0)
    assert task.score("#### 8", problem) == Score(0.0, 1.0)


def test_the_task_data_digest_covers_the_eval_problems_too():
    """A resume on the same training problems but another held-out set is refused: the digest tells them apart."""
    train, evaluation = get_task("arith", train_size=4, eval_size=2).train_problems(), [Problem("q", "1", "#### 1")]
    assert problems_digest(train, evaluation) != problems_digest(train, [Problem("q", "2", "#### 2")])
    assert problems_digest(train, evaluation) == problems_digest(list(train), list(evaluation))


def test_as_many_prompts_per_step_as_training_problems_fit():
    check_prompts_fit(8, 8, "arith")
    with pytest.raises(ConfigError, match="prompts_per_step=9 is more than the 8 training problems"):
        check_prompts_fit(9, 8, "arith")


def test_task_arguments_carry_the_runs_eval_size_data_dir_and_eval_set():
    """task.eval_size (and data_dir, eval_set where set) reach the task next to task.args."""
    run = OmegaConf.create({"task": {"name": "arith", "eval_size": 5, "eval_set": 0, "data_dir": None,
                                     "args": {"digits": 1}}})
    assert task_arguments(run) == {"eval_size": 5, "digits": 1}
    assert len(get_task("arith", **task_arguments(run)).eval_problems()) == 5
    run.task.eval_set, run.task.data_dir = 2, "/data"
    assert task_arguments(run) == {"eval_size": 5, "digits": 1, "eval_set": 2, "data_dir": "/data"}
