"""harness/apps/sweep.py and the command line around it: make targets, the CLI's errors and lists, and a real sweep
killed with SIGKILL and resumed (the config's own checks and expansion: tests/test_config.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.apps.cli import main
from harness.apps.launchers import LocalLauncher
from harness.apps.sweep import Child, run_entry
from harness.run.config import load_experiment, run_configs
from harness.run.errors import ConfigError
from harness.run.locks import RUN_LOCK, FolderBusyError, is_held, lock_folder
from harness.run.records import read_jsonl
from tests.helpers.processes import MAKE_ALONE, processes_with, wait_until
from tests.helpers.tiny import TINY_RUN, VARIED_REWARD, without_timing

ROOT = Path(__file__).resolve().parent.parent


def test_make_prints_help_by_default_and_compare_sweeps_the_given_objectives():
    out = subprocess.run(["make", "--no-print-directory"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "make compare" in out.stdout and "make sweep" in out.stdout
    out = subprocess.run(["make", "-n", "--no-print-directory", "compare", "OBJECTIVES=grpo,cispo", "SEEDS=2"],
                         cwd=ROOT, capture_output=True, text=True)
    assert "sweep.grid.objective.name=[grpo,cispo]" in out.stdout and "sweep.grid.seed=[0,1]" in out.stdout
    out = subprocess.run(["make", "-n", "--no-print-directory", "compare", "OBJECTIVES=grpo,cispo", "BASELINE=cispo"],
                         cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "SEEDS"})
    assert "sweep.grid.seed=[0,1,2]" in out.stdout  # 3 seeds by default
    assert "sweep quickstart " in out.stdout and " name=" not in out.stdout  # into results/quickstart/, its runs kept
    assert "sweep.baseline=cispo" in out.stdout
    out = subprocess.run(["make", "--no-print-directory", "compare"], cwd=ROOT, capture_output=True, text=True,
                         env=MAKE_ALONE)
    assert out.returncode != 0 and "give OBJECTIVES=" in out.stderr


def make(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), *args], cwd=cwd,
                          capture_output=True, text=True, env=MAKE_ALONE)


@pytest.mark.parametrize("seeds", ["0", "x", "", "-1", "30000"])  # 30000: over the shell's longest argument
def test_make_compare_names_seeds_when_it_is_not_a_count(seeds):
    out = make("compare", "OBJECTIVES=grpo", f"SEEDS={seeds}")
    said = "SEEDS= is empty: give it a value" if not seeds else f"SEEDS={seeds}: give the number of seeds"
    assert out.returncode == 2 and said in out.stderr
    assert "sweep.grid" not in out.stderr + out.stdout and len(out.stderr.splitlines()) == 1


def test_make_before_make_setup_says_to_run_it(tmp_path):
    """A target that runs .venv/bin/python, in a checkout without the venv: one line naming `make setup`, not make's
    "No such file or directory"; help and setup itself still run."""
    for target in ("list", "sweep", "test-fast", "docs-site"):
        out = make(target, cwd=tmp_path)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "run `make setup` first" in out.stderr and "No such file" not in out.stderr
    assert make(cwd=tmp_path).returncode == 0
    assert make("-n", "setup", "list", cwd=tmp_path).returncode == 0  # setup makes the venv the next target needs
    assert make("-n", "list", "PY=python3", cwd=tmp_path).stdout.startswith("python3 -m harness list")


def test_make_help_shows_no_make_variables():
    out = make()
    assert out.returncode == 0 and "$(" not in out.stdout and "make plots" in out.stdout


def test_cli_reports_config_errors_without_traceback(capsys):
    """The CLI's code in this process (a fresh interpreter's one line: tests/test_reliability.py)."""
    assert main(["train", "quickstart", "objective.name=grpoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: unknown objective 'grpoo'. Did you mean 'grpo'?") and err.count("\n") == 1


def test_list_names_the_shared_hyperparameters_once_marks_aliases_and_ends_descriptions(capsys, monkeypatch):
    from harness.apps import cli as cli_module
    from harness.run.config import experiment_description
    from harness.run.experiments import experiment_paths

    monkeypatch.setattr(cli_module, "reasoning_gym_datasets", lambda: ["chain_sum"])  # its import takes seconds
    assert cli_module.main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.count("kl_estimator=k3") == 1 and out.count("top_entropy_quantile") == 1
    assert re.search(r"\n  bnpo +alias of grpo with aggregation=token_mean\n", out)
    assert re.search(r"\n  luspo +alias of gspo with aggregation=seq_mean_token_sum\n", out)
    # the columns line up under the longest name (adaptive_entropy's pushed its row's columns right)
    starts = {line.index(" advantage=") for line in out.splitlines() if " advantage=" in line}
    assert len(starts) == 1 and len({line.index(" alias of ") for line in out.splitlines() if " alias of " in line}
                                    | starts) == 1, starts
    flat = " ".join(out.split())
    assert flat.count("dapo advantage=grpo aggregation=token_mean clip_low=0.2, clip_high=0.28,") == 1  # dapo's own
    # a shared hyperparameter whose default an objective changes is on its line
    assert "adaptive_kl advantage=grpo aggregation=seq_mean_token_mean beta=0.001, clip_low=0.2" in flat
    for path in experiment_paths():
        shown = cli_module.first_sentence(experiment_description(path))
        assert f"{path.stem} {shown}" in flat and shown.endswith((".", ")")), path.stem


def test_first_sentence_stops_at_a_sentence_end_only():
    from harness.run.names import first_sentence

    assert first_sentence("GSPO paper, Fig. 2 (arXiv 2507.18071): more, e.g. here. Paper: x.") == \
        "GSPO paper, Fig. 2 (arXiv 2507.18071): more, e.g. here."
    assert first_sentence("Step size: 1x vs. 3x quickstart's. 12 runs.") == "Step size: 1x vs. 3x quickstart's."
    assert first_sentence("no full stop") == "no full stop"


@pytest.mark.slow  # imports every reasoning-gym generator
def test_cli_lists_registered_names(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    # caesar_cipher: a reasoning-gym generator, named by nothing else in the list
    for name in ("grpo", "gspo", "gspo_token", "ctpo", "arith", "gsm8k", "quickstart", "rloo", "caesar_cipher"):
        assert name in out


@pytest.mark.slow
def test_killed_sweep_resumes_without_losing_or_repeating_steps(tmp_path, capsys):
    exp = tmp_path / "killtest.yaml"
    exp.write_text("sweep:\n  grid:\n    objective.name: [grpo, gspo]\n")
    args = [str(exp), *TINY_RUN, VARIED_REWARD, "train.steps=6", f"results_dir={tmp_path}/res", "--no-progress"]
    sweep = subprocess.Popen([sys.executable, "-m", "harness", "sweep", *args], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    exp_dir = tmp_path / "res" / "killtest"

    def first_run_has_two_steps():
        runs = sorted(p for p in exp_dir.glob("grpo-*") if p.is_dir()) if exp_dir.exists() else []
        return runs[0] if runs and len(read_jsonl(runs[0] / "metrics.jsonl")) >= 3 else None  # eval + 2 steps

    first = wait_until(first_run_has_two_steps, timeout=120, process=sweep)
    assert first is not None, "the sweep made no progress"
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    manifest = json.loads((exp_dir / "manifest.json").read_text())  # readable after the kill
    assert {r["objective"] for r in manifest["runs"]} == {"grpo", "gspo"}
    assert wait_until(lambda: not processes_with(f"harness worker {exp_dir}") and not is_held(first / RUN_LOCK),
                      timeout=120), "the run outlived the killed sweep"  # its worker dies with the sweep, not at once
    assert all("step" in r for r in read_jsonl(first / "metrics.jsonl"))

    # the resuming sweep, the reference and the rerun in this process: the kill above is the one about processes
    # (the resumed run still trains in a worker process the sweep starts)
    assert main(["sweep", *args]) == 0, capsys.readouterr().err
    assert (exp_dir / "report" / "report.md").exists()  # the report follows results_dir
    manifest = json.loads((exp_dir / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["finished", "finished"]
    for run in manifest["runs"]:
        rows = read_jsonl(exp_dir / run["dir"] / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(7))
    # the resumed run is the run that was never interrupted
    assert main(["train", str(exp), *TINY_RUN, VARIED_REWARD, "train.steps=6", "--run-dir", str(tmp_path / "ref"),
                 "--no-progress"]) == 0, capsys.readouterr().err
    assert without_timing(read_jsonl(first / "metrics.jsonl")) == \
        without_timing(read_jsonl(tmp_path / "ref" / "metrics.jsonl"))
    written = snapshot_times(exp_dir)
    capsys.readouterr()
    assert main(["sweep", *args, "--no-report"]) == 0  # everything finished: nothing runs again
    assert "2/2 runs finished" in capsys.readouterr().err and snapshot_times(exp_dir) == written


def snapshot_times(exp_dir: Path) -> dict:
    """The modification time of every file of the runs under ``exp_dir`` (not the sweep's own manifest)."""
    return {p: p.stat().st_mtime_ns for p in exp_dir.glob("*-s*-*/**/*") if p.is_file()}


@pytest.mark.slow
def test_a_second_comparison_adds_to_the_first_and_runs_no_run_again(tmp_path, capsys):
    """`make compare` twice into the experiment's folder: one manifest and one report with every run, the shared
    baseline run once; the verdict and the report's path on the terminal. (The sweeps run in this process, their
    runs in the worker each starts.)"""
    exp = tmp_path / "cmp.yaml"
    exp.write_text("sweep:\n  grid:\n    objective.name: [grpo, gspo]\n")
    args = [str(exp), *TINY_RUN, f"results_dir={tmp_path}/res", "--no-progress"]
    assert main(["sweep", *args, "--no-report"]) == 0, capsys.readouterr().err
    exp_dir = tmp_path / "res" / "cmp"
    grpo = next(exp_dir.glob("grpo-*")) / "metrics.jsonl"
    written = grpo.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["sweep", *args, "sweep.grid.objective.name=[grpo,cispo]", "sweep.baseline=grpo"]) == 0, \
        capsys.readouterr().err
    second = capsys.readouterr()
    assert grpo.stat().st_mtime_ns == written  # the baseline's run was there: not run again
    manifest = json.loads((exp_dir / "manifest.json").read_text())
    assert [r["objective"] for r in manifest["runs"]] == ["gspo", "grpo", "cispo"]  # the first's kept, before
    assert manifest["baseline"] == "grpo" and manifest["objectives"] == ["grpo", "cispo", "gspo"]
    runs = (exp_dir / "report" / "runs.csv").read_text()
    assert all(o in runs for o in ("grpo-s0", "gspo-s0", "cispo-s0"))
    assert "verdict:\n" in second.out and f"report: {exp_dir / 'report' / 'report.html'}" in second.out


@pytest.mark.slow
def test_a_baseline_no_run_is_is_refused_before_the_sweep_starts(tmp_path):
    """`make compare OBJECTIVES=grpo,gspo BASELINE=cispo`: refused in one line before any folder or run (it was found
    by the report, after every run had trained); a baseline an earlier sweep's run in the folder is, is taken."""
    from harness.apps.sweep import check_baseline, run_sweep

    cfg = load_experiment("quickstart", [*TINY_RUN, f"results_dir={tmp_path}", "sweep.grid.objective.name=[grpo,gspo]",
                                         "sweep.baseline=cispo"])
    with pytest.raises(ConfigError, match=rf"^sweep.baseline=cispo: no run of this sweep is cispo, nor any earlier run "
                                          rf"in {tmp_path / 'quickstart'}: add it to the objectives \(make compare "
                                          r"OBJECTIVES=cispo,...\) or name one of grpo, gspo$"):
        run_sweep(cfg, progress=False)
    assert not any(tmp_path.iterdir())
    runs = run_configs(cfg)
    check_baseline("gspo", runs, tmp_path)  # one of the sweep's
    check_baseline(None, runs, tmp_path)
    (tmp_path / "cispo-s0-x").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"runs": [{"run_id": "cispo-s0-x", "dir": "cispo-s0-x",
                                                                  "objective": "cispo", "status": "finished"}]}))
    check_baseline("cispo", runs, tmp_path)  # an earlier sweep's run in the folder


def test_an_earlier_manifest_keeps_only_its_runs_still_there(tmp_path):
    from harness.apps.sweep import earlier_manifest

    for name in ("kept", "listed"):
        (tmp_path / name).mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    manifest = tmp_path / "manifest.json"
    entries = [{"run_id": r, "dir": r, "objective": "grpo", "status": "finished"} for r in
               ("kept", "listed", "deleted", "linked")]
    manifest.write_text(json.dumps({"experiment": "x", "baseline": "ctpo", "objectives": ["ctpo", 3],
                                    "runs": [*entries, {"run_id": "up", "dir": "../kept"}, "junk"]}))
    earlier = earlier_manifest(manifest, tmp_path, {"listed"})
    assert [r["run_id"] for r in earlier["runs"]] == ["kept"]  # not this sweep's, folder there, no link, no ../
    assert earlier["runs"][0]["status"] == "pending"  # as it is now: no summary.json
    assert (earlier["baseline"], earlier["objectives"]) == ("ctpo", ["ctpo"])
    manifest.write_text("{torn")
    assert earlier_manifest(manifest, tmp_path, set()) == {"runs": []}
    assert earlier_manifest(tmp_path / "none.json", tmp_path, set()) == {"runs": []}


def test_a_sweep_continuing_a_run_with_other_memory_settings_runs_it_with_them_and_says_so(tmp_path, capsys):
    """The sweep's processes run each run's config.yaml: a run that ran out of memory, swept again with
    train.activation_checkpointing=true (the same run id), gets the new memory settings there, said in one line; a
    finished run's config.yaml keeps the settings it ran with."""
    cfg = load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}"])
    (run,) = run_configs(cfg)
    low = OmegaConf.merge(run, {"train": {"activation_checkpointing": True, "lm_head_chunk": 5}})
    first = run_entry(run, cfg, tmp_path)
    (tmp_path / first["dir"] / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    capsys.readouterr()
    assert run_entry(low, cfg, tmp_path) == {**first, "status": "interrupted"}
    saved = OmegaConf.load(tmp_path / first["dir"] / "config.yaml")
    assert saved == OmegaConf.merge(run, {"train": {"activation_checkpointing": True, "lm_head_chunk": 5}})
    assert capsys.readouterr().err == (
        f"continuing {first['dir']} with other memory settings: train.lm_head_chunk 0 -> 5, "
        "train.activation_checkpointing False -> True (they change no number beyond float round-off; config.yaml "
        "records the new ones)\n")
    (tmp_path / first["dir"] / "summary.json").write_text(json.dumps({"status": "finished"}))
    assert run_entry(run, cfg, tmp_path)["status"] == "finished"
    assert OmegaConf.load(tmp_path / first["dir"] / "config.yaml") == saved and capsys.readouterr().err == ""


def test_a_run_whose_lock_another_process_holds_is_followed_to_its_end_not_started_again(tmp_path, capsys):
    """A rerun of a sweep whose run is still running (started by hand, or by an earlier sweep's job whose record is
    lost): no second process is started for it (whose `train` would stop on the lock and be reported failed); the
    sweep waits while the lock is held and then takes the run's status from its summary."""

    class NoStart(LocalLauncher):
        def start(self, *args):
            pytest.fail("a second process was started for a running run")

    run_dir = tmp_path / "grpo-s0-abc"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train: {steps: 3}\n")
    (run_dir / "summary.json").write_text(json.dumps({"status": "running"}))
    holder = lock_folder(run_dir / RUN_LOCK, "busy")
    child = Child.start(NoStart(), run_dir, threads=1, progress=False, position=1, steps=3, allow_code_change=False)
    assert "run grpo-s0-abc is still running (another process holds its lock): following it to its end" in \
        capsys.readouterr().out
    assert child.poll() and child.poll()  # still running, as long as the lock is held
    (run_dir / "summary.json").write_text(json.dumps({"status": "finished"}))
    holder.close()
    assert not child.poll() and child.ended("grpo-s0-abc") == ("finished", None)
    child.stop()  # someone else's process: nothing to stop


def test_a_run_copied_mid_run_from_another_host_is_running_there_not_stopped_nor_started_again(tmp_path, capsys,
                                                                                                 monkeypatch):
    """results/<exp>/ copied (rsync) from a cluster while its run goes on: no process holds the run's lock here, so
    the run was called stopped and a sweep here resumed it, a second writer of the run in a copy that the next rsync
    mixes with the cluster's files. Its lock now records its writer's host and heartbeat: while that is fresh (times
    injected) the run is running there, the sweep says so in one line and starts nothing, and `train` on it is
    refused; once the heartbeat is STALE_S old it is stopped, and a sweep takes it over, saying so."""
    from harness.run import locks
    from harness.run.records import check_resume, run_status
    from tests.helpers.tiny import tiny_run

    monkeypatch.setattr(locks, "HOST", "this-test-host")  # never node17, even on a cluster node of that name

    class NoStart(LocalLauncher):
        def start(self, *args):
            pytest.fail("a second writer was started for a run running on another host")

    run, run_dir = tiny_run(tmp_path), tmp_path / "grpo-s0-abc"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run))
    (run_dir / "summary.json").write_text(json.dumps({"status": "running", "steps_done": 3}))
    (run_dir / RUN_LOCK).write_text(json.dumps({"host": "node17", "pid": 4242, "beat": 1_000_000.0}) + "\n")
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0 + 90, raising=False)
    assert run_status(run_dir) == "running"
    assert Child.start(NoStart(), run_dir, threads=1, progress=False, position=1, steps=3,
                       allow_code_change=False) is None
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and said.startswith("run grpo-s0-abc is running on host node17 (pid 4242; its last "
                                                    "heartbeat at ") and "90 s ago): not started here" in said
    with pytest.raises(FolderBusyError, match="being written by another process on host node17"):
        check_resume(run, run_dir)
    monkeypatch.setattr(locks, "clock", lambda: 1_000_000.0 + locks.STALE_S, raising=False)
    assert run_status(run_dir) == "stopped"
    started = []

    class Start(LocalLauncher):
        def start(self, *args):
            started.append(args)
            return None

    Child.start(Start(), run_dir, threads=1, progress=False, position=1, steps=3, allow_code_change=False)
    assert len(started) == 1 and capsys.readouterr().out.startswith(
        "taking over grpo-s0-abc: its lock names a writer on host node17 (pid 4242;")


@pytest.mark.slow  # a full garbage collection of the test process's heap: make test
def test_the_parent_prepares_each_starting_policy_once_then_drops_it_and_gives_its_heap_back(monkeypatch):
    """The sweep's parent waits on its runs for the whole sweep: after building the warm starts it must hold none of
    them (a SmolLM2 SFT held through the sweep is gigabytes the runs cannot use)."""
    import gc
    import weakref

    from harness.apps import sweep
    from harness.run.config import load_experiment, run_configs

    class Policy:  # stands in for a model: a reference cycle, as a model with its optimizer and graph has
        def __init__(self):
            self.me = self

    built, at_release = [], []
    monkeypatch.setattr(sweep, "build_policy",
                        lambda run, task, device, progress: built.append(weakref.ref(p := Policy())) or p)
    monkeypatch.setattr(sweep, "build_task", lambda run: None)
    monkeypatch.setattr(sweep, "release_freed_memory", lambda: at_release.append([ref() for ref in built]))
    gc.disable()  # so that only the function's own collection frees the cycles
    try:
        runs = run_configs(load_experiment("quickstart", ["sweep.grid.seed=[0,1]", "model.warm_start_steps=5"]))
        runs += run_configs(load_experiment("quickstart", ["sweep.grid.seed=[0]", "model.seed=3",
                                                          "model.warm_start_steps=5"]))
        sweep.prepare_starting_policies(runs, progress=False)
    finally:
        gc.enable()
    assert len(runs) == 12 and len(built) == 2  # one policy per distinct starting policy
    assert at_release == [[None, None]]  # released once, after both were dropped
    at_release.clear()
    sweep.prepare_starting_policies(run_configs(load_experiment("quickstart", ["model.warm_start_steps=0",
                                                                           "model.warm_start_target=null"])), False)
    assert at_release == []  # nothing built, nothing to give back


@pytest.mark.slow  # a full garbage collection of the test process's heap: make test
def test_a_run_gives_back_what_its_warm_start_freed(monkeypatch):
    """build_policy gives the heap back after a warm start (its optimizer state and activations are garbage then),
    and only then."""
    from harness.loop import build
    from harness.run.config import load_experiment, run_configs

    calls = []
    monkeypatch.setattr(build, "warm_start", lambda model, tokenizer, task, recipe, progress: calls.append("warm") or
                        (model, {}))
    monkeypatch.setattr(build, "release_freed_memory", lambda: calls.append("release"))
    tiny = ["model.tiny.hidden_size=16", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=16", "sweep.grid.seed=[0]", "sweep.grid.objective.name=[grpo]"]
    (run,) = run_configs(load_experiment("quickstart", tiny))
    build.build_policy(run, build.build_task(run), torch.device("cpu"))
    assert calls == ["warm", "release"]
    no_warm_start = ["model.warm_start_steps=0", "model.warm_start_target=null"]
    (run,) = run_configs(load_experiment("quickstart", [*tiny, *no_warm_start]))
    build.build_policy(run, build.build_task(run), torch.device("cpu"))
    assert calls == ["warm", "release"]  # no warm start: nothing to give back


class _Runner:
    """Stands in for a launcher: each started job ends after two polls with status 0, or after one with its status
    in ``codes``."""

    name = "stand-in"

    def __init__(self, codes=None):
        self.started, self.stopped, self.active, self.most = [], [], set(), 0
        self.codes = codes or {}

    def threads(self, jobs):
        return 1

    def adopt(self, name):
        return None

    def start(self, args, log, name):
        runner, polls = self, []
        self.started.append(args[1])
        self.active.add(name)
        self.most = max(self.most, len(self.active))

        class Handle:
            error = None

            def poll(self):
                polls.append(1)
                code = runner.codes.get(args[1], 0)
                if len(polls) < (1 if code else 2):
                    return None
                runner.active.discard(name)
                return code

            def stop(self):
                runner.stopped.append(args[1])

        return Handle()


@pytest.mark.slow  # seconds of runs or reports: make test
def test_starting_policies_are_prepared_side_by_side_each_once_and_a_failure_stops_the_others(tmp_path, monkeypatch):
    """prepare_through: one job per distinct starting policy (the first run's config), at most ``at_once`` at a time;
    a failed one stops those still running and raises with its log."""
    from harness.apps import sweep

    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    runs = run_configs(load_experiment("quickstart", ["sweep.grid.seed=[0,1]", "sweep.grid.model.seed=[2,3,4]",
                                                      "model.warm_start_steps=5"]))
    pending = [(run, tmp_path / f"run{i}") for i, run in enumerate(runs)]
    assert sweep.distinct_policies(runs) == 3
    runner = _Runner()
    sweep.prepare_through(pending, runner, progress=False, at_once=2)
    firsts = {}
    for run, run_dir in pending:
        firsts.setdefault(run.model.seed, str(run_dir / "config.yaml"))
    assert runner.started == list(firsts.values()) and runner.most == 2
    failing = _Runner({firsts[3]: 1})
    with pytest.raises(RuntimeError, match="preparing the starting policy failed .exit 1"):
        sweep.prepare_through(pending, failing, progress=False, at_once=3)
    assert failing.stopped == [firsts[2], firsts[4]]  # the others, still running when it failed


def test_a_starting_policy_that_fails_on_the_launcher_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A sweep through ray or slurm builds its starting policy as a job; one that failed there (a node without the
    GPU of device=cuda, its cache unreachable, ...) ended the sweep in a RuntimeError traceback. Now one line with the
    job's own error and its log, exit 1, no run started."""
    from harness.apps import sweep

    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    failing = _Runner()
    failing.check, failing.close = lambda: None, lambda: None
    failing.codes = type("Every", (), {"get": lambda self, key, default: 2})()  # every job: exit 2

    def start(args, log, name):
        log.write_text("config error: device=cuda, but no CUDA device is visible (check CUDA_VISIBLE_DEVICES)\n")
        return _Runner.start(failing, args, log, name)

    failing.start = start
    monkeypatch.setattr(sweep, "make_launcher", lambda name, settings, exp_dir: failing)
    assert main(["sweep", "quickstart", "sweep.grid.seed=[0]", "sweep.grid.objective.name=[grpo]",
                 "model.warm_start_steps=5", f"results_dir={tmp_path}", "--launcher", "slurm", "--no-progress",
                 "--no-report"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [
        "error: preparing the starting policy failed (exit 2): config error: device=cuda, but no CUDA device is "
        f"visible (check CUDA_VISIBLE_DEVICES); log in {next(tmp_path.glob('quickstart/grpo-*'))}/train.log"]
    assert failing.started == [str(p) for p in tmp_path.glob("quickstart/grpo-*/config.yaml")]


def test_a_sweep_continued_after_a_commit_says_its_runs_will_not_be_pooled_with_those_that_ended(tmp_path,
                                                                                                  monkeypatch, capsys):
    """A sweep extended (another seed) or resumed under other code than its ended runs: the report keeps each code
    version's runs apart, which the sweep said nothing of (the verdict came out per version, after every run). Now one
    note before any run starts, naming the other versions; none where every ended run is this code's."""
    from harness.apps import sweep
    from harness.run.provenance import code_record

    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    cfg = load_experiment("quickstart", [*TINY_RUN, "model.warm_start_steps=0", "model.warm_start_target=null",
                                         f"results_dir={tmp_path}", "sweep.grid.objective.name=[grpo]",
                                         "sweep.grid.seed=[0,1]"])
    ended = tmp_path / "quickstart" / sweep.run_id(run_configs(cfg)[0])
    ended.mkdir(parents=True)
    (ended / "config.yaml").write_text(OmegaConf.to_yaml(run_configs(cfg)[0]))
    for version, said in (("0ld0000", True), (code_record()["version"], False)):
        (ended / "summary.json").write_text(json.dumps({"status": "finished", "segments": [
            {"from_step": 0, "code": {"version": version}}]}))
        monkeypatch.setattr(sweep, "make_launcher", lambda name, settings, exp_dir: _Runner())
        monkeypatch.setattr(_Runner, "check", lambda self: None, raising=False)
        monkeypatch.setattr(_Runner, "close", lambda self: None, raising=False)
        sweep.run_sweep(cfg, progress=False, launcher="ray")  # the stand-in: no run process
        err = capsys.readouterr().err
        assert ("note: runs that ended in " in err) is said, err
        if said:
            assert (f"are of other code (1 by 0ld0000) than the 1 this sweep runs ({code_record()['version']}): the "
                    "report keeps each version's runs apart") in err


def test_the_other_code_note_counts_the_runs_this_sweep_runs_not_an_earlier_sweeps_unfinished_ones(tmp_path,
                                                                                                   monkeypatch, capsys):
    """An earlier sweep's run that did not end, and that this sweep's grid does not hold, was counted among "the N this
    sweep runs": a sweep whose every run had ended said it would run one (the note is for runs it starts)."""
    from harness.apps import sweep

    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    cfg = load_experiment("quickstart", [*TINY_RUN, "model.warm_start_steps=0", "model.warm_start_target=null",
                                         f"results_dir={tmp_path}", "sweep.grid.objective.name=[grpo]",
                                         "sweep.grid.seed=[0]"])
    exp_dir = tmp_path / "quickstart"
    ended = exp_dir / sweep.run_id(run_configs(cfg)[0])
    ended.mkdir(parents=True)
    (ended / "config.yaml").write_text(OmegaConf.to_yaml(run_configs(cfg)[0]))
    (ended / "summary.json").write_text(json.dumps({"status": "finished", "segments": [
        {"from_step": 0, "code": {"version": "0ld0000"}}]}))
    (exp_dir / "grpo-s7-00000000").mkdir()  # an earlier sweep's run, begun and never ended
    (exp_dir / "manifest.json").write_text(json.dumps({"runs": [
        {"run_id": "grpo-s7-00000000", "dir": "grpo-s7-00000000", "status": "running"}]}))
    monkeypatch.setattr(sweep, "make_launcher", lambda name, settings, exp_dir: _Runner())
    monkeypatch.setattr(_Runner, "check", lambda self: None, raising=False)
    monkeypatch.setattr(_Runner, "close", lambda self: None, raising=False)
    sweep.run_sweep(cfg, progress=False, launcher="ray")  # the stand-in: no run process
    assert "note: runs that ended in " not in capsys.readouterr().err


@pytest.mark.slow
def test_a_local_sweep_over_starting_policies_builds_them_in_processes_as_one_after_another_would(tmp_path,
                                                                                                    monkeypatch):
    """With two jobs and two starting policies the local sweep prepares them in two processes at once; each cached
    policy is the one the sweep's own process builds (a warm start trains on one thread whatever the process)."""
    from harness.loop.build import build_policy, build_task

    env = {**os.environ, "RLVR_CACHE": str(tmp_path / "side_by_side")}
    settings = [*TINY_RUN, "train.steps=1", "model.warm_start_steps=3", "model.warm_start_target=null",
                "sweep.grid.objective.name=[grpo]", "sweep.grid.seed=[0]", "sweep.grid.model.seed=[2,3]"]
    done = subprocess.run([sys.executable, "-m", "harness", "sweep", "quickstart", *settings,
                           f"results_dir={tmp_path / 'results'}", "--jobs", "2", "--no-report"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    logs = "".join(p.read_text() for p in (tmp_path / "results" / "quickstart").glob("*/train.log"))
    assert logs.count("starting policy: building it once") == 2  # each in a run's log: a process of its own
    built = sorted((tmp_path / "side_by_side" / "warm_start").glob("*.safetensors"))
    assert len(built) == 2
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "here"))  # the same policies, built in this process
    for run in run_configs(load_experiment("quickstart", settings)):
        build_policy(run, build_task(run), torch.device("cpu"))
    here = sorted((tmp_path / "here" / "warm_start").glob("*.safetensors"))
    assert [p.name for p in here] == [p.name for p in built]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(here, built, strict=True))


@pytest.mark.slow  # two tiny warm starts in processes of their own, twice
def test_starting_policies_that_miss_their_band_are_passed_over_recorded_and_not_built_again(tmp_path, monkeypatch):
    """first_landing through real `python -m harness prepare` processes: a warm start that misses its band exits
    MISSED_BAND, which passes the value over (too few landing: WarmStartError naming each miss); the miss is recorded
    in the cache, so asking again reads the record instead of training to the same miss."""
    from harness.apps import sweep
    from harness.policy.warm_start import WarmStartError

    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    settings = [*TINY_RUN, f"results_dir={tmp_path}", "model.warm_start_steps=2", "model.warm_start_check_every=1",
                "model.warm_start_target=[0.99,1.0]", "sweep.grid.objective.name=[grpo]", "sweep.grid.seed=[0]"]

    def runs_for(seeds):
        grid = f"sweep.grid.model.seed=[{','.join(map(str, seeds))}]"
        return run_configs(load_experiment("quickstart", [*settings, grid]))

    for attempt in ("built", "recorded"):
        with pytest.raises(WarmStartError, match=r"only 0 of model.seed \[2, 3\] reached .* \(1 wanted\): 2: warm "
                                                 r"start reached max_steps=2 below its target band .*; 3: warm start"):
            sweep.first_landing(runs_for, (2, 3), 1, tmp_path / "prepare", 2, False)
        logs = [(tmp_path / "prepare" / f"model_seed_{s}" / "train.log").read_text() for s in (2, 3)]
        assert all(("recorded in" in log) == (attempt == "recorded") for log in logs), logs
    assert len(list((tmp_path / "cache" / "warm_start").glob("*.missed.json"))) == 2


def test_first_landing_offers_every_candidate_in_order_and_takes_the_first_that_land(tmp_path, monkeypatch):
    """The screen's policy and every candidate go to the processes in order (those not needed are stopped or never
    begun: _decided); the first ``wanted`` that land are taken in candidate order: a spare that landed is not taken,
    nor is a later miss recorded."""
    from harness.apps import sweep
    from harness.policy.warm_start import WarmStartError

    offered, misses = [], {4, 5}

    def prepare(runs, folder, at_once, progress, decided):
        offered.append(list(runs))
        return {seed: f"{seed} missed" for seed in runs if seed in misses}

    monkeypatch.setattr(sweep, "_prepare_seeds", prepare)
    first = [OmegaConf.create({"model": {"seed": 1}})]
    found = sweep.first_landing(lambda seeds: [OmegaConf.create({"model": {"seed": s}}) for s in seeds],
                                (2, 3, 4, 5, 6, 7, 8), 3, tmp_path, 2, False, first)
    assert offered == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert found == {"landed": [2, 3, 6], "missed": {4: "4 missed", 5: "5 missed"}}
    misses = {4, 8}
    found = sweep.first_landing(lambda seeds: [OmegaConf.create({"model": {"seed": s}}) for s in seeds],
                                (2, 3, 4, 5, 6, 7, 8), 3, tmp_path, 2, False, first)
    assert found == {"landed": [2, 3, 5], "missed": {4: "4 missed"}}
    assert json.loads((tmp_path / "start_policies.json").read_text())["landed"] == [2, 3, 5]
    with pytest.raises(WarmStartError, match=r"only 2 of model.seed \[2, 3, 4\] reached .* \(3 wanted\): 4: 4 missed"):
        sweep.first_landing(lambda seeds: [OmegaConf.create({"model": {"seed": s}}) for s in seeds], (2, 3, 4), 3,
                            tmp_path, 2, False)


def test_the_builds_still_needed_run_side_by_side_when_the_others_are_cached(tmp_path, monkeypatch):
    """5 wanted of model.seed 2-8 at 2 at once, where 2, 3 and 6 are cached (loaded at once) and 4 and 5 recorded
    misses (read at once): 7 and 8, both needed, build side by side, not one after the other (rounds sized by the
    policies still wanted built 7 alone, then 8)."""
    from harness.apps import sweep

    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    together = []

    class Runner(_Runner):
        def start(self, args, log, name):
            handle = super().start(args, log, name)
            if any(f"model_seed_{s}/" in args[1] for s in (7, 8)):  # a build: ends after many polls
                polls, active = [], self.active

                def poll():
                    polls.append(1)
                    together.append(set(active))
                    if len(polls) < 20:
                        return None
                    active.discard(name)
                    return 0
                handle.poll = poll
            return handle

    runner = Runner({str(tmp_path / f"model_seed_{s}" / "config.yaml"): sweep.MISSED_BAND for s in (4, 5)})
    monkeypatch.setattr(sweep, "LocalLauncher", lambda: runner)
    monkeypatch.setattr(sweep, "stopped_error", lambda where: "missed its band")
    settings = ["sweep.grid.objective.name=[grpo]", "sweep.grid.seed=[0]", "model.warm_start_steps=5"]

    def runs_for(seeds):
        grid = f"sweep.grid.model.seed=[{','.join(map(str, seeds))}]"
        return run_configs(load_experiment("quickstart", [*settings, grid]))

    found = sweep.first_landing(runs_for, (2, 3, 4, 5, 6, 7, 8, 9), 5, tmp_path, 2, False)
    assert found == {"landed": [2, 3, 6, 7, 8], "missed": {4: "missed its band", 5: "missed its band"}}
    assert {"prepare-model_seed_7", "prepare-model_seed_8"} in together


@pytest.mark.parametrize("done, decided", [
    ({1: True, 2: True, 3: True}, True),            # 2 wanted: 2 and 3 landed, the screen's 1 ended
    ({2: True, 3: True}, False),                    # the screen's policy (first) still building
    ({1: True, 2: True, 4: True}, False),           # 3 still building: 4 cannot be taken before it
    ({1: True, 2: False, 3: True}, False),          # 2 missed: 3 and the next that lands
    ({1: True, 2: False, 3: True, 4: True}, True),
    ({1: True, 3: True, 4: True, 5: True}, False),  # 2, the first candidate, still building
])
def test_the_starting_policies_are_decided_once_the_first_wanted_in_order_have_landed(done, decided):
    from harness.apps import sweep

    assert sweep._decided(done, first=[1], candidates=[2, 3, 4, 5], still=2) is decided


def test_spare_builds_are_stopped_once_the_policies_wanted_have_landed(tmp_path, monkeypatch):
    """first_landing's round of whole batches builds spares beside the candidates wanted; once the first ``wanted``
    in order have landed, a spare still building is stopped (its result could not be taken) and the round ends."""
    from harness.apps import sweep

    monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
    slow = {}

    class Runner(_Runner):
        def start(self, args, log, name):
            handle = super().start(args, log, name)
            if "model_seed_5" in args[1]:  # the spare: ends only after many polls
                polls = slow.setdefault(args[1], [])

                def poll():
                    polls.append(1)
                    return 0 if len(polls) > 50 else None
                handle.poll = poll
            return handle

    runner = Runner()
    monkeypatch.setattr(sweep, "LocalLauncher", lambda: runner)
    settings = ["sweep.grid.objective.name=[grpo]", "sweep.grid.seed=[0]", "model.warm_start_steps=5"]

    def runs_for(seeds):
        grid = f"sweep.grid.model.seed=[{','.join(map(str, seeds))}]"
        return run_configs(load_experiment("quickstart", [*settings, grid]))

    found = sweep.first_landing(runs_for, (2, 3, 4, 5, 6), 3, tmp_path, 2, False)
    assert found == {"landed": [2, 3, 4], "missed": {}}
    assert [Path(c).parent.name for c in runner.stopped] == ["model_seed_5"]
    assert len(next(iter(slow.values()))) < 50
    assert (tmp_path / "model_seed_5" / "config.yaml").is_file()  # begun as a spare, stopped
    assert not (tmp_path / "model_seed_6").exists()  # never begun: no folder


def test_starting_policies_without_a_warm_start_are_recorded_in_a_folder_no_build_made(tmp_path):
    """With model.warm_start_steps=0 nothing is built, so no build wrote the folder: start_policies.json's write
    raised FileNotFoundError (the zoo's confirmation with a hostile pass's quick settings)."""
    from harness.apps import sweep

    def runs_for(seeds):
        grid = f"sweep.grid.model.seed=[{','.join(map(str, seeds))}]"
        return run_configs(load_experiment("quickstart", ["sweep.grid.objective.name=[grpo]", "sweep.grid.seed=[0]",
                                                          "model.warm_start_steps=0", "model.warm_start_target=null",
                                                          grid]))

    found = sweep.first_landing(runs_for, (2, 3, 4), 2, tmp_path / "prepare", 2, False)
    assert found == {"landed": [2, 3], "missed": {}}
    assert json.loads((tmp_path / "prepare" / sweep.START_POLICIES).read_text())["landed"] == [2, 3]
