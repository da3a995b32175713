"""Collapse detection: a stated rule that says whether, where and why a run collapsed, from its per-step metric rows.

Pure (standard library only): a run's records (harness/run/records.py, both backends) apply it to the rows logged so
far every time they write summary.json, as ``summary["collapse"]``, and the analysis applies it to the metrics.jsonl
of runs written before that, so both agree.

A run has collapsed when any of these holds (each cause's onset step is reported; when several causes hold, the one
confirmed first wins, ties in the order of ``CAUSES``):

- ``non_finite_loss``: a training step's loss, policy loss or gradient norm is non-finite (NaN/inf; the harness writes
  them as JSON null, and its MetricMeter leaves a wholly non-finite key out of the row), or the step skipped updates
  for it (``nonfinite_skips`` grew), for ``nonfinite_consecutive`` steps in a row;
- ``eval_drop``: the eval accuracy is below the run's first evaluation (step 0: the starting policy) by more than
  ``eval_margin`` for ``eval_consecutive`` evaluations in a row;
- ``entropy_floor``: the policy entropy is below ``entropy_floor`` for ``entropy_consecutive`` training steps in a row;
- ``clip_saturation``: the clip fraction is at least ``clip_ceiling`` for ``clip_consecutive`` training steps in a row.

"In a row" counts the rows that report the quantity (evaluations for ``eval_drop``; training steps >= 1 for the
others); a training step that does not report a finite value of entropy or clip fraction ends that streak.

``summary["collapse"]`` (what the loop writes; the report reads it when present, else calls detect_collapse):
    null                                   the rule was applied and found no collapse
    {"step": int,                          onset: the first step of the streak that confirmed the collapse
     "cause": str,                         one of CAUSES
     "detail": {"confirmed_at": int,       the step at which the streak reached its length
                "key": str,                the metric that triggered
                "values": [...],           its values over the streak (null for non-finite)
                "threshold": float | None, the bound it crossed (start - margin, the floor or the ceiling)
                ...},                      eval_drop adds "start"
     "rule": {...}}                        optional: CollapseRule's fields (dataclasses.asdict) used
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

CAUSES = ("non_finite_loss", "eval_drop", "entropy_floor", "clip_saturation")


@dataclass(frozen=True)
class CollapseRule:
    """The thresholds of detect_collapse. Defaults and why a researcher would defend them:"""

    # eval_drop: absolute accuracy below the starting policy's eval accuracy. 0.1 is about two binomial standard
    # errors of the default 128-problem eval at any accuracy (sqrt(0.25 / 128) = 0.044), and two consecutive evals
    # are required, so one unlucky evaluation is not a collapse; losing 10 points of what the run started with is.
    eval_margin: float = 0.1
    eval_consecutive: int = 2
    # non_finite_loss: one step is enough. A NaN/inf loss or gradient is not noise: the objective's numerics broke
    # (the native loop skips that update, and after train.max_nonfinite_in_row skips in a row stops the run with
    # status "diverged").
    nonfinite_consecutive: int = 1
    # entropy_floor (nats per token): at 0.01 the sampler's top token has probability > 0.999 almost everywhere, so a
    # group's completions are nearly identical, its rewards equal and its group-relative advantages 0: learning
    # stops. Five training steps so that a single sharp batch is not a collapse.
    entropy_floor: float = 0.01
    entropy_consecutive: int = 5
    # clip_saturation: nine in ten tokens clipped means the policy has left the trust region on almost every token
    # and the clipped objective passes (almost) no gradient; three steps in a row so a one-batch spike is ignored.
    clip_ceiling: float = 0.9
    clip_consecutive: int = 3
    # the metric names the harness logs (harness/loop/native.py, objectives/base.py)
    eval_key: str = "eval_accuracy"
    entropy_key: str = "entropy"
    clip_key: str = "clip_frac"
    nonfinite_keys: tuple[str, ...] = ("loss", "pg_loss", "grad_norm")
    skips_key: str = "nonfinite_skips"  # cumulative count of updates skipped for a non-finite loss or gradient

    def __post_init__(self):
        for name in ("eval_consecutive", "nonfinite_consecutive", "entropy_consecutive", "clip_consecutive"):
            if getattr(self, name) < 1:
                raise ValueError(f"CollapseRule.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_margin < 0 or self.entropy_floor < 0:
            raise ValueError(f"CollapseRule.eval_margin and entropy_floor must be >= 0, got {self.eval_margin} and "
                             f"{self.entropy_floor}")
        if not 0 < self.clip_ceiling <= 1:
            raise ValueError(f"CollapseRule.clip_ceiling must be in (0, 1], got {self.clip_ceiling}")

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def finite(value) -> bool:
    """A real number that is neither NaN nor infinite (None, the harness's JSON for NaN/inf, is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _streak(points: list[tuple[int, object, bool]], length: int, key: str, threshold) -> dict | None:
    """The first run of ``length`` consecutive points whose flag is True: (step, value, flag) in step order."""
    start = 0
    for i, (_, _, hit) in enumerate(points):
        if not hit:
            start = i + 1
        elif i - start + 1 == length:
            streak = points[start : i + 1]
            return {"step": int(streak[0][0]), "detail": {
                "confirmed_at": int(points[i][0]), "key": key, "threshold": threshold,
                "values": [v if finite(v) else None for _, v, _ in streak]}}
    return None


def _nonfinite(rows: list[dict], rule: CollapseRule) -> dict | None:
    points, skips = [], 0
    for row in rows:
        if row["step"] < 1:
            continue
        bad = [k for k in rule.nonfinite_keys if k in row and not finite(row[k])]
        count = row.get(rule.skips_key)
        if finite(count):
            if count > skips:
                bad.append(rule.skips_key)
            skips = max(skips, count)
        points.append((row["step"], None if bad else 0.0, bool(bad), bad))
    found = _streak([p[:3] for p in points], rule.nonfinite_consecutive, "", None)
    if found:
        onset = next(p for p in points if p[0] == found["step"])
        found["detail"]["key"] = ", ".join(onset[3])
        found["detail"].pop("values")
    return found


def _eval_drop(rows: list[dict], rule: CollapseRule) -> dict | None:
    evals = [(row["step"], row[rule.eval_key]) for row in rows if finite(row.get(rule.eval_key))]
    if len(evals) < 2:
        return None
    start = evals[0][1]
    threshold = start - rule.eval_margin
    points = [(step, value, value < threshold - 1e-12) for step, value in evals[1:]]  # a drop of exactly the margin
    found = _streak(points, rule.eval_consecutive, rule.eval_key, threshold)       # is not "more than" it
    if found:
        found["detail"]["start"] = start
    return found


def _train_streak(rows: list[dict], key: str, length: int, threshold: float, below: bool) -> dict | None:
    points = []
    for row in rows:
        if row["step"] >= 1:
            value = row.get(key)
            hit = finite(value) and (value < threshold if below else value >= threshold)
            points.append((row["step"], value, hit))
    return _streak(points, length, key, threshold)


def detect_collapse(rows: list[dict], rule: CollapseRule | None = None) -> dict | None:
    """The collapse of a run from its metric rows (metrics.jsonl's lines as dicts, any order; rows without a numeric
    ``step`` are ignored, a repeated step keeps its last row), or None. Returns {"step", "cause", "detail"} (see the
    module docstring)."""
    rule = rule or CollapseRule()
    by_step = {}
    for row in rows:
        if isinstance(row, dict) and finite(row.get("step")):
            by_step[row["step"]] = row
    rows = [by_step[s] for s in sorted(by_step)]
    found = {"non_finite_loss": _nonfinite(rows, rule),
             "eval_drop": _eval_drop(rows, rule),
             "entropy_floor": _train_streak(rows, rule.entropy_key, rule.entropy_consecutive, rule.entropy_floor,
                                            below=True),
             "clip_saturation": _train_streak(rows, rule.clip_key, rule.clip_consecutive, rule.clip_ceiling,
                                              below=False)}
    hits = [(f["detail"]["confirmed_at"], CAUSES.index(cause), cause, f) for cause, f in found.items() if f]
    if not hits:
        return None
    _, _, cause, first = min(hits)
    return {"step": first["step"], "cause": cause, "detail": first["detail"]}
