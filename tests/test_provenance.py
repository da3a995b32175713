"""harness/run/provenance.py: every run records the code it ran; a run is continued only by the same code (unless
asked); reports and generated pages keep runs of two code versions apart and name them; every run folder on disk is
reported, the manifest's or not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import yaml
from omegaconf import OmegaConf

from analysis import plots
from analysis.combine import load_experiments
from analysis.leaderboard import write_leaderboard
from analysis.load import load_experiment as load_results
from analysis.load import load_run
from harness.apps import docs, stamp, sweep
from harness.apps.cli import main
from harness.run import provenance
from harness.run.config import load_experiment, objective_defaults, run_configs, run_id
from harness.run.errors import ConfigError
from harness.run.records import RunRecords, check_resume, read_jsonl
from tests.helpers.fake_runs import Shape, code_segments, fake_experiment, fake_run, unrasterized
from tests.helpers.tiny import TINY_RUN, tiny_run

A, B = "a" * 40, "b" * 40  # two commits


@pytest.fixture
def code(monkeypatch):
    """code(commit, diff=None): this process runs that commit (with changes hashing to ``diff``); git is not asked."""
    def use(commit: str, diff: str | None = None) -> str:
        monkeypatch.setattr(provenance, "_git_state", lambda: (commit, diff))
        provenance.code_record.cache_clear()
        return provenance.code_record()["version"]

    yield use
    provenance.code_record.cache_clear()


def test_the_code_record_names_the_commit_the_changes_and_the_packages(code):
    assert code(A) == "aaaaaaa"
    assert code(A, "c" * 64) == "aaaaaaa+diff-cccccccc"
    record = provenance.code_record()
    assert record["commit"] == A and record["dirty"] and record["diff_sha256"] == "c" * 64
    assert set(record["packages"]) == {"python", "torch", "transformers", "trl", provenance.DISTRIBUTION}
    assert record["packages"]["torch"]  # installed here
    assert record["cpu"] == provenance.cpu() and record["cpu"].strip()


def test_without_git_the_record_says_so_and_hashes_the_source_files(monkeypatch, tmp_path):
    """An unpacked archive: no commit, the reason said plainly, and a version that still tells two sources apart."""
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "x.py").write_text("x = 1\n")
    provenance.code_record.cache_clear()
    try:
        record = provenance.code_record()
        assert record["commit"] is None and record["git"].startswith("unavailable: ")
        assert "not a git repository" in record["git"] and record["version"].startswith("source-")
        (tmp_path / "harness" / "x.py").write_text("x = 2\n")
        provenance.code_record.cache_clear()
        assert provenance.code_record()["version"] not in (record["version"], None)
    finally:
        provenance.code_record.cache_clear()


def test_a_run_records_its_code_in_summary_json_and_config_yaml(code, tmp_path):
    version = code(A, "d" * 64)
    records = RunRecords(tiny_run(tmp_path), tmp_path / "run", None, None, "native")
    records.progress["threads"] = 1
    records.summary("running")
    records.close(failed=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["code"]["version"] == version == "aaaaaaa+diff-dddddddd" and summary["code"]["commit"] == A
    (segment,) = summary["segments"]
    assert segment["from_step"] == 0 and segment["threads"] == 1 and segment["code"]["version"] == version
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert config.startswith(f"# code: {version} ")  # a comment: not a setting, not in the run id
    assert "code" not in yaml.safe_load(config)


def test_a_run_records_what_its_code_leaves_out_of_its_cell_and_its_objectives_own_values(tmp_path):
    """A later checkout may set an objective's defaults otherwise: the run says which of its settings its code read
    as its objective's own (or as changing nothing) and what those own values were, so that a report of any later
    code pools it by the values it ran with (analysis/load.py cell_settings)."""
    run = tiny_run(tmp_path, "objective.name=gspo", "objective.advantage=grpo", "objective.params.beta=0.0",
                   "objective.params.kl_estimator=k1", "objective.params.clip_high=0.01")
    records = RunRecords(run, tmp_path / "run", None, None, "native")
    records.summary("running")
    records.close(failed=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["settings_left_out"] == ["objective.advantage", "objective.params.beta",
                                            "objective.params.kl_estimator"]
    own = objective_defaults("gspo")
    assert summary["objective_own"] == dict(own) and own["objective.params.beta"] == 0.0
    assert own["objective.params.clip_high"] != 0.01


def started_by(run, run_dir, version: str, steps_done: int = 1):
    """``run``'s folder as code ``version`` left it after ``steps_done`` steps (no training)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run))
    (run_dir / "summary.json").write_text(json.dumps({"status": "interrupted", "steps_done": steps_done,
                                                      **code_segments(version)}))


def test_continuing_a_run_of_other_code_is_refused_in_one_line_unless_allowed_then_recorded(code, tmp_path, capsys):
    run = tiny_run(tmp_path)
    started_by(run, tmp_path / "run", "aaaaaaa")
    current = code(B, "e" * 64)
    before = (tmp_path / "run" / "summary.json").read_text()
    args = ["train", "base", *TINY_RUN, f"results_dir={tmp_path}", "--run-dir", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: ")
    assert main([*args, "train.lm_head_chunk=5"]) == 2  # a memory setting changed too: not said to be recorded
    assert capsys.readouterr().err == err  # (it said config.yaml records the new ones, then refused)
    assert f"was run by code aaaaaaa and this is code {current}: continuing would mix two code versions" in err
    assert "give train --allow-code-change to continue" in err
    assert (tmp_path / "run" / "summary.json").read_text() == before  # nothing touched
    provenance.check_code([tmp_path / "run"], allow=True, command="train")  # --allow-code-change
    assert f"note: continuing 1 run(s) under code {current}, started by code aaaaaaa" in capsys.readouterr().err
    records = RunRecords(run, tmp_path / "run", 1, None, "native")
    summary = records.summary("running")
    records.close(failed=False)
    assert [(s["from_step"], provenance.segment_version(s)) for s in summary["segments"]] == [
        (0, "aaaaaaa"), (1, current)]
    assert provenance.run_version(summary) == f"aaaaaaa then {current}"
    assert (tmp_path / "run" / "config.yaml").read_text().startswith(f"# code: aaaaaaa then {current} ")


def test_a_run_written_before_the_records_continues_with_a_warning(code, tmp_path, capsys):
    code(B)
    fake_run(tmp_path, "grpo", 0, status="interrupted", run_id="old", shape=Shape(steps=6, steps_done=3))
    provenance.check_code([tmp_path / "old"], allow=False, command="train")
    assert "written before runs recorded their code (version unknown)" in capsys.readouterr().err
    # its resume records the unknown code of the steps it keeps
    segments = provenance.next_segments({"steps_done": 3, "threads": 2}, 3, provenance.code_record())
    assert [(s["from_step"], provenance.segment_version(s), s["threads"]) for s in segments] == [
        (0, "unknown", 2), (3, "bbbbbbb", None)]


class Handle:
    error = None

    def poll(self):
        return 0

    def stop(self):
        pass


class Launcher:
    """A launcher that records the command lines of the runs it is asked to start (and starts none)."""

    name = "local"

    def __init__(self):
        self.started = []

    def check(self):
        pass

    def close(self):
        pass

    def threads(self, jobs):
        return 1

    def adopt(self, name):
        return None  # no earlier sweep's job to follow

    def default_jobs(self, cpu_jobs):
        return cpu_jobs

    def start(self, args, log, name):
        self.started.append(args)
        return Handle()


@pytest.mark.slow
def test_the_sweep_refuses_before_starting_any_run_and_passes_the_flag_to_its_runs(code, tmp_path, monkeypatch):
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=exp", "sweep.grid.seed=[0,1,2]"])
    runs = run_configs(cfg)
    code(A)
    second = tmp_path / "exp" / run_id(runs[1])
    started_by(runs[1], second, "bbbbbbb")  # the second run was started by other code
    launcher = Launcher()
    monkeypatch.setattr(sweep, "make_launcher", lambda *a: launcher)
    monkeypatch.setattr(sweep, "time", SimpleNamespace(sleep=lambda s: None))  # its runs end at once
    with pytest.raises(ConfigError, match=r"exp/grpo-s1-\w+ was run by code bbbbbbb and this is code aaaaaaa: .*"
                                          "give sweep --allow-code-change"):
        sweep.run_sweep(cfg, progress=False)
    assert not launcher.started and sorted(p.name for p in (tmp_path / "exp").iterdir()) == [second.name]
    sweep.run_sweep(cfg, progress=False, allow_code_change=True)
    assert len(launcher.started) == 3 and all("--allow-code-change" in args for args in launcher.started)


def two_versions(exp):
    """grpo seeds 0 and 1 under code aaaaaaa, the same seeds under bbbbbbb (a sweep resumed after a pull), one seed
    under both (continued with --allow-code-change), and one written before the records (unknown)."""
    entries = [fake_run(exp, "grpo", seed, run_id=f"{v}-{seed}", final=0.3 + 0.1 * seed + (v == "b") * 0.2,
                        summary_extra=code_segments(v * 7)) for v in ("a", "b") for seed in (0, 1)]
    entries.append(fake_run(exp, "grpo", 0, run_id="mixed", summary_extra=code_segments("a" * 7, "b" * 7)))
    entries.append(fake_run(exp, "grpo", 0, run_id="old"))
    return fake_experiment(exp, entries)


REPORTED = ["code `aaaaaaa`: 2 runs, torch threads per run 1 (2 runs); Python 3.11, torch 2.13.0",
            "code `aaaaaaa then bbbbbbb`: 1 run, torch threads per run 1 (1 run); Python 3.11, torch 2.13.0",
            "code `bbbbbbb`: 2 runs, torch threads per run 1 (2 runs); Python 3.11, torch 2.13.0",
            "code `unknown` (written before runs recorded their code): 1 run, torch threads per run not recorded "
            "(1 run)"]


def test_runs_of_two_code_versions_are_in_separate_cells_and_every_version_is_named(tmp_path):
    results = load_results(two_versions(tmp_path / "exp"))
    assert results.cells.axes == ["code"]
    cells = results.runs.set_index("run_id")["cell"]
    assert cells["a-0"] == cells["a-1"] == "code=aaaaaaa" and cells["b-0"] == cells["b-1"] == "code=bbbbbbb"
    assert cells["mixed"] == "code=aaaaaaa then bbbbbbb" and cells["old"] == "code=unknown"
    assert results.runs["counted"].all()  # four seeds 0, none a duplicate of another: each in its own cell
    assert provenance.versions_lines(results.runs.to_dict("records")) == REPORTED


def test_stamps_name_the_code_and_threads_of_the_runs_not_of_the_checkout(code, tmp_path):
    code(A)  # the checkout: never named as the runs' code
    exp = tmp_path / "zoo"
    fake_experiment(exp, [fake_run(exp, o, s, run_id=f"{o}-{s}", summary_extra=code_segments("1234567", threads=3))
                          for o in ("grpo", "gspo") for s in (0, 1)])
    board = write_leaderboard(exp, tmp_path / "board", "a stamp", target=0.4).read_text()
    assert "Runs summarised: code `1234567`: 4 runs, torch threads per run 3 (4 runs)" in board
    assert "aaaaaaa" not in board
    assert "thread" not in stamp.machine(2)  # the machine line does not guess the runs' threads from the cores


def test_a_generated_pages_machine_line_names_what_rounds_its_floats():
    """A page's machine line names the CPU's vendor, family and model and torch's vector capability, not only the CPU's
    name ("AMD EPYC" names several families, which round otherwise); the name stays first, before any comma."""
    import torch

    line = stamp.machine(2)
    capability = torch.backends.cpu.get_cpu_capability()
    assert f"({provenance.cpu()}; {capability}), " in line
    assert capability in line.split(",")[0]  # bench's pages print the part before the first comma


def test_a_run_folder_the_manifest_does_not_list_is_reported_with_a_note(tmp_path):
    exp = tmp_path / "exp"
    listed = [fake_run(exp, "grpo", s, {"train.lr": 1e-4}) for s in (0, 1)]
    fake_experiment(exp, listed)
    other = fake_run(exp, "grpo", 0, {"train.lr": 3e-4})  # another sweep's run into the same folder
    (exp / "notes").mkdir()  # a folder that is not a run
    with pytest.warns(UserWarning, match=rf"1 run on disk that manifest.json does not list .*: {other['run_id']}$"):
        results = load_results(exp)
    assert set(results.runs["run_id"]) == {*(e["run_id"] for e in listed), other["run_id"]}
    cells = results.runs.set_index("run_id")["cell"]
    assert cells[other["run_id"]] == "train.lr=0.0003" and cells[listed[0]["run_id"]] == "train.lr=0.0001"
    assert json.loads((exp / "manifest.json").read_text())["runs"] == listed  # the sweep's plan, untouched


@pytest.mark.slow  # a report: make test
def test_the_report_and_the_docs_page_name_every_version_and_the_runs_the_manifest_does_not_list(
        code, tmp_path, monkeypatch):
    code(A)
    exp = two_versions(tmp_path / "results" / "quickstart")
    other = fake_run(exp, "grpo", 1, run_id="unlisted", summary_extra=code_segments("b" * 7))
    monkeypatch.setattr(docs, "DOCS", tmp_path)
    monkeypatch.setattr(docs, "run_sweep", lambda cfg, jobs: [{"status": "finished"}] * 6)
    monkeypatch.setattr(plots, "save", unrasterized)  # the text is checked, not the images
    with pytest.warns(UserWarning):
        section = docs.document("quickstart", tmp_path / "results", 2)  # writes the report too
    report = (exp / "report" / "report.md").read_text()
    for line in REPORTED[:2] + REPORTED[3:]:
        assert line in report and line in section
    assert "code `bbbbbbb`: 3 runs" in report and "4 code versions" in section and "aaaaaaa`: 2" in section
    assert f"manifest.json does not list (another sweep's or `train`'s, into the same folder) is reported too: " \
           f"{other['run_id']}" in report
    assert "| unlisted |" in report


@pytest.mark.slow  # a run, killed and resumed: make test
def test_a_killed_run_resumed_under_other_code_is_refused_then_continued_with_the_flag(code, tmp_path, capsys):
    args = ["train", "base", *TINY_RUN, "train.steps=3", "--run-dir", str(tmp_path / "run"), "--no-progress"]
    code(A)
    log = RunRecords.log

    def killed_at_step_2(self, row, eval_records=None):
        if row["step"] == 2:
            raise KeyboardInterrupt
        return log(self, row, eval_records)

    with mock.patch.object(RunRecords, "log", killed_at_step_2):  # step 1's checkpoint, then Ctrl-C
        assert main(args) == 130
    code(B)
    capsys.readouterr()
    assert main(args) == 2 and "config error: " in capsys.readouterr().err
    assert main([*args, "--allow-code-change"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] \
        == [0, 1, 2, 3]
    assert [(s["from_step"], s["threads"], provenance.segment_version(s)) for s in summary["segments"]] == [
        (0, 1, "aaaaaaa"), (1, 1, "bbbbbbb")]


def test_one_version_reads_a_missing_version_as_unknown():
    """check_one_version: None and a table's NaN (a run without summary.json) are one version, unknown; two known
    versions are refused in one line with each one's count."""
    from harness.run.errors import ConfigError

    provenance.check_one_version([None, float("nan"), float("nan"), "unknown"], Path("f"), "the runs")
    provenance.check_one_version(["aaa", "aaa"], Path("f"), "the runs")
    with pytest.raises(ConfigError, match=r"^the runs in f are of different code versions \(2 by aaa, 1 by unknown\)"):
        provenance.check_one_version(["aaa", None, "aaa"], Path("f"), "the runs")


@pytest.mark.slow
def test_a_config_yaml_edited_after_its_run_wrote_it_is_not_counted_resumed_or_merged(tmp_path):
    """The report read an ended run's settings from its config.yaml as written: an edit after the run (another lr)
    moved it into another cell, silently. The run records its settings' digest; an edit is a problem, said, and the
    run is not counted, diverged or not; a resume is refused (it took the edited settings and a new digest); of two
    copies of the run in two folders, the intact one is counted. Where results go and where metrics are sent (a
    later sweep's trackers) are not its settings."""
    run = tiny_run(tmp_path, "train.lr=1.0e-4", "train.steps=2")
    records = RunRecords(run, tmp_path / "run", None, None, "native")
    for step, accuracy in ((0, 0.1), (1, None), (2, 0.9)):
        records.log({"step": step, "loss": 0.5, **({"eval_accuracy": accuracy} if accuracy else {})})
    records.end("diverged")
    records.close(failed=False)
    path = tmp_path / "run" / "config.yaml"
    written = path.read_text()
    shutil.copytree(tmp_path / "run", tmp_path / "copy" / "run")
    edited = "edited after the run wrote it"

    def loaded() -> dict:
        return load_run(tmp_path, {"run_id": "run", "dir": "run"})[0]

    assert edited not in loaded()["problem"] and loaded()["ended"]  # diverged: ended, counted
    path.write_text(written.replace("  project: rlvr-harness", "  project: elsewhere").replace(
        "lr: 0.0001", "lr: 0.0001  # a note"))
    assert "project: elsewhere" in path.read_text() and edited not in loaded()["problem"]
    path.write_text(written.replace("lr: 0.0001", "lr: 0.0003"))
    assert "lr: 0.0003" in path.read_text() and edited in loaded()["problem"] and not loaded()["ended"]
    with pytest.raises(ConfigError, match=r"config.yaml was edited after the run wrote it .* restore the settings"):
        check_resume(load_experiment(str(path), ["--run-dir"][:0]), tmp_path / "run")
    both = load_experiments([tmp_path, tmp_path / "copy"])  # the copies differ: kept apart, the intact one counted
    ended = both.runs[both.runs["ended"]]
    assert len(both.runs) == 2 and len(ended) == 1 and ended["source"].iloc[0].endswith("copy")


@pytest.mark.slow
def test_a_resume_that_writes_the_same_rules_in_another_order_is_not_an_edit(tmp_path):
    """Trust-region rules in another order are the same run, and its resume rewrites config.yaml in the new order:
    killed before summary.json recorded the new digest, the next resume (and the report) called config.yaml edited.
    The digest is of the settings with their sets in one order; a run of older code recorded the digest of its
    settings as written, which still matches them; a real edit (another bound) is still one."""
    from harness.run.config import _digest, flattened

    rules = ["train.rollout_correction.rejection=[token_k3,token_k2]",
             "train.rollout_correction.rejection_threshold=[2.0,3.0]"]
    run = tiny_run(tmp_path, *rules, "train.steps=2")
    records = RunRecords(run, tmp_path / "run", None, None, "native")
    records.log({"step": 0, "loss": 0.5, "eval_accuracy": 0.1})
    records.end("diverged")
    records.close(failed=False)
    path, summary_path = tmp_path / "run" / "config.yaml", tmp_path / "run" / "summary.json"
    written = path.read_text()
    swapped = written.replace("- token_k3\n    - token_k2", "- token_k2\n    - token_k3").replace(
        "- 2.0\n    - 3.0", "- 3.0\n    - 2.0")
    assert swapped != written
    path.write_text(swapped)  # as the resume with [token_k2, token_k3] and [3.0, 2.0] writes it, then a kill
    check_resume(run, tmp_path / "run")
    assert "edited" not in load_run(tmp_path, {"run_id": "run", "dir": "run"})[0]["problem"]
    summary = json.loads(summary_path.read_text())  # a run of older code: the digest of its settings as written
    summary["settings_digest"] = _digest(flattened(yaml.safe_load(written.split("\n", 1)[1])))
    summary_path.write_text(json.dumps(summary))
    path.write_text(written)
    check_resume(run, tmp_path / "run")
    path.write_text(swapped.replace("- 3.0\n    - 2.0", "- 3.0\n    - 2.5"))  # another bound: an edit
    with pytest.raises(ConfigError, match=r"config.yaml was edited after the run wrote it"):
        check_resume(run, tmp_path / "run")
