"""Verifiable tasks: a question, a ground-truth answer and a rule-based scorer, registered by name.

    from harness.tasks import get_task
    task = get_task("arith", digits=2)            # or get_task("gsm8k", data_dir="../shared/data/gsm8k")
    problem = task.eval_problems()[0]
    task.score(problem.solution, problem)         # Score(correct=1.0, format=1.0)

Every task puts its final answer after ``####`` (verl's GSM8K convention). ``Score.format`` is 1 when that
marker is followed by a parseable number, ``Score.correct`` is 1 when the extracted answer is right.
A task is a dataclass: its fields are its keyword arguments, and :meth:`Task.config` returns them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import ClassVar

from objectives.registry import Registry

TASKS: Registry[type[Task]] = Registry("task")

_MARKER = re.compile(r"####\s*([-$]*[0-9][0-9.,]*)")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


@dataclass(frozen=True)
class Problem:
    question: str  # the user-facing prompt text (already including the instruction)
    answer: str  # the ground-truth final answer, normalised
    solution: str  # a reference completion that the task scores as correct (for a supervised warm start)


@dataclass
class Score:
    correct: float  # 1.0 if the final answer is right, else 0.0
    format: float  # 1.0 if the "#### <number>" marker is present and parseable, else 0.0


class Task:
    """Base class of a task; subclasses are dataclasses registered with :func:`register_task`."""

    name: ClassVar[str]

    def train_problems(self) -> Sequence[Problem]:
        raise NotImplementedError

    def eval_problems(self) -> Sequence[Problem]:
        """A fixed held-out set, the same on every call and every run."""
        raise NotImplementedError

    def score(self, completion: str, problem: Problem) -> Score:
        raise NotImplementedError

    def config(self) -> dict:
        """The task's keyword arguments (enough to rebuild it with :func:`get_task`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


def register_task(name: str):
    """Class decorator: register a Task dataclass under ``name`` (also sets ``cls.name``)."""

    def decorator(cls: type[Task]) -> type[Task]:
        cls.name = name
        return TASKS.register(name)(cls)

    return decorator


def get_task(name: str, **kwargs) -> Task:
    """Build a registered task; unknown names and keyword arguments raise errors listing the choices."""
    cls = TASKS.get(name)
    valid = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        choices = ", ".join(f"{k}={v!r}" for k, v in valid.items())
        raise TypeError(f"task {name!r} has no argument {', '.join(unknown)}; its arguments: {choices}")
    return cls(**kwargs)


def available_tasks() -> list[str]:
    return TASKS.names()


def canonical_number(text: str) -> str | None:
    """``"$1,080."`` -> ``"1080"``, ``"18.00"`` -> ``"18"``, ``"0.50"`` -> ``"0.5"``; None if not a number."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def marker_answer(completion: str) -> str | None:
    """The number after the last ``####`` with a trailing ``.`` removed (raw text), or None."""
    matches = _MARKER.findall(completion)
    return matches[-1].rstrip(".") if matches else None


def _require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------- GSM8K

GSM8K_INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


@register_task("gsm8k")
@dataclass
class GSM8K(Task):
    """Grade-school math word problems (openai/gsm8k, config ``main``).

    Data: the hub dataset, or a local directory with ``train.jsonl`` and ``test.jsonl`` (fields ``question``
    and ``answer``) given by ``data_dir`` or else the ``GSM8K_DIR`` environment variable. Local files are
    checked line by line first, so bad data stops with an error naming the file and line.
    Train problems are the first ``train_size`` of the train split (None: all); eval problems are the first
    ``eval_size`` of the test split.

    Scoring: the answer is the number after the last ``####`` (``,`` and ``$`` and a trailing ``.`` removed),
    else the last ``\\boxed{...}``, else the last number in the text; only the ``####`` form earns
    ``format`` = 1. Answers are compared as exact decimals ("18.00" == "18"). math_verify is not used:
    GSM8K answers are plain numbers, so it would add nothing but cost, and its signal-based timeouts raise in
    worker threads (disabling them lets a pathological completion stall sympy).
    """

    data_dir: str | None = None
    train_size: int | None = None
    eval_size: int = 64
    _splits: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.data_dir = self.data_dir or os.environ.get("GSM8K_DIR") or None
        if self.train_size is not None:
            _require_int("train_size", self.train_size, 1)
        _require_int("eval_size", self.eval_size, 1)

    def train_problems(self) -> Sequence[Problem]:
        return self._split("train", self.train_size)

    def eval_problems(self) -> Sequence[Problem]:
        return self._split("test", self.eval_size)

    def score(self, completion: str, problem: Problem) -> Score:
        marked = marker_answer(completion)
        predicted = canonical_number(marked) if marked is not None else None
        has_format = predicted is not None
        if predicted is None:
            boxed = _BOXED.findall(completion)
            numbers = _NUMBER.findall(boxed[-1] if boxed else "") or _NUMBER.findall(completion)
            predicted = canonical_number(numbers[-1]) if numbers else None
        return Score(correct=float(predicted is not None and predicted == problem.answer), format=float(has_format))

    def _split(self, split: str, size: int | None) -> list[Problem]:
        if split not in self._splits:
            self._splits[split] = [_gsm8k_problem(row) for row in self._rows(split)]
        problems = self._splits[split]
        if size is not None and size > len(problems):
            raise ValueError(f"gsm8k: asked for {size} {split} problems, the split has {len(problems)}")
        return problems[:size]

    def _rows(self, split: str):
        import datasets

        if self.data_dir is None:
            try:
                return datasets.load_dataset("openai/gsm8k", "main", split=split)
            except Exception as error:
                raise RuntimeError(
                    f"could not load openai/gsm8k from the hub ({error}); "
                    "set GSM8K_DIR or data_dir to a directory with train.jsonl and test.jsonl"
                ) from error
        path = Path(self.data_dir).expanduser() / f"{split}.jsonl"
        check_gsm8k_file(path)
        return datasets.load_dataset("json", data_files=str(path), split="train")


def check_gsm8k_file(path: Path) -> None:
    """Raise ValueError naming the file (and line) if ``path`` is not a valid GSM8K jsonl file."""
    if not path.is_file():
        raise ValueError(f"gsm8k data file {path} does not exist (expected train.jsonl and test.jsonl)")
    rows = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: malformed JSON ({error.msg})") from None
            for key in ("question", "answer"):
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise ValueError(f"{where}: missing string field {key!r}")
            if canonical_number(row["answer"].rpartition("####")[2]) is None:
                raise ValueError(f"{where}: the answer does not end with '#### <number>'")
            rows += 1
    if rows == 0:
        raise ValueError(f"gsm8k data file {path} is empty")


def _gsm8k_problem(row: dict) -> Problem:
    solution = re.sub(r"<<[^>]*>>", "", row["answer"]).strip()
    return Problem(
        question=row["question"].strip() + GSM8K_INSTRUCTION,
        answer=canonical_number(solution.rpartition("####")[2]),
        solution=solution,
    )


# ------------------------------------------------------------------------------------------ arithmetic


@register_task("arith")
@dataclass
class Arith(Task):
    """Procedural arithmetic, e.g. ``What is 37+45? Answer after "####".`` -> ``37+45=82 #### 82``.

    Operands are uniform in [0, 10**digits); operators are drawn from ``operators`` ("+", "-", "*"; usual
    precedence). Problems are a deterministic function of ``seed``: eval problems are distinct and come from
    their own random stream, train problems from another stream with every eval problem left out
    (train problems may repeat). The verifier is an exact match of the integer after the last ``####``.
    """

    num_operands: int = 2
    digits: int = 2
    operators: str = "+-"
    seed: int = 0
    train_size: int = 10000
    eval_size: int = 128
    _train: list = field(default_factory=list, init=False, repr=False)
    _eval: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        _require_int("num_operands", self.num_operands, 2)
        _require_int("digits", self.digits, 1)
        _require_int("train_size", self.train_size, 1)
        _require_int("eval_size", self.eval_size, 1)
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators must be a non-empty string of '+', '-', '*', got {self.operators!r}")
        operators = sorted(set(self.operators))
        space = 10 ** (self.digits * self.num_operands) * len(operators) ** (self.num_operands - 1)
        if self.eval_size > space // 2:
            raise ValueError(f"eval_size={self.eval_size} is over half of the {space} possible problems")
        eval_rng, train_rng = random.Random(f"arith-eval-{self.seed}"), random.Random(f"arith-train-{self.seed}")
        seen: set[str] = set()
        while len(self._eval) < self.eval_size:
            problem = self._sample(eval_rng, operators)
            if problem.question not in seen:
                seen.add(problem.question)
                self._eval.append(problem)
        while len(self._train) < self.train_size:
            problem = self._sample(train_rng, operators)
            if problem.question not in seen:
                self._train.append(problem)

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval

    def score(self, completion: str, problem: Problem) -> Score:
        predicted = marker_answer(completion)
        well_formed = predicted is not None and re.fullmatch(r"-?[0-9]+", predicted) is not None
        return Score(correct=float(well_formed and predicted == problem.answer), format=float(well_formed))

    def _sample(self, rng: random.Random, operators: list[str]) -> Problem:
        operands = [rng.randrange(10**self.digits) for _ in range(self.num_operands)]
        ops = [rng.choice(operators) for _ in range(self.num_operands - 1)]
        expression = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:], strict=True))
        answer = str(_evaluate(operands, ops))
        return Problem(
            question=f'What is {expression}? Answer after "####".',
            answer=answer,
            solution=f"{expression}={answer} #### {answer}",
        )


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Evaluate ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))
