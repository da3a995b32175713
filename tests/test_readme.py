"""The README's code examples are the tested ones: the task example registers, builds and scores."""

from __future__ import annotations

import re
from pathlib import Path

from harness.tasks import TASKS, get_task

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_task_example_registers_and_scores(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (code,) = [b for b in blocks if "@register_task(" in b]
    monkeypatch.setattr(TASKS, "_items", dict(TASKS._items))  # register into a copy: other tests see no parity
    exec(compile(code, "README.md", "exec"), {})
    task = get_task("parity", eval_size=8)
    problem = task.eval_problems()[0]
    assert len(task.eval_problems()) == 8 and problem.answer == "1"  # 100 is even
    assert task.score(problem.solution, problem).correct == 1.0
    assert task.score("#### 0", problem).correct == 0.0 and task.score("yes", problem).format == 0.0


def test_every_make_target_and_experiment_the_readme_names_exists():
    """`make X` in the README's shell blocks is a Makefile target; `EXP=name` an experiment file."""
    from harness.run.config import EXPERIMENTS_DIR

    text = "\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S))
    makefile = (README.parent / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    named = set(re.findall(r"^\s*make ([a-z][a-z-]*)", text, flags=re.M))
    assert named and named <= targets, f"README names make targets that do not exist: {named - targets}"
    experiments = set(re.findall(r"EXP=([a-z0-9_]+)", text))
    assert all((EXPERIMENTS_DIR / f"{e}.yaml").exists() for e in experiments), experiments
