"""CLI: python -m analysis results/<experiment> [results/<other> ...] [--out DIR] [--smooth N] [--formats png,pdf]
[--paper] [--baseline NAME] [--latex]"""

import sys
import warnings
from pathlib import Path

from analysis.folders import folder_problem
from harness.run.commandline import OneLineParser
from harness.run.errors import one_line_for_a_broken_module


def main(argv: list[str] | None = None) -> int:
    """The arguments and the folders' existence are checked before the imports of the report (pandas, matplotlib,
    torch: seconds), so `-h` and a mistyped folder answer at once."""
    parser = OneLineParser(prog="python -m analysis", description=__doc__)
    parser.add_argument("results", nargs="+", help="the experiment's results folder, e.g. results/<experiment>; "
                        "several: one report over all their runs, a run held by two folders counted once "
                        "(analysis/combine.py)")
    parser.add_argument("--out", help="output folder (default: <results>/report; several folders: <a>+<b>/report "
                        "beside the first; needed for folders of one name)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing rolling mean over N steps of the train "
                        "metrics in the curves (default 1: no smoothing; eval accuracy is never smoothed)")
    parser.add_argument("--formats", default="png,pdf", help="figure formats besides the PNG the report embeds: "
                        "comma-separated, of png, pdf, svg (default png,pdf)")
    parser.add_argument("--paper", action="store_true", help="figures for a paper: no title, 3.3 in (single column) "
                        "or 6.8 in (double column) wide, print-sized fonts, PDF among the formats")
    parser.add_argument("--baseline", help="the objective the verdict compares the others to (default: the sweep's "
                        "sweep.baseline, else grpo when it has runs, else the sweep grid's first objective)")
    parser.add_argument("--latex", action="store_true", help="also booktabs tables for a paper beside report.md: "
                        "headline.tex (final accuracy per objective and cell) and paired.tex (each objective against "
                        "the baseline)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error("--smooth must be >= 1")
    if args.out is not None and not args.out.strip():  # "" was the default folder, without a word
        parser.error("--out is empty: give a folder, or leave --out out for <results>/report")
    if not all(folder.strip() for folder in args.results):  # "" was the current folder
        parser.error("results folder '' is empty: give an experiment's results folder (results/<experiment>, the one "
                     "holding manifest.json)")
    if problem := next(filter(None, map(folder_problem, map(Path, args.results))), None):
        print(f"error: {problem}", file=sys.stderr)
        return 1
    with one_line_for_a_broken_module():  # a file of objectives/ that does not import: one line, not a traceback
        from analysis.load import AnalysisError
        from analysis.report import build_report
        from harness.run.atomic import DiskFullError
    report, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = build_report(args.results, args.out, args.smooth, tuple(filter(None, args.formats.split(","))),
                                  args.paper, args.baseline, args.latex)
        except AnalysisError as e:
            error = e
        except DiskFullError as e:  # the report is written whole or not at all: nothing half-written to remove
            error = (f"disk full: could not write the report at {e.filename}; free some space there (or give --out "
                     "elsewhere), then run the same command again")
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    verdict = (report.parent / "verdict.txt").read_text().splitlines()
    print("\n".join(["verdict:", *(f"  {line}" for line in verdict)]) if verdict else "verdict: none (no run ended)")
    print(f"report: {report.parent / 'report.html'} (and report.md, figures and tables in {report.parent})")
    if args.latex:
        print(f"LaTeX: {report.parent / 'headline.tex'}, {report.parent / 'paired.tex'} (booktabs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
