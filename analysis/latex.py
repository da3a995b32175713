r"""Booktabs LaTeX tables of a report's headline and paired results, for a paper (``python -m analysis ... --latex``),
written beside report.md:

- ``headline.tex``: per cell and objective, the final held-out eval accuracy: the mean over the seeds that ended
  (n) and its interval, the report's own numbers (report.eval_table, analysis/accuracy.py);
- ``paired.tex``: per cell, each objective against the verdict's baseline: the paired difference of final eval
  accuracy (the objective's minus the baseline's, by seed and eval problem; analysis/paired.py) with its interval,
  the Holm-adjusted p-value over the cell's comparisons to the baseline (analysis/verdict.py) and the seeds won and
  lost of those both ended (the rest tied).

Numbers to 3 significant digits (analysis.stats.num, as report.md shows them; a Holm p rounded down,
analysis.stats.p_text), in math mode (a true minus sign).
An interval carries report.md's qualifiers as marks, explained in the caption (:data:`MARKS`; --- where there is
none, and why). Each file is a ``table`` environment with caption and label that needs ``\usepackage{booktabs}``;
every text taken from the data (objective names, settings, the experiment's name) is escaped (:func:`escape`). With
several cells, the settings that tell them apart are columns, shown on a cell's first row, and a rule separates the
cells.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from analysis.accuracy import NO_INTERVAL
from analysis.cells import Cells
from analysis.stats import INDICATIVE_BELOW, indicative, num, p_text, top_units
from analysis.verdict import versus_baseline

SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
            "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
MARKS = {r"\ddagger": "the range (min--max) of 2 seeds, not an interval",
         "*": "over seeds only (the runs lack per-problem scores)",
         r"\dagger": f"fewer than {INDICATIVE_BELOW} seeds (or starting policies): indicative, the coverage falls "
                     "short of 95\\% in simulations"}
INTERVAL = (r"95\% $t$-interval whose variance adds the spread between seeds and the spread between eval problems "
            r"(the eval set is a sample of the task's problems)")
NONE = "---"


def escape(text) -> str:
    """``text`` as LaTeX prints it: its special characters escaped, its lines joined."""
    return "".join(SPECIALS.get(c, c) for c in " ".join(str(text).splitlines()))


def number(value, text_of=num) -> str:
    """A number in math mode, 3 significant digits (1.23e-05 as $1.23\\times 10^{-5}$; ``text_of``: p_text for a
    p-value, rounded down); --- when missing."""
    text = text_of(value)
    if text == "n/a":
        return NONE
    mantissa, _, exponent = text.replace(",", "{,}").partition("e")
    return f"${mantissa}" + (rf"\times 10^{{{int(exponent)}}}" if exponent else "") + "$"


def interval(low, high, n: int, problems: bool, top=None) -> tuple[str, list[str]]:
    """An interval with its marks (report.interval's qualifiers: indicative by its top level's units ``top``), and
    the marks; --- where report.md says n/a (its mark: NONE)."""
    if n < 2 or pd.isna(low):
        return NONE, [NONE]
    marks = ([r"\ddagger"] if n == 2 and not problems else []) + ([] if problems else ["*"])
    marks += [r"\dagger"] if indicative(top_units(n, top)) and r"\ddagger" not in marks else []
    bounds = f"[{number(low)[1:-1]}, {number(high)[1:-1]}]"
    return f"${bounds}" + (f"^{{{','.join(marks)}}}" if marks else "") + "$", marks


def tabular(header: list[str], align: str, rows: list[list[str]], cell_ids: list[int]) -> list[str]:
    """A booktabs tabular: a rule between cells."""
    lines = [rf"\begin{{tabular}}{{{align}}}", r"\toprule", " & ".join(header) + r" \\", r"\midrule"]
    for i, row in enumerate(rows):
        if i and cell_ids[i] != cell_ids[i - 1]:
            lines.append(r"\midrule")
        lines.append(" & ".join(row) + r" \\")
    return [*lines, r"\bottomrule", r"\end{tabular}"]


def cell_part(frame: pd.DataFrame, cells: Cells) -> tuple[list[str], list[list[str]]]:
    """The cell columns' headers and, per row, their values (on a cell's first row only)."""
    columns = cells.columns(frame["cell_id"])
    ids = list(frame["cell_id"])
    values = [[escape(v[i]) if i == 0 or ids[i] != ids[i - 1] else "" for v in map(list, columns.values())]
              for i in range(len(ids))]
    return [escape(c) for c in columns], values


def table_env(caption: str, label: str, body: list[str], comment: str) -> str:
    return "\n".join([f"% {' '.join(comment.splitlines())}", r"% needs \usepackage{booktabs}", r"\begin{table}",
                      r"\centering", rf"\caption{{{caption}}}", rf"\label{{{label}}}", *body, r"\end{table}", ""])


def marks_text(used: set[str], missing: str) -> str:
    """The caption's sentences for the marks used; ``missing``: what --- stands for, when it is used."""
    return "".join(f" ${m}$: {text}." for m, text in MARKS.items() if m in used) + \
        (f" {NONE}: {missing} ({NO_INTERVAL})." if NONE in used else "")


def label(name: str, what: str) -> str:
    return f"tab:{re.sub(r'[^A-Za-z0-9+.-]', '-', name)}-{what}"


def headline_tex(table: pd.DataFrame, cells: Cells, name: str, source: str) -> str:
    """headline.tex: table is report.eval_table's."""
    names, cell_values = cell_part(table, cells)
    rows, used = [], set()
    for values, row in zip(cell_values, table.itertuples(), strict=True):
        text, marks = interval(row.final_ci_low, row.final_ci_high, int(row.final_n), bool(row.final_problems),
                               getattr(row, "final_top", None))
        used.update(marks)
        rows.append([*values, escape(row.objective), str(int(row.final_n)), number(row.final_mean), text])
    caption = (f"{escape(name)}: final held-out eval accuracy per objective{' and cell' * bool(names)}, the mean "
               f"over the $n$ seeds that ended, with its {INTERVAL}.{marks_text(used, 'no interval')}")
    body = tabular([*names, "objective", "$n$", "final accuracy", "95\\% interval"], "l" * len(names) + "lrrl", rows,
                   list(table["cell_id"]))
    return table_env(caption, label(name, "headline"), body, f"{name}: from {source} (analysis/latex.py)")


def paired_tex(pairs: pd.DataFrame, cells: Cells, baseline: str | None, name: str, source: str) -> str:
    """paired.tex: pairs is paired.per_cell's; one line saying why when nothing is compared to the baseline."""
    versus = versus_baseline(pairs, baseline).reset_index(drop=True)
    comment = f"{name}: from {source} (analysis/latex.py)"
    if versus.empty:
        return f"% {' '.join(comment.splitlines())}\n% no objective shares an ended seed with the baseline " \
               f"({baseline or 'none'}) in any cell: no paired table\n"
    names, cell_values = cell_part(versus, cells)
    rows, used = [], set()
    for values, row in zip(cell_values, versus.itertuples(), strict=True):
        text, marks = interval(row.difference_low, row.difference_high, int(row.n), bool(row.problems),
                               getattr(row, "top", None))
        used.update(marks)
        rows.append([*values, escape(row.a), str(int(row.n)), number(row.difference), text, number(row.holm, p_text),
                     f"{row.wins}/{row.losses}"])
    base = escape(baseline)
    caption = (f"{escape(name)}: each objective against {base}{', per cell' * bool(names)}. Difference: the "
               f"objective's final held-out eval accuracy minus {base}'s, paired by seed and eval problem over the "
               f"$n$ seeds both ended, with its {INTERVAL}. Holm $p$: the paired $t$-test's $p$-value, Holm-adjusted "
               f"over the cell's comparisons to {base}. Won/lost: the seeds where the objective ended above/below "
               f"{base} (the rest tied).{marks_text(used, 'no interval, no $p$-value')}")
    body = tabular([*names, "objective", "$n$", f"$\\Delta$ vs.\\ {base}", "95\\% interval", "Holm $p$", "won/lost"],
                   "l" * len(names) + "lrrlrr", rows, list(versus["cell_id"]))
    return table_env(caption, label(name, "paired"), body, comment)


def write_tables(out_dir: Path, name: str, source: str, table: pd.DataFrame, pairs: pd.DataFrame, cells: Cells,
                 baseline: str | None) -> None:
    """headline.tex and paired.tex into out_dir (see the module docstring); source: the results folders read."""
    (out_dir / "headline.tex").write_text(headline_tex(table, cells, name, source))
    (out_dir / "paired.tex").write_text(paired_tex(pairs, cells, baseline, name, source))
