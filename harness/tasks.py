"""Verifiable tasks: a question, a ground-truth answer and a rule-based scorer, registered by name.

    from harness.tasks import get_task
    task = get_task("arith", digits=2)            # or get_task("gsm8k", data_dir="../shared/data/gsm8k")
    problem = task.eval_problems()[0]
    task.score(problem.solution, problem)         # Score(correct=1.0, format=1.0)

Every task puts its final answer after ``####`` (verl's GSM8K convention). ``Score.format`` is 1 when that
marker is followed by a parseable number, ``Score.correct`` is 1 when the extracted answer is right.
A task is a dataclass: its fields are its keyword arguments, and :meth:`Task.config` returns them.
A task with several named scorings (``gsm8k``: ``strict``, ``flexible``) trains with the one chosen by its
``scoring`` argument and reports all of them in :meth:`Task.eval_scores`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf

from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.hub import hub_problem
from harness.run.isolated import IsolatedCall, method_of
from objectives.registry import Registry

TASKS: Registry[type[Task]] = Registry("task")

_MARKER = re.compile(r"####\s*([-$]*[0-9][0-9.,]*)")
_PLAIN_NUMBER = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")  # canonical_number's numbers, "1e999999999" not one


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
    """Base class of a task; subclasses are dataclasses registered with :func:`register_task`.

    :meth:`score` is the training reward's verifier. :meth:`eval_scores` maps each named scoring of the task to
    the completion's correctness (0.0 or 1.0) under it; the eval logs ``eval_accuracy_<name>`` for each. A
    task with a single scoring returns ``{}``.
    """

    name: ClassVar[str]

    def train_problems(self) -> Sequence[Problem]:
        raise NotImplementedError

    def eval_problems(self) -> Sequence[Problem]:
        """A fixed held-out set, the same on every call and every run."""
        raise NotImplementedError

    def known_train_size(self) -> int | None:
        """How many training problems the task makes, known from its arguments (its ``train_size``) without asking for
        them, or None where only loading them tells (a config check refuses more prompts per step than this before
        anything starts)."""
        size = getattr(self, "train_size", None)
        return size if isinstance(size, int) else None

    def score(self, completion: str, problem: Problem) -> Score:
        raise NotImplementedError

    def eval_scores(self, completion: str, problem: Problem) -> dict[str, float]:
        """Correctness of ``completion`` under each named scoring of the task (``{}``: one scoring only)."""
        return {}

    def data_problem(self) -> str | None:
        """Why this task's data cannot be had on this machine, found out without loading it, in seconds (one line
        naming the fix); None when it can. Asked once before runs start here (the ``task_data`` check); a task whose
        data is generated or local leaves it None."""
        return None

    def config(self) -> dict:
        """The task's keyword arguments (enough to rebuild it with :func:`get_task`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


def problems_digest(train: Sequence[Problem], evaluation: Sequence[Problem]) -> str:
    """The first 16 hex digits of the sha256 of the problems a run trains and evaluates on (question and answer, in
    order): what the task's data was, whatever folder or environment variable gave it (summary.json's task_data)."""
    content = json.dumps([[[p.question, p.answer] for p in train], [[p.question, p.answer] for p in evaluation]])
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def register_task(name: str):
    """Class decorator: register a Task dataclass under ``name`` (also sets ``cls.name``); a class that is not one, or
    lacks a method every task has, is refused in one line."""
    register = TASKS.register(name)  # refuses a name a config could not give

    def decorator(cls: type[Task]) -> type[Task]:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"task {name!r}: {cls!r} is not a subclass of harness.tasks.Task")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"task {name!r}: {cls.__qualname__} is not a dataclass: put @dataclass under "
                            "@register_task (its fields are task.args)")
        missing = [m for m in ("train_problems", "eval_problems", "score") if getattr(cls, m) is getattr(Task, m)]
        if missing:
            raise TypeError(f"task {name!r}: {cls.__qualname__} does not implement {', '.join(missing)}")
        cls.name = name
        return register(cls)

    return decorator


def get_task(name: str, **kwargs) -> Task:
    """Build a registered task; unknown names and keyword arguments raise errors listing the choices."""
    cls = TASKS.get(name)
    valid = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
             for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        choices = ", ".join(f"{k}={v!r}" for k, v in valid.items())
        raise TypeError(f"task {name!r} has no argument {', '.join(unknown)}; its arguments: {choices}")
    return cls(**kwargs)


def available_tasks() -> list[str]:
    return TASKS.names()


@register_check("task")
def check_task(run: DictConfig) -> None:
    """``task.name`` is registered and its arguments (``task.args``, ``task.eval_size``, ``task.data_dir``) build
    it, without loading its data, so that bad arguments stop before any run starts."""
    try:
        TASKS.get(run.task.name)
    except KeyError as e:
        raise ConfigError(str(e)) from None
    reserved = sorted(set(OWN_KEYS) & set(run.task.args))
    if reserved:  # task_arguments would let one spelling win silently over the other
        raise ConfigError(f"task.args.{reserved[0]}: give it as task.{reserved[0]}, not among the task's own arguments "
                          "(task.args)")
    if run.task.eval_set and not has_eval_sets(run.task.name):
        raise ConfigError(f"task.eval_set={run.task.eval_set}: task {run.task.name!r} has one held-out set (no "
                          "eval_set argument); leave task.eval_set at 0")
    error = _task_error(run.task.name, _task_arguments(run), os.environ.get("GSM8K_DIR"))
    if error:  # the task's own message, prefixed with its name unless it starts with it
        named = error.startswith((f"task {run.task.name!r}", f"{run.task.name}:", f"{run.task.name} "))
        raise ConfigError(error if named else f"task {run.task.name!r}: {error}")
    known = _known_train_size(run.task.name, _task_arguments(run), os.environ.get("GSM8K_DIR"))
    if known is not None:  # train_size, a local file's rows; the hub's GSM8K: as the run starts
        check_prompts_fit(run.train.prompts_per_step, known, run.task.name)


def check_prompts_fit(prompts_per_step: int, train_problems: int, task: str) -> None:
    """A step (a sampling round) draws its prompts from the task's training problems without replacement: refuse
    more prompts than problems (numpy's "Cannot take a larger sample than population" at the first rollout)."""
    if prompts_per_step > train_problems:
        raise ConfigError(f"train.prompts_per_step={prompts_per_step} is more than the {train_problems} training "
                          f"problems of task {task!r}, and a step draws its prompts without replacement: lower it")


@register_check("task_data", when="machine")
def check_task_data(run: DictConfig) -> None:
    """When runs start here: the task's data can be had (:meth:`Task.data_problem`), asked once per task and
    arguments."""
    problem = _task_data_problem(run.task.name, _task_arguments(run), os.environ.get("GSM8K_DIR"))
    if problem:
        raise ConfigError(problem)


@functools.lru_cache(maxsize=64)
def _known_train_size(name: str, arguments: str, gsm8k_dir: str | None = None) -> int | None:
    """:meth:`Task.known_train_size` of the task with these arguments (``gsm8k_dir``: a cache key)."""
    return get_task(name, **json.loads(arguments)).known_train_size()


OWN_KEYS = ("eval_size", "eval_set", "data_dir")  # task.<key>, passed to the task by task_arguments


def has_eval_sets(name: str) -> bool:
    """Whether the registered task ``name`` takes ``eval_set`` (held-out sets after its own: task.eval_set)."""
    return "eval_set" in {f.name for f in dataclasses.fields(TASKS.get(name))}


def task_arguments(run: DictConfig) -> dict:
    """The task's keyword arguments of ``run``: task.args, eval_size, and data_dir and eval_set where set (a task
    without an eval_set argument is built at its default; OWN_KEYS inside task.args are refused by check_task)."""
    arguments = {"eval_size": run.task.eval_size, **OmegaConf.to_container(run.task.args)}
    if run.task.data_dir:
        arguments["data_dir"] = run.task.data_dir
    if run.task.eval_set:
        arguments["eval_set"] = run.task.eval_set
    return arguments


def _task_arguments(run: DictConfig) -> str:
    """:func:`task_arguments` as sorted JSON (a cache key)."""
    return json.dumps(task_arguments(run), sort_keys=True)


@functools.lru_cache(maxsize=64)
def _task_error(name: str, arguments: str, gsm8k_dir: str | None = None) -> str | None:
    """The task's error for these arguments (``gsm8k_dir``: $GSM8K_DIR, which the gsm8k task reads: a cache key)."""
    try:
        get_task(name, **json.loads(arguments))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=64)
def _task_data_problem(name: str, arguments: str, gsm8k_dir: str | None = None) -> str | None:
    """:meth:`Task.data_problem` of the task these arguments build (checked valid by then; ``gsm8k_dir`` as above)."""
    return get_task(name, **json.loads(arguments)).data_problem()


def canonical_number(text: str) -> str | None:
    """``"$1,080."`` -> ``"1080"``, ``"18.00"`` -> ``"18"``, ``"0.50"`` -> ``"0.5"``; None if not a number: after
    every ``,`` and ``$``, surrounding spaces and trailing ``.`` dropped, ASCII digits with at most one ``.`` and
    an optional leading ``-`` (no exponent, ``+``, ``_`` or other scripts' digits, which Decimal would take)."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".").strip()
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    value = Decimal(text)
    if value.is_zero():  # "-0", "0.00"
        return "0"
    digits = format(value, "f")  # not int(): str() of an int refuses over 4300 digits, which a model can write
    return digits.rstrip("0").rstrip(".") if "." in digits else digits


def marker_answer(completion: str) -> str | None:
    """The number after the last ``####`` that has one (whitespace, ``$`` and ``-`` between them allowed; a later
    ``####`` without a number is passed over), trailing ``.`` removed (raw text, ``,`` kept), or None."""
    matches = _MARKER.findall(completion)
    return matches[-1].rstrip(".") if matches else None


def _require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------- GSM8K

GSM8K_HUB_ID, GSM8K_HUB_CONFIG = "openai/gsm8k", "main"  # the hub's copy, when no local folder is given
GSM8K_HUB_TRAIN_FILE = "train-00000-of-00001.parquet"  # in GSM8K_HUB_CONFIG/: the file that says it was downloaded
GSM8K_INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
_STRICT = re.compile(r"#### (-?[0-9.,]+)")  # verl gsm8k.py and lm-eval strict-match: exactly one space
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # lm-eval flexible-extract


def _field_normalised(text: str) -> str:
    """lm-eval's ``regexes_to_ignore`` for GSM8K: drop every ``,`` and ``$``, then one trailing ``.``."""
    return re.sub(r"\.$", "", text.replace(",", "").replace("$", ""))


def strict_answer(completion: str) -> str | None:
    """The text matched after the last ``#### `` (normalised), or None without such a marker."""
    matches = _STRICT.findall(completion)
    return _field_normalised(matches[-1]) if matches else None


def flexible_answer(completion: str) -> str | None:
    """The last match of lm-eval's flexible-extract regex (normalised), or None if nothing matches."""
    matches = _FLEXIBLE.findall(completion)
    return _field_normalised(next(group for group in matches[-1] if group)) if matches else None


GSM8K_SCORINGS: dict[str, Callable[[str], str | None]] = {"strict": strict_answer, "flexible": flexible_answer}


@register_task("gsm8k")
@dataclass
class GSM8K(Task):
    """Grade-school math word problems (openai/gsm8k, config ``main``).

    Data: the hub dataset, or a local directory with ``train.jsonl`` and ``test.jsonl`` (fields ``question``
    and ``answer``) given by ``data_dir`` or else the ``GSM8K_DIR`` environment variable. Local files are
    checked line by line first, so bad data stops with an error naming the file and line.
    Train problems are the first ``train_size`` of the train split (None: all); eval problems are the first
    ``eval_size`` of the test split (``eval_set`` k: the k-th ``eval_size`` after them).

    Scoring (``scoring``, default ``strict``; :meth:`eval_scores` reports both). An answer is extracted, every
    ``,`` and ``$`` and then one trailing ``.`` are removed, and the rest must equal ``Problem.answer`` as a
    string (GSM8K's integer answers without commas: "18.00" != "18"), as both references compare strings.
    ``Problem.answer`` is the text after the row's last ``####``, :func:`canonical_number` (``1,080`` -> ``1080``):
    on every row of openai/gsm8k the same string as verl's preprocessing (``examples/data_preprocess/gsm8k.py``,
    commas removed) and lm-eval's normalised reference. Only ASCII ``-`` is a minus sign (``−3`` is not ``-3``;
    flexible reads its ``3``, as lm-eval does).

    - ``strict`` (the training reward; verl's GSM8K reward): the last match of ``#### (-?[0-9.,]+)``, exactly
      one space after the marker; no match, no credit. So ``####18`` and ``#### $18`` earn nothing (the
      removal of ``$`` never applies: the regex cannot capture it). Follows ``extract_solution(method="strict")``
      of volcengine/verl ``verl/utils/reward_score/gsm8k.py``, except: verl only searches the last 300
      characters and keeps a trailing ``.`` ("#### 18." fails there; here it is removed, as lm-eval does).
      lm-evaluation-harness ``strict-match`` (``lm_eval/tasks/gsm8k/gsm8k.yaml``) uses the same regex but
      takes the first match: the two differ only when a completion has two markers.
    - ``flexible`` (lm-eval ``flexible-extract``): the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)``
      anywhere, e.g. ``The answer is 18.`` or ``\\boxed{18}``. As in lm-eval, runs of punctuation match
      too ("18..." -> "18.." fails). verl's ``flexible`` (a different regex, no ``$`` or ``.`` handling) is
      not what this follows.

    ``format`` is 1 when :func:`marker_answer` finds a number that :func:`canonical_number` reads (whitespace,
    newlines included, and ``$`` allowed after the marker; ``#### 1,2`` counts, ``#### 1.2.3`` does not), whatever
    the scoring; a digit comes first, so ``#### .5`` is not formatted and ``#### ,18`` is strict-correct (as in
    verl) but not formatted; ``####\\n18`` is formatted but not strict-correct.
    math_verify is not used: GSM8K answers are plain numbers and both references compare strings.
    """

    data_dir: str | None = None
    train_size: int | None = None
    eval_size: int = 64
    scoring: str = "strict"
    eval_set: int = 0
    _splits: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        source = "task.data_dir" if self.data_dir else "the environment's GSM8K_DIR"
        self.data_dir = self.data_dir or os.environ.get("GSM8K_DIR") or None
        if self.data_dir is not None:  # a folder that is not there stops the config check, not the run
            folder = Path(self.data_dir).expanduser()
            missing = [name for name in ("train.jsonl", "test.jsonl") if not (folder / name).is_file()]
            if missing:
                what = (" is a file, not a folder" if folder.is_file() else " does not exist" if not folder.is_dir()
                        else f": {' and '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist")
                raise ValueError(f"gsm8k: {source}={self.data_dir}{what}; point it at a folder with train.jsonl "
                                 "and test.jsonl (openai/gsm8k's main split), or unset it to load the hub's copy")
        if self.scoring not in GSM8K_SCORINGS:
            raise ValueError(f"gsm8k: unknown scoring {self.scoring!r}; choose one of {', '.join(GSM8K_SCORINGS)}")
        if self.train_size is not None:
            _require_int("train_size", self.train_size, 1)
        _require_int("eval_size", self.eval_size, 1)
        _require_int("eval_set", self.eval_set, 0)

    def train_problems(self) -> Sequence[Problem]:
        return self._split("train", self.train_size)

    def eval_problems(self) -> Sequence[Problem]:
        return self._split("test", (self.eval_set + 1) * self.eval_size)[self.eval_set * self.eval_size:]

    def known_train_size(self) -> int | None:
        """``train_size``, or a local folder's train.jsonl rows (its non-blank lines, counted, not parsed); None for
        the hub's copy, whose size loading it tells."""
        if self.data_dir is None:
            return self.train_size
        with (Path(self.data_dir).expanduser() / "train.jsonl").open("rb") as lines:
            rows = sum(1 for line in lines if line.strip())
        return rows if self.train_size is None else min(rows, self.train_size)

    def score(self, completion: str, problem: Problem) -> Score:
        marked = marker_answer(completion)
        has_format = marked is not None and canonical_number(marked) is not None
        correct = GSM8K_SCORINGS[self.scoring](completion) == problem.answer
        return Score(correct=float(correct), format=float(has_format))

    def eval_scores(self, completion: str, problem: Problem) -> dict[str, float]:
        return {name: float(extract(completion) == problem.answer) for name, extract in GSM8K_SCORINGS.items()}

    def data_problem(self) -> str | None:
        """Without ``data_dir``: the hub's copy is in the local datasets or hub cache, or the hub can be asked for it
        (harness/run/hub.py: seconds, where loading it retries for half a minute)."""
        if self.data_dir is not None or _hub_copy_cached():
            return None
        return hub_problem(GSM8K_HUB_ID, "dataset", f"task gsm8k's data ({GSM8K_HUB_ID}: neither task.data_dir nor "
                           "GSM8K_DIR is set)", "set GSM8K_DIR or task.data_dir to a folder with train.jsonl and "
                           "test.jsonl (`make bench` and the README's commands use ../shared/data/gsm8k)")

    def _split(self, split: str, size: int | None) -> list[Problem]:
        if split not in self._splits:
            self._splits[split] = [_gsm8k_problem(row) for row in self._rows(split)]
        problems = self._splits[split]
        if size is not None and size > len(problems):
            sets = f" (eval_set {self.eval_set} of eval_size {self.eval_size})" if split == "test" else ""
            raise ValueError(f"gsm8k: asked for {size} {split} problems{sets}, the split has {len(problems)}")
        return problems[:size]

    def _rows(self, split: str):
        import datasets

        if self.data_dir is None:
            try:
                return datasets.load_dataset(GSM8K_HUB_ID, GSM8K_HUB_CONFIG, split=split)
            except Exception as error:
                raise RuntimeError(
                    f"could not load openai/gsm8k from the hub ({error}); "
                    "set GSM8K_DIR or data_dir to a directory with train.jsonl and test.jsonl"
                ) from error
        path = Path(self.data_dir).expanduser() / f"{split}.jsonl"
        check_gsm8k_file(path)
        return datasets.load_dataset("json", data_files=str(path), split="train")


def _hub_copy_cached() -> bool:
    """Whether the hub's GSM8K is on this machine: prepared in the datasets cache (its info and a train split's
    Arrow file), or its train file in the hub cache (what ``datasets.load_dataset`` reads without the network)."""
    import datasets.config
    import huggingface_hub

    prepared = Path(datasets.config.HF_DATASETS_CACHE) / GSM8K_HUB_ID.replace("/", "___") / GSM8K_HUB_CONFIG
    downloaded = huggingface_hub.try_to_load_from_cache(GSM8K_HUB_ID, f"{GSM8K_HUB_CONFIG}/{GSM8K_HUB_TRAIN_FILE}",
                                                        repo_type="dataset")
    return (prepared.is_dir() and any(prepared.rglob("dataset_info.json")) and any(prepared.rglob("*-train*.arrow"))
            or isinstance(downloaded, str))


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
    (train problems may repeat). ``eval_set`` k >= 1: the eval stream goes on past the first ``eval_size``, and the
    k-th next ``eval_size`` distinct problems that are neither train problems nor in an earlier set are the eval set
    (the train problems stay those of set 0). The verifier is an exact string match of :func:`marker_answer`'s
    number (the last ``####`` followed by one) with the answer; ``format`` is 1 when that number is an integer
    (``-?[0-9]+``), so ``#### 82.0``, ``#### 1,082`` and ``#### $82`` are neither correct nor formatted, and
    ``#### 082`` is formatted but not correct.
    """

    num_operands: int = 2
    digits: int = 2
    operators: str = "+-"
    seed: int = 0
    train_size: int = 10000
    eval_size: int = 128
    eval_set: int = 0
    _train: list = field(default_factory=list, init=False, repr=False)
    _eval: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        _require_int("num_operands", self.num_operands, 2)
        _require_int("digits", self.digits, 1)
        _require_int("train_size", self.train_size, 1)
        _require_int("eval_size", self.eval_size, 1)
        _require_int("eval_set", self.eval_set, 0)
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators must be a non-empty string of '+', '-', '*', got {self.operators!r}")
        operators = sorted(set(self.operators))
        space = _arith_space(self.num_operands, self.digits, tuple(operators))
        if self.eval_size > space // 2:
            raise ValueError(f"eval_size={self.eval_size} is over half of the {space} possible problems")
        eval_problems, train_problems = _arith_problems(self.num_operands, self.digits, tuple(operators), self.seed,
                                                        self.train_size, self.eval_size, self.eval_set)
        self._eval, self._train = list(eval_problems), list(train_problems)

    def train_problems(self) -> Sequence[Problem]:
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        return self._eval

    def score(self, completion: str, problem: Problem) -> Score:
        predicted = marker_answer(completion)
        well_formed = predicted is not None and re.fullmatch(r"-?[0-9]+", predicted) is not None
        return Score(correct=float(well_formed and predicted == problem.answer), format=float(well_formed))



def _arith_space(num_operands: int, digits: int, operators: tuple[str, ...]) -> int:
    """How many distinct problems :class:`Arith` can draw."""
    return 10 ** (digits * num_operands) * len(operators) ** (num_operands - 1)


@functools.lru_cache(maxsize=8)  # a worker process's runs (harness/apps/worker.py) build the same problems once
def _arith_problems(num_operands: int, digits: int, operators: tuple[str, ...], seed: int, train_size: int,
                    eval_size: int, eval_set: int = 0) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """:class:`Arith`'s eval set ``eval_set`` and train problems (its docstring), immutable."""
    eval_rng, train_rng = random.Random(f"arith-eval-{seed}"), random.Random(f"arith-train-{seed}")

    def sample(rng: random.Random) -> Problem:
        operands = [rng.randrange(10**digits) for _ in range(num_operands)]
        ops = [rng.choice(operators) for _ in range(num_operands - 1)]
        expression = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:], strict=True))
        answer = str(_evaluate(operands, ops))
        return Problem(question=f'What is {expression}? Answer after "####".', answer=answer,
                       solution=f"{expression}={answer} #### {answer}")

    seen: set[str] = set()
    eval_problems, train_problems = [], []
    while len(eval_problems) < eval_size:
        problem = sample(eval_rng)
        if problem.question not in seen:
            seen.add(problem.question)
            eval_problems.append(problem)
    while len(train_problems) < train_size:
        problem = sample(train_rng)
        if problem.question not in seen:
            train_problems.append(problem)
    if eval_set:  # the later sets leave the train problems out too
        seen.update(problem.question for problem in train_problems)
    space = _arith_space(num_operands, digits, operators)
    for k in range(1, eval_set + 1):  # the later sets: neither a train problem nor in an earlier set
        eval_problems, draws = [], 0
        while len(eval_problems) < eval_size:
            problem, draws = sample(eval_rng), draws + 1
            if draws > 20 * space:  # a problem left free is drawn long before (each draw finds it with p 1/space)
                raise ValueError(f"eval_set={eval_set}: set {k} found {len(eval_problems)} of its {eval_size} "
                                 f"problems: the train problems and the earlier sets hold nearly all {space} there "
                                 "are; lower train_size, eval_size or eval_set, or widen the problems (digits, "
                                 "num_operands, operators)")
            if problem.question not in seen:
                seen.add(problem.question)
                eval_problems.append(problem)
    return tuple(eval_problems), tuple(train_problems)


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


# ------------------------------------------------------------------------------------------ reasoning-gym

REASONING_GYM_INSTRUCTION = ' Answer after "####".'


def reasoning_gym_datasets() -> list[str]:
    """The names of the generators the installed ``reasoning-gym`` provides (``task.args.dataset``)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _raised_by_signal_handler(error: BaseException) -> bool:
    """Whether ``error`` was raised by a Python signal handler (its innermost frame is one) rather than by the code
    the signal interrupted."""
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    handlers = {getattr(signal.getsignal(number), "__code__", None) for number in signal.valid_signals()}
    return trace is not None and trace.tb_frame.f_code in handlers


SCORING_PROCESSES_KEPT = 2  # scoring processes a process keeps (each ~ an interpreter with the library imported)
_ISOLATED_SCORERS: dict[tuple, IsolatedCall] = {}  # by generator config and time limit, the last used last


def isolated_scorer(generator_cls, config, timeout_s: float) -> IsolatedCall:
    """``generator_cls(config=config).score_answer`` in a process of its own, each answer within ``timeout_s``
    (harness/run/isolated.py), shared by the tasks of this process with the same generator config; the processes of
    all but the SCORING_PROCESSES_KEPT configs used last are ended (a worker training runs of many datasets, a test
    suite), and started again when their config is used again."""
    key = (generator_cls.__module__, generator_cls.__qualname__, repr(config), timeout_s)
    scorer = _ISOLATED_SCORERS.pop(key, None) or IsolatedCall(
        functools.partial(method_of, generator_cls, "score_answer", config=config), timeout_s)
    _ISOLATED_SCORERS[key] = scorer
    while len(_ISOLATED_SCORERS) > SCORING_PROCESSES_KEPT:
        _ISOLATED_SCORERS.pop(next(iter(_ISOLATED_SCORERS))).close()
    return scorer


def text_after_marker(completion: str) -> str | None:
    """The text after the last ``####``, stripped; None without a marker or with nothing after it."""
    _, marker, tail = completion.rpartition("####")
    return (tail.strip() or None) if marker else None


@register_task("reasoning_gym")
@dataclass
class ReasoningGym(Task):
    """A procedural generator of the ``reasoning-gym`` library, e.g. ``dataset="chain_sum"``.

    ``params`` are the generator's own keyword arguments (its config dataclass, e.g. chain_sum's ``min_terms``,
    ``max_digits``), passed through unchanged and checked by the library's ``validate()``; ``seed`` and
    ``size`` are this task's (``seed``, ``train_size``/``eval_size``), not ``params``.

    Problems: one generator instance seeded with ``seed``; its items 0, 1, 2, ... in order. The first
    ``eval_size`` distinct questions are the eval set; the items after them are the train set, minus every item
    whose question is an eval question (so the two are disjoint by question text; train questions may repeat).
    Same arguments, same problems (the library seeds item ``i`` with ``seed + i``). They are generated on first
    use, not at construction (so config checks stay fast: some generators, as countdown, are slow per item).

    Prompt: the library's question + ``Answer after "####".``. ``Problem.answer`` is the library's answer;
    ``Problem.solution`` is ``#### <answer>`` (no generator of reasoning-gym 0.1.x gives a worked solution, so
    the supervised warm start teaches the answer format and the direct answer).

    Scoring: the completion's answer is the text after the last ``####`` (stripped, to the end of the
    completion); it is passed to the library's own ``score_answer(answer, entry)`` (entry: the generated item,
    metadata included) and is correct when that returns ``>= threshold`` (default 1.0: several scorers give
    partial credit, e.g. the library's default gives ``len(answer)/len(guess)`` when the answer is a substring
    of the guess). No marker or nothing after it: not correct (the scorer is not called) and ``format`` 0; a
    scorer that raises on a malformed answer gives 0, SystemExit included. ``format`` is 1 when ``####`` is
    followed by some text.

    Several of the library's scorers run the model's text: string_insertion's, spiral_matrix's, binary_matrix's and
    n_queens' ``eval()`` a wrong answer (``#### exit()`` raises SystemExit, ``#### __import__('os')._exit(0)``
    ends the process), countdown's, puzzle24's and the integration and polynomial generators' parse it with sympy,
    which evaluates it (``#### 9**9**9`` never returns). So the scorer runs in a process of its own
    (harness/run/isolated.py), started once per process and generator config, each answer within
    ``score_timeout_s`` seconds (a round trip through a pipe per answer): an answer that runs past it or ends
    that process scores 0, said on stderr, and the next answer gets a new process. A legitimately slow scorer on a
    slow machine could cross the limit too: the line names it. ``score_timeout_s=0`` scores in this process
    (SystemExit still caught, the rest not). This bounds time, memory and crashes; what such text does to files is not
    contained.
    """

    dataset: str = "chain_sum"
    params: dict = field(default_factory=dict)
    seed: int = 0
    train_size: int = 10000
    eval_size: int = 128
    threshold: float = 1.0
    score_timeout_s: float = 10.0  # seconds one answer's scoring may take, in a process of its own (0: in this one)
    _train: list = field(default_factory=list, init=False, repr=False)
    _eval: list = field(default_factory=list, init=False, repr=False)
    _entries: dict = field(default_factory=dict, init=False, repr=False)  # prompt -> the library's item
    # the generator's score_answer (score_timeout_s 0), or what gives its process (isolated_scorer)
    _scorer: Callable | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        import difflib

        names = reasoning_gym_datasets()
        if self.dataset not in names:
            close = difflib.get_close_matches(str(self.dataset), names, n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"unknown reasoning_gym dataset {self.dataset!r}.{hint} "
                             f"{len(names)} generators: `python -m harness list` or reasoning_gym_datasets()")
        _require_int("seed", self.seed, 0)
        _require_int("train_size", self.train_size, 1)
        _require_int("eval_size", self.eval_size, 1)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be a number in (0, 1], got {self.threshold!r}")
        if isinstance(self.score_timeout_s, bool) or not isinstance(self.score_timeout_s, int | float) \
                or not 0 <= self.score_timeout_s < math.inf:
            raise ValueError(f"score_timeout_s must be a number of seconds >= 0 (0: score in this process), got "
                             f"{self.score_timeout_s!r}")
        if not isinstance(self.params, dict):
            raise ValueError(f"params must be a mapping of {self.dataset}'s arguments, got {self.params!r}")
        self._generator_config(size=1)  # unknown or invalid generator arguments stop here

    def _generator_config(self, size: int):
        from reasoning_gym.factory import DATASETS

        config_cls = DATASETS[self.dataset][1]
        valid = [f.name for f in dataclasses.fields(config_cls) if f.init and f.name not in ("seed", "size")]
        reserved = sorted({"seed", "size"} & set(self.params))
        if reserved:
            raise ValueError(f"{self.dataset}: set {' and '.join(reserved)} with the task's seed / train_size / "
                             "eval_size, not in params")
        unknown = sorted(set(self.params) - set(valid))
        if unknown:
            raise ValueError(f"reasoning_gym dataset {self.dataset!r} has no argument {', '.join(unknown)}; "
                             f"its arguments: {', '.join(valid)}")
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in self.params.items()}
        try:
            config = config_cls(**params, seed=self.seed, size=size)
            if hasattr(config, "validate"):
                config.validate()
        except (AssertionError, TypeError, ValueError) as error:
            raise ValueError(f"reasoning_gym dataset {self.dataset!r}, params {self.params}: "
                             f"{error or type(error).__name__}") from None
        return config

    def train_problems(self) -> Sequence[Problem]:
        self._generate()
        return self._train

    def eval_problems(self) -> Sequence[Problem]:
        self._generate()
        return self._eval

    def score(self, completion: str, problem: Problem) -> Score:
        answer = text_after_marker(completion)
        if answer is None:
            return Score(correct=0.0, format=0.0)
        self._generate()
        entry = self._entries.get(problem.question)
        if entry is None:  # not one of this task's problems (built by hand): the answer is all there is
            entry = {"question": problem.question, "answer": problem.answer, "metadata": {}}
        value = self._scored(answer, entry) if self.score_timeout_s else self._scored_here(answer, entry)
        return Score(correct=float(value >= self.threshold), format=1.0)

    def _scored_here(self, answer: str, entry: dict) -> float:
        """The library's score of ``answer``, in this process; 0 where the scorer raises."""
        try:
            return float(self._scorer(answer, entry))
        except Exception:  # noqa: BLE001 - a library scorer choking on a malformed answer: no credit
            return 0.0
        except SystemExit as error:  # some scorers eval() the answer: a completion's "exit()" must not end the run
            if _raised_by_signal_handler(error):  # SIGTERM's (harness/apps/cli.py) still does
                raise
            return 0.0

    def _scored(self, answer: str, entry: dict) -> float:
        """The library's score of ``answer`` in the scorer's own process (:class:`IsolatedCall`); 0 where it raises,
        runs past ``score_timeout_s`` or ends its process (both said on stderr)."""
        outcome = self._scorer()(answer, entry)  # isolated_scorer's, looked up at each call
        if outcome.kind == "value":
            try:
                return float(outcome.detail)
            except (TypeError, ValueError):
                return 0.0
        if outcome.kind != "raised":
            print(f"reasoning_gym {self.dataset}: scoring the answer {answer[:60]!r}"
                  f"{'...' if len(answer) > 60 else ''} {'took ' if outcome.kind == 'timed out' else 'ended its '}"
                  f"{outcome.detail if outcome.kind == 'timed out' else 'process, ' + str(outcome.detail)}; it "
                  "scores 0 (the scorer runs in a process of its own: task.args.score_timeout_s)",
                  file=sys.stderr, flush=True)
        return 0.0

    def _generate(self) -> None:
        if self._eval:
            return
        from reasoning_gym.factory import DATASETS

        # some of the library's generators take minutes for 10000 problems (sudoku), which would pass without a word
        print(f"reasoning_gym {self.dataset}: generating {self.eval_size} eval and {self.train_size} training "
              "problems (once per process)", file=sys.stderr, flush=True)
        draws = 4 * (self.eval_size + self.train_size)
        config = self._generator_config(size=draws)
        generator = DATASETS[self.dataset][0](config=config)
        self._scorer = generator.score_answer if not self.score_timeout_s else functools.partial(
            isolated_scorer, DATASETS[self.dataset][0], config, self.score_timeout_s)
        entries: dict[str, dict] = {}
        index = 0
        while len(entries) < self.eval_size and index < draws:
            entry = generator[index]
            entries.setdefault(entry["question"] + REASONING_GYM_INSTRUCTION, entry)
            index += 1
        if len(entries) < self.eval_size:
            raise ValueError(f"{self.dataset}: only {len(entries)} distinct questions in {index} draws, fewer than "
                             f"eval_size={self.eval_size}; lower eval_size or widen params")
        train: list[Problem] = []
        while len(train) < self.train_size and index < draws:
            entry = generator[index]
            index += 1
            problem = self._problem(entry)
            if problem.question not in entries:
                self._entries.setdefault(problem.question, entry)
                train.append(problem)
        if len(train) < self.train_size:
            raise ValueError(f"{self.dataset}: {len(train)} train problems outside the eval set in {draws} draws, "
                             f"fewer than train_size={self.train_size}; the eval set covers most of the problems")
        self._entries.update(entries)
        self._eval, self._train = [self._problem(entry) for entry in entries.values()], train

    @staticmethod
    def _problem(entry: dict) -> Problem:
        answer = str(entry["answer"])
        return Problem(question=entry["question"] + REASONING_GYM_INSTRUCTION, answer=answer,
                       solution=f"#### {answer}")
