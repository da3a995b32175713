"""One report over several results folders (analysis/combine.py) and its LaTeX tables (analysis/latex.py), on small
synthetic folders (tests/helpers/fake_runs.py): a run held by two folders is read once, copies that differ are kept
apart and named, runs of other settings or code are other cells; the tables' contents and escaping."""

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from analysis import AnalysisError, load_experiments
from analysis.__main__ import main
from analysis.latex import escape, headline_tex, number, paired_tex
from analysis.paired import per_cell
from analysis.report import eval_table
from analysis.verdict import cell_verdicts
from tests.helpers.fake_runs import Shape, code_segments, fake_experiment, fake_run
from tests.helpers.processes import MAKE_ALONE

ROOT = Path(__file__).resolve().parent.parent


def load(*dirs: Path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp = load_experiments(list(dirs))
    return exp, [str(w.message) for w in caught]


def shared_id(objective: str, seed: int) -> str:
    """A run id as harness/run/config.py makes it: the same in every experiment that asks for the same run."""
    return f"{objective}-s{seed}-5e77a9c1"


def two_folders(tmp_path: Path, **copy) -> tuple[Path, Path]:
    """results/a: grpo and dr_grpo, seeds 0-2; results/b: grpo seed 0 again (`copy`: how b's copy is written, a
    fake_run's keywords) and gspo seeds 0-2."""
    a, b = tmp_path / "results" / "a", tmp_path / "results" / "b"
    fake_experiment(a, [fake_run(a, o, s, run_id=shared_id(o, s), final=0.4 + 0.1 * (o == "dr_grpo") + 0.01 * s)
                        for o in ("grpo", "dr_grpo") for s in range(3)])
    fake_experiment(b, [fake_run(b, "grpo", 0, run_id=shared_id("grpo", 0), **{"final": 0.4, **copy}),
                        *(fake_run(b, "gspo", s, run_id=shared_id("gspo", s), final=0.45 + 0.01 * s)
                          for s in range(3))])
    return a, b


# ---------------------------------------------------------------------------------------------- equal runs


def test_a_run_held_by_two_folders_is_read_once_and_said_so(tmp_path):
    """b's copy of grpo seed 0 was timed on another machine (its timings and wall time differ): the same run."""
    a, b = two_folders(tmp_path, rows={2: {"rollout_s": 9.0, "update_s": 3.5, "peak_mb": 800.0}},
                       summary_extra={"wall_time_s": 99.0})
    exp, caught = load(a, b)
    assert list(exp.runs["run_id"]).count(shared_id("grpo", 0)) == 1 and len(exp.runs) == 9
    assert exp.runs.set_index("run_id").loc[shared_id("grpo", 0), "source"] == "a, b"
    (line,) = [w for w in caught if "with the same records" in w]
    assert f"counted once: `{shared_id('grpo', 0)}` (a, b)" in line
    assert not [w for w in caught if "duplicate runs" in w or "different records" in w]
    table = eval_table(exp.runs, exp.cells.axes).set_index("objective")
    assert dict(table["seeds"]) == {"grpo": 3, "dr_grpo": 3, "gspo": 3}
    assert exp.name == "a+b" and exp.dir == tmp_path / "results" / "a+b" and exp.sources == [a, b]


@pytest.mark.slow
def test_one_folder_is_load_experiment_with_its_source(tmp_path):
    a, _ = two_folders(tmp_path)
    exp, _ = load(a)
    assert exp.sources == [a] and set(exp.runs["source"]) == {"a"} and exp.dir == a
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for alone in (a, str(a)):  # a folder given alone, not in a list: not a list of its characters
            assert load_experiments(alone).runs.equals(exp.runs)


# ---------------------------------------------------------------------------------------------- copies that differ


def write_samples(run_dir: Path, correct: list[int]) -> None:
    (run_dir / "eval_samples.jsonl").write_text("".join(
        json.dumps({"step": 6, "problem": p, "answer": "1", "correct": c}) + "\n" for p, c in enumerate(correct)))


@pytest.mark.parametrize("copy, said", [
    ({"final": 0.9}, "final_eval_accuracy 0.4 vs 0.9"),
    ({"rows": {2: {"entropy": 0.5}}}, "metrics differ from step 2 (`entropy`)"),
    ({"rows": {3: {"kl_ref": 0.01}}}, "metrics logged by one copy only: `kl_ref`"),
    ({"status": "failed", "shape": Shape(steps_done=3)}, "status finished vs failed"),
    ({"summary_extra": code_segments("v2")}, "code unknown vs v2"),
    ({"samples": [1, 0, 0, 1]}, "per-problem eval scores (eval_samples.jsonl) differ"),
])
@pytest.mark.slow
def test_copies_with_different_records_are_kept_apart_in_one_warning(tmp_path, copy, said):
    samples = copy.pop("samples", None)
    a, b = two_folders(tmp_path, **copy)
    if samples:
        write_samples(a / shared_id("grpo", 0), [1, 1, 0, 0])
        write_samples(b / shared_id("grpo", 0), samples)
    exp, caught = load(a, b)
    runs = exp.runs.set_index("run_id")
    ours, theirs = f"a/{shared_id('grpo', 0)}", f"b/{shared_id('grpo', 0)}"
    assert shared_id("grpo", 0) not in runs.index and runs.loc[ours, "source"] == "a" and \
        runs.loc[theirs, "source"] == "b"
    assert set(exp.metrics["run_id"]) >= {ours, theirs} and len(exp.runs) == 10
    (line,) = [w for w in caught if "different records" in w]
    assert f"`{shared_id('grpo', 0)}`: a vs b: {said}" in line
    if "code" in said:  # another code version: another cell, where it is that cell's only seed
        assert runs.loc[ours, "cell"] != runs.loc[theirs, "cell"] and runs.loc[theirs, "counted"]
    else:  # the same condition and seed: one copy counted, the other named a duplicate
        assert runs.loc[ours, "cell"] == runs.loc[theirs, "cell"]
        assert runs.loc[[ours, theirs], "counted"].sum() == 1
        assert any(w.startswith("duplicate runs: grpo, seed 0") for w in caught)
    assert dict(eval_table(exp.runs, exp.cells.axes).groupby("objective")["seeds"].sum())["grpo"] == 3 + \
        ("code" in said)


# ---------------------------------------------------------------------------------------------- cells


@pytest.mark.slow
def test_runs_of_other_settings_or_code_are_other_cells_never_pooled(tmp_path):
    """a: grpo and gspo at lr 1e-4; b: the same objectives at lr 1e-3 (the same seeds: other runs, other ids);
    c: grpo at lr 1e-4 run by other code. Three cells, never six seeds of one."""
    folders = []
    for name, lr, code in (("a", 1e-4, None), ("b", 1e-3, None), ("c", 1e-4, "v2")):
        d = tmp_path / name
        objectives = ("grpo",) if code else ("grpo", "gspo")
        fake_experiment(d, [fake_run(d, o, s, {"train.lr": lr}, run_id=f"{o}-s{s}-{name}{lr:g}",
                                     summary_extra=code_segments(code) if code else None)
                            for o in objectives for s in range(2)])
        folders.append(d)
    exp, caught = load(*folders)
    assert exp.cells.axes == ["code", "train.lr"] and len(exp.cells.labels) == 3
    table = eval_table(exp.runs, exp.cells.axes)
    assert list(table["seeds"]) == [2] * 5 and sorted(table["objective"]) == ["grpo"] * 3 + ["gspo"] * 2
    assert not [w for w in caught if "duplicate" in w or "records" in w]
    cells = exp.runs.groupby("cell")["source"].agg(set)
    assert sorted(map(sorted, cells)) == [["a"], ["b"], ["c"]]


def test_folders_given_as_dot_are_named_by_their_own_names(tmp_path, monkeypatch):
    a, b = two_folders(tmp_path)
    monkeypatch.chdir(a)
    exp, caught = load(Path("."), Path("../b"))
    assert exp.name == "a+b" and exp.dir.resolve() == (tmp_path / "results" / "a+b").resolve()
    assert any("counted once: `" + shared_id("grpo", 0) + "` (a, b)" in w for w in caught)


def test_a_folder_given_twice_or_missing_is_refused(tmp_path):
    a, b = two_folders(tmp_path)
    with pytest.raises(AnalysisError, match="given twice"):
        load_experiments([a, b, tmp_path / "results" / ".." / "results" / "a"])
    with pytest.raises(AnalysisError, match="does not exist"):
        load_experiments([a, tmp_path / "nowhere"])


def test_folders_that_name_different_baselines_leave_it_to_the_default_rule(tmp_path):
    a, b = two_folders(tmp_path)
    for folder, baseline in ((a, "dr_grpo"), (b, "gspo")):
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**manifest, "baseline": baseline,
                                                          "objectives": [baseline, "grpo"]}))
    exp, caught = load(a, b)
    assert exp.baseline is None and exp.objectives == ["dr_grpo", "grpo", "gspo"]
    assert any("name different baselines (a: dr_grpo, b: gspo)" in w for w in caught)


# ---------------------------------------------------------------------------------------------- LaTeX


def numbers_of(exp):
    table = eval_table(exp.runs, exp.cells.axes, exp.samples)
    pairs = per_cell(exp.runs, samples=exp.samples, baseline="grpo")
    return table, pairs


def test_escape_every_latex_special():
    assert escape(r"dr_grpo & 50% $#{x}~^\n") == (r"dr\_grpo \& 50\% \$\#\{x\}\textasciitilde{}\textasciicircum{}"
                                                   r"\textbackslash{}n")
    assert escape("two\nlines") == "two lines"
    assert number(-0.0125) == "$-0.0125$" and number(1.234e-5) == r"$1.23\times 10^{-5}$" and number(None) == "---"


@pytest.mark.slow
def test_headline_tex_holds_each_objective_and_cell_with_its_interval(tmp_path):
    """Two cells (lr 1e-4 with 5 seeds, lr 1e-3 with 2) of grpo and dr_grpo: the report's means and intervals,
    the marks the report's qualifiers become, the axis value on a cell's first row, a rule between cells."""
    d = tmp_path / "lr_sweep"
    fake_experiment(d, [fake_run(d, o, s, {"train.lr": lr}, final=0.4 + 0.1 * (o == "dr_grpo") + 0.02 * s)
                        for lr, seeds in ((1e-4, 5), (1e-3, 2)) for o in ("grpo", "dr_grpo") for s in range(seeds)])
    exp, _ = load(d)
    table, _ = numbers_of(exp)
    tex = headline_tex(table, exp.cells, exp.name, "`results/lr_sweep`")
    lines = tex.splitlines()
    assert r"\usepackage{booktabs}" in lines[1] and r"\label{tab:lr-sweep-headline}" in lines
    assert lines.count(r"\toprule") == 1 and lines.count(r"\bottomrule") == 1 and lines.count(r"\midrule") == 2
    assert r"\caption{lr\_sweep: final held-out eval accuracy per objective and cell" in tex
    assert r"lr & objective & $n$ & final accuracy & 95\% interval \\" in lines
    row = table[(table["objective"] == "dr_grpo") & (table["cell_id"] == 0)].iloc[0]  # lr 1e-4: 5 seeds
    assert row["final_n"] == 5
    body = lines[lines.index(r"\midrule") + 1:lines.index(r"\bottomrule")]
    # dr_grpo first (the registry's order), with the cell's setting; grpo's row leaves it blank
    assert body[0] == (rf"0.0001 & dr\_grpo & 5 & {number(row['final_mean'])} & $[{number(row['final_ci_low'])[1:-1]}, "
                       rf"{number(row['final_ci_high'])[1:-1]}]^{{*}}$ \\")  # 5 seeds: not indicative; seeds only
    assert body[1].startswith(" & grpo & 5 & ") and body[2] == r"\midrule" and body[3].startswith("0.001 & dr\\_grpo")
    assert body[3].endswith(r"]^{\ddagger,*}$ \\") and len(body) == 5  # 2 seeds without per-problem scores: a range
    assert r"$\ddagger$: the range (min--max) of 2 seeds" in tex and r"$\dagger$" not in tex and "---" not in tex


@pytest.mark.slow
def test_paired_tex_holds_the_verdicts_differences_holm_p_and_seeds_won_lost(tmp_path):
    """grpo, dr_grpo and gspo with per-problem scores: each objective against grpo, the same numbers the verdict
    ranks (its Holm-adjusted p), the seeds won and lost."""
    d = tmp_path / "trio"
    effect = {"grpo": 0.0, "dr_grpo": 0.1, "gspo": -0.05}
    entries = [fake_run(d, o, s, final=0.4 + effect[o] + 0.1 * s) for o in effect for s in range(2)]
    fake_experiment(d, entries)
    for e in entries:  # 20 eval problems: the first 20 x final solved
        final = 0.4 + effect[e["objective"]] + 0.1 * e["seed"]
        write_samples(d / e["run_id"], [int(p < round(final * 20)) for p in range(20)])
    exp, _ = load(d)
    table, pairs = numbers_of(exp)
    tex = paired_tex(pairs, exp.cells, "grpo", exp.name, "`results/trio`")
    (verdict,) = cell_verdicts(table, pairs, exp.cells.labels, "grpo")
    ranked = verdict.table.set_index("objective")
    lines = tex.splitlines()
    assert r"objective & $n$ & $\Delta$ vs.\ grpo & 95\% interval & Holm $p$ & won/lost \\" in lines
    for objective, won_lost in (("dr_grpo", "2/0"), ("gspo", "0/2")):
        row = pairs[(pairs["a"] == objective) & (pairs["b"] == "grpo")].iloc[0]
        line = next(line for line in lines if line.startswith(escape(objective) + " & "))
        cells = [c.strip() for c in line.removesuffix(r"\\").split("&")]
        assert cells[1] == "2" and cells[2] == number(row["difference"]) and cells[5] == won_lost
        assert row["problems"]  # by seed and eval problem: an interval of 2 seeds, indicative
        assert cells[3] == (f"$[{number(row['difference_low'])[1:-1]}, {number(row['difference_high'])[1:-1]}]"
                            r"^{\dagger}$")
        assert cells[4] == number(float(ranked.loc[objective, "Holm p"]))  # the verdict's Holm p, to its digits
    assert "grpo &" not in "".join(line[:6] for line in lines)  # the baseline is not compared to itself
    assert r"\caption{trio: each objective against grpo." in tex and "Holm-adjusted" in tex


def test_one_seed_has_no_interval_and_the_caption_says_why_and_no_paired_table(tmp_path):
    d = tmp_path / "alone"
    fake_experiment(d, [fake_run(d, "grpo", 0)])
    exp, _ = load(d)
    table, pairs = numbers_of(exp)
    headline = headline_tex(table, exp.cells, exp.name, "`results/alone`")
    assert r"grpo & 1 & $0.500$ & --- \\" in headline.splitlines()
    assert "---: no interval (fewer than 2 seeds, or seeds that agree exactly and lack per-problem scores)." in headline
    tex = paired_tex(pairs, exp.cells, "grpo", exp.name, "`results/alone`")
    assert r"\begin{table}" not in tex and "no objective shares an ended seed with the baseline (grpo)" in tex


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_the_cli_writes_one_report_of_two_folders_with_latex(tmp_path, capsys):
    a, b = two_folders(tmp_path)
    assert main([str(a), str(b), "--latex", "--formats", "png"]) == 0
    out_dir = tmp_path / "results" / "a+b" / "report"
    printed = capsys.readouterr()
    assert f"report: {out_dir / 'report.html'}" in printed.out and "LaTeX: " in printed.out
    assert "counted once" in printed.err
    md = (out_dir / "report.md").read_text()
    assert md.startswith("# Report: a+b") and f"Source: `{a}`, `{b}`." in md and "- experiment: a, b" in md
    assert f"| {shared_id('grpo', 0)} | grpo | a, b |" in md  # the folder column
    assert r"\begin{tabular}" in (out_dir / "headline.tex").read_text()
    assert r"gspo & 3 &" in (out_dir / "paired.tex").read_text()
    assert not (a / "report").exists() and not (b / "report").exists()
    if shutil.which("pdflatex"):  # the tables compile where LaTeX is installed
        doc = tmp_path / "doc.tex"
        doc.write_text("\\documentclass{article}\n\\usepackage{booktabs}\n\\begin{document}\n\\input{"
                       f"{out_dir / 'headline.tex'}}}\n\\input{{{out_dir / 'paired.tex'}}}\n\\end{{document}}\n")
        subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=tmp_path,
                       check=True, capture_output=True, timeout=120)


@pytest.mark.slow
def test_make_plots_passes_several_experiments_and_latex():
    made = subprocess.run(["make", "--no-print-directory", "-n", "-f", str(ROOT / "Makefile"), "plots",
                           "EXP=a,b", "PAPER=1", "LATEX=1", "PY=python"], capture_output=True, text=True, check=True,
                          env=MAKE_ALONE)
    assert made.stdout.split() == ["python", "-m", "analysis", "results/a", "results/b", "--paper", "--latex"]
    made = subprocess.run(["make", "--no-print-directory", "-n", "-f", str(ROOT / "Makefile"), "plots",
                           "EXP=/abs/x,b", "PY=python"], capture_output=True, text=True, check=True,
                          env=MAKE_ALONE)
    assert made.stdout.split() == ["python", "-m", "analysis", "/abs/x", "results/b"]  # was results//abs/x
    made = subprocess.run(["make", "--no-print-directory", "-n", "-f", str(ROOT / "Makefile"), "plots",
                           "EXP=a/x,b/x", "OUT=both", "PY=python"], capture_output=True, text=True, check=True,
                          env=MAKE_ALONE)
    assert made.stdout.split() == ["python", "-m", "analysis", "results/a/x", "results/b/x", "--out", '"both"']


@pytest.mark.slow  # seconds of runs or reports: make test
def test_folders_of_one_name_need_their_own_report_folder(tmp_path, capsys):
    """`a/x b/x` then `a/x c/x` would both write `a/x+x/report`: the second replaced the first pair's report."""
    folders = [fake_experiment(tmp_path / parent / "x", [fake_run(tmp_path / parent / "x", "grpo", 0)])
               for parent in ("a", "b")]
    assert main([*map(str, folders), "--formats", "png"]) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"error: the folders share the name x: the default report folder "
                        f"({tmp_path / 'a' / 'x+x' / 'report'}) would be any such pair's; give --out (make plots: "
                        "OUT=folder)\n"), err
    assert not (tmp_path / "a" / "x+x").exists()
    assert main([*map(str, folders), "--formats", "png", "--out", str(tmp_path / "both")]) == 0
    assert (tmp_path / "both" / "report.md").is_file()
    # one folder twice: said so before anything (it said the folders share a name; with --out, a warning after the
    # runs were read)
    assert main([str(folders[0]), f"{folders[0]}/", "--formats", "png", "--out", str(tmp_path / "twice")]) == 1
    assert capsys.readouterr().err.endswith(f"error: {folders[0]} is given twice (as the same folder): give each "
                                            "results folder once\n")
