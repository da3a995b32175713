"""harness/run/collapse.py: the collapse rule pinned on hand-made metric rows (each cause, the boundaries, null =
NaN)."""

import json
import math

import pytest

from harness.run.collapse import CAUSES, CollapseRule, detect_collapse


def run(steps: int = 12, start: float = 0.5, evals: dict | None = None, eval_every: int = 2, **per_step) -> list[dict]:
    """Healthy rows (entropy 0.8, clip 0.01, finite loss): evals every eval_every steps at `start` unless `evals`
    gives {step: accuracy}; per_step: key -> {step: value} overrides."""
    rows = [{"step": 0, "eval_accuracy": start}]
    for step in range(1, steps + 1):
        row = {"step": step, "loss": 0.1, "pg_loss": 0.1, "grad_norm": 0.5, "entropy": 0.8, "clip_frac": 0.01,
               "nonfinite_skips": 0}
        if step % eval_every == 0:
            row["eval_accuracy"] = (evals or {}).get(step, start)
        for key, values in per_step.items():
            if step in values:
                row[key] = values[step]
        rows.append(row)
    return rows


def test_healthy_run_has_no_collapse():
    assert detect_collapse(run()) is None
    assert detect_collapse([]) is None and detect_collapse([{"step": 0, "eval_accuracy": 0.3}]) is None


def test_eval_drop_needs_more_than_the_margin_for_k_consecutive_evals():
    rule = CollapseRule()  # margin 0.1, 2 evals
    # 0.5 -> 0.35 at steps 6 and 8: below 0.4 twice in a row, onset 6
    found = detect_collapse(run(evals={6: 0.35, 8: 0.35}), rule)
    assert found == {"step": 6, "cause": "eval_drop", "detail": {
        "confirmed_at": 8, "key": "eval_accuracy", "threshold": pytest.approx(0.4), "values": [0.35, 0.35],
        "start": 0.5}}
    # exactly the margin below the start is not a drop; a hair more is
    assert detect_collapse(run(evals={6: 0.4, 8: 0.4})) is None
    assert detect_collapse(run(evals={6: 0.3999, 8: 0.3999}))["step"] == 6
    # one low eval, then a recovery, then one low eval: never two in a row
    assert detect_collapse(run(evals={4: 0.2, 6: 0.5, 8: 0.2})) is None
    # the count is of evaluations, not of steps: steps without an eval do not break the streak
    assert detect_collapse(run(evals={4: 0.2, 6: 0.2}, eval_every=2))["detail"]["confirmed_at"] == 6
    assert detect_collapse(run(evals={4: 0.2, 6: 0.2, 8: 0.2}), CollapseRule(eval_consecutive=3))["step"] == 4
    assert detect_collapse(run(evals={4: 0.2, 6: 0.2}), CollapseRule(eval_consecutive=3)) is None


def test_non_finite_loss_stored_as_null():
    """The harness writes NaN/inf as JSON null: a null loss is non-finite, an absent one is not."""
    rows = run(loss={5: None})
    found = detect_collapse(json.loads(json.dumps(rows)))
    assert found == {"step": 5, "cause": "non_finite_loss",
                     "detail": {"confirmed_at": 5, "key": "loss", "threshold": None}}
    assert detect_collapse(run(grad_norm={3: math.inf}))["detail"]["key"] == "grad_norm"
    without = run()
    del without[4]["loss"]
    assert detect_collapse(without) is None
    # the loop's counter of skipped non-finite updates grew at step 7 (the meter left the loss out of the row)
    skips = run(nonfinite_skips={s: 2 for s in range(7, 13)})
    assert detect_collapse(skips)["step"] == 7 and detect_collapse(skips)["detail"]["key"] == "nonfinite_skips"
    # consecutive count: two non-finite steps needed, 5 alone is not enough, 8-9 are
    rule = CollapseRule(nonfinite_consecutive=2)
    assert detect_collapse(run(loss={5: None}), rule) is None
    assert detect_collapse(run(loss={5: None, 8: None, 9: None}), rule)["step"] == 8


def test_entropy_floor_for_k_steps():
    low = {s: 0.005 for s in range(3, 8)}  # 5 steps: 3..7
    found = detect_collapse(run(entropy=low))
    assert (found["cause"], found["step"], found["detail"]["confirmed_at"]) == ("entropy_floor", 3, 7)
    assert found["detail"]["values"] == [0.005] * 5
    assert detect_collapse(run(entropy={s: 0.005 for s in range(3, 7)})) is None  # 4 steps
    assert detect_collapse(run(entropy={s: 0.01 for s in range(3, 9)})) is None  # at the floor is not below it
    # a step that does not report a finite entropy ends the streak (a null entropy is the non-finite cause's business)
    broken = run(entropy={**{s: 0.005 for s in range(3, 12)}, 6: None})  # 3-5, then 7-11
    assert detect_collapse(broken, CollapseRule(entropy_consecutive=5))["step"] == 7


def test_clip_saturation():
    found = detect_collapse(run(clip_frac={4: 0.95, 5: 0.9, 6: 1.0}))
    assert (found["cause"], found["step"], found["detail"]["confirmed_at"]) == ("clip_saturation", 4, 6)
    assert detect_collapse(run(clip_frac={4: 0.95, 5: 0.89, 6: 1.0})) is None


def test_first_confirmed_cause_wins_and_order_of_rows_does_not_matter():
    rows = run(evals={4: 0.1, 6: 0.1}, entropy={s: 0.0 for s in range(1, 13)}, loss={10: None})
    # entropy confirmed at step 5 (onset 1), eval at 6, non-finite at 10
    assert detect_collapse(rows)["cause"] == "entropy_floor"
    assert detect_collapse(list(reversed(rows))) == detect_collapse(rows)
    # same confirming step: CAUSES order (non-finite first)
    tie = run(clip_frac={s: 1.0 for s in range(1, 13)}, loss={3: None})
    assert detect_collapse(tie)["cause"] == "non_finite_loss" and CAUSES[0] == "non_finite_loss"


def test_rule_is_validated_and_serialisable():
    with pytest.raises(ValueError, match="eval_consecutive must be >= 1"):
        CollapseRule(eval_consecutive=0)
    with pytest.raises(ValueError, match="clip_ceiling"):
        CollapseRule(clip_ceiling=1.5)
    assert json.loads(json.dumps(CollapseRule().as_dict()))["nonfinite_keys"] == ["loss", "pg_loss", "grad_norm"]


def test_module_is_pure():
    """No torch, no harness imports: the analysis reads it without the training stack."""
    import ast
    from pathlib import Path

    import harness.run.collapse as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "math", "dataclasses"}


def test_the_start_is_the_first_eval_step_zero_is_not_trained_and_a_repeated_step_keeps_its_last_row():
    # eval_drop is measured from the first evaluation, not the best: 0.3 -> 0.6 -> 0.45, 0.45 has not collapsed
    assert detect_collapse(run(start=0.3, evals={2: 0.6, 4: 0.45, 6: 0.45, 8: 0.45})) is None
    # step 0 (the starting policy's evaluation) is no training step: nothing it reports starts a streak
    rows = run(entropy={s: 0.0 for s in range(1, 5)}, clip_frac={s: 1.0 for s in range(1, 3)})
    rows[0].update(loss=None, entropy=0.0, clip_frac=1.0)
    assert detect_collapse(rows, CollapseRule(entropy_consecutive=5, clip_consecutive=3)) is None
    # a step logged twice (a resumed run's repeated line) is judged by its last row
    repeated = run()
    repeated.insert(5, {**repeated[5], "loss": None})
    assert detect_collapse(repeated) is None
    assert detect_collapse(list(reversed(repeated)))["cause"] == "non_finite_loss"
    # the skip counter is cumulative: one skip at step 3 is one non-finite step, not every step after it
    assert detect_collapse(run(nonfinite_skips={s: 1 for s in range(3, 13)}), CollapseRule(nonfinite_consecutive=2)) \
        is None
