"""harness/run/records.py: a run's files: metrics lines cut short or damaged, checkpoints that cannot be read, one
writer per run folder."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from omegaconf import OmegaConf

from harness.loop.native import train
from harness.run import records
from harness.run.collapse import CollapseRule
from harness.run.errors import ConfigError
from harness.run.locks import FolderBusyError
from harness.run.records import RunRecords, check_resume, read_jsonl
from tests.helpers.interrupt import stopped_before
from tests.helpers.tiny import KEEP, VARIED_REWARD, tiny_run, without_timing


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_a_garbage_line_inside_the_metrics_is_reported_and_listed_as_missing(tmp_path, capsys):
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=3")
    with stopped_before(3):
        train(run, tmp_path / "run", progress=False)
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = "{garbage"
    path.write_text("\n".join(lines) + "\n")
    summary = train(run, tmp_path / "run", progress=False)
    assert f"{path}, line 2 is not valid JSON" in capsys.readouterr().err
    assert summary["status"] == "finished" and summary["missing_steps"] == [1]
    assert [r["step"] for r in read_jsonl(path)] == [0, 2, 3]


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_a_run_whose_metrics_were_all_lost_lists_every_step_as_missing(tmp_path):
    """A finished run's emptied metrics.jsonl, run again, must not rewrite its summary with missing_steps [] (nothing
    lost) and every accuracy null (docs/hostile_pass.md, case 124)."""
    run = tiny_run(tmp_path, "train.steps=2")
    train(run, tmp_path / "run", progress=False)
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    summary = train(run, tmp_path / "run", progress=False)
    assert summary["status"] == "finished" and summary["missing_steps"] == [0, 1, 2]


@pytest.mark.slow  # a whole run (or several): make test
def test_a_corrupted_checkpoint_falls_back_to_the_previous_one_or_says_what_to_do(tmp_path):
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=3")
    train(run, tmp_path / "full", progress=False)
    with stopped_before(3):
        train(run, tmp_path / "part", progress=False)
    folder = tmp_path / "part" / "checkpoints"
    assert (folder / "previous.pt").exists()  # step 1's, kept while step 2's was written
    (folder / "last.pt").write_bytes(b"torn")
    train(run, tmp_path / "part", progress=False)  # resumes from step 1: steps 2 and 3 again, nothing twice
    part, full = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("part", "full"))
    assert without_timing(part) == without_timing(full)
    for name in ("last.pt", "previous.pt"):
        (folder / name).write_bytes(b"torn")
    with pytest.raises(RuntimeError, match=r"unreadable checkpoint .*last\.pt.*delete .*checkpoints to restart"):
        train(run, tmp_path / "part", progress=False)


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_two_processes_cannot_write_one_run_folder(tmp_path):
    run = tiny_run(tmp_path)
    holder = RunRecords(run, tmp_path / "run", None, None, "native")
    with pytest.raises(FolderBusyError, match="is being written by another process"):
        train(run, tmp_path / "run", progress=False)
    # the command refuses a second writer before it prints anything, not after its header line (hostile pass case 125)
    with pytest.raises(FolderBusyError, match="is being written by another process; wait for it or stop it"):
        check_resume(run, tmp_path / "run")
    RunRecords(run, tmp_path / "run", None, None, "native", main=False)  # the run's other processes do not probe
    check_resume(run, tmp_path / "run", main=False)  # nor do their commands (`accelerate launch`)
    holder.lock.close()
    check_resume(run, tmp_path / "run")
    assert train(run, tmp_path / "run", progress=False)["status"] == "finished"




@pytest.mark.slow  # an end-to-end run in this process: make test
def test_a_finished_runs_cut_short_last_line_is_warned_about_naming_the_file_and_the_step(tmp_path, capsys):
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=3")
    train(run, tmp_path / "run", progress=False)
    path = tmp_path / "run" / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # half of step 3's line: a cut copy
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2] and capsys.readouterr().err == ""  # a live reader
    read_jsonl(path, warn=True, complete=True)  # a reader that knows the writer is done
    assert f"warning: {path}, line 4 (the last) is not valid JSON: dropped (step 3 is" in capsys.readouterr().err
    summary = train(run, tmp_path / "run", progress=False)  # the same command again: step 3 is not redone
    err = capsys.readouterr().err
    assert f"warning: {path}, line 4 (the last) is not valid JSON: dropped (step 3 is listed in summary.json's " \
        "missing_steps)" in err
    assert summary["status"] == "finished" and summary["missing_steps"] == [3]


@pytest.mark.slow
def test_summary_carries_the_collapse_record_of_the_rows_so_far_across_a_resume(tmp_path):
    """summary.json's `collapse` is the rule of harness/run/collapse.py on the logged rows, written at every step:
    null until the streak is confirmed, then the onset and cause (with the rule), kept through a resume."""
    run = tiny_run(tmp_path)
    summary = lambda: json.loads((tmp_path / "run" / "summary.json").read_text())  # noqa: E731
    first = RunRecords(run, tmp_path / "run", None, None, "native")
    with first.recording():
        first.log({"step": 0, "eval_accuracy": 0.5})
        for step in (1, 2, 3):  # entropy below the floor from step 2 on: 2 of the 5 steps the rule asks for
            first.log({"step": step, "entropy": 0.5 if step == 1 else 0.001, "clip_frac": 0.0, "loss": 0.1})
        assert summary()["collapse"] is None
    again = RunRecords(run, tmp_path / "run", 3, None, "native")  # resumed from step 3's checkpoint
    with again.recording():
        for step in (4, 5, 6):
            again.log({"step": step, "entropy": 0.001, "clip_frac": 0.0, "loss": 0.1})
            assert (summary()["collapse"] is None) == (step < 6)
    record = summary()["collapse"]
    assert record["step"] == 2 and record["cause"] == "entropy_floor" and record["detail"]["confirmed_at"] == 6
    assert record["detail"]["values"] == [0.001] * 5 and record["rule"] == CollapseRule().as_dict()
    assert again.summary("finished")["collapse"] == record


def gsm8k_folder(folder, offset: int):
    """A small GSM8K-shaped folder whose problems depend on ``offset`` (another copy of the data)."""
    folder.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"What is {i} plus {offset}?", "answer": f"{i} + {offset}\n#### {i + offset}"}
                for i in range(12)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.slow  # a run resumed: make test
def test_a_run_is_not_resumed_on_other_task_data(tmp_path, monkeypatch):
    """GSM8K_DIR is not a setting of the run (the same data from another folder is the same run): a run stopped
    under one folder and resumed under a folder of other problems mixed the two data sets without a word. The
    digest of its problems is in summary.json and a resume on others is refused; back on its own it continues."""
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_folder(tmp_path / "a", 1)))
    run = tiny_run(tmp_path, "task.name=gsm8k", "train.steps=3", "task.eval_size=4")
    with stopped_before(2):
        train(run, tmp_path / "run", progress=False)
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())["task_data"]
    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_folder(tmp_path / "b", 2)))
    with pytest.raises(ConfigError, match=rf"run was begun on other task data \(problems of digest {recorded}, "
                       r"these [0-9a-f]{16}\): GSM8K_DIR or task.data_dir gives other problems; point it back"):
        train(run, tmp_path / "run", progress=False)
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "a"))
    summary = train(run, tmp_path / "run", progress=False)
    assert summary["status"] == "finished" and summary["task_data"] == recorded


@pytest.mark.slow
def test_a_run_is_not_resumed_from_other_starting_weights(tmp_path):
    """A model folder whose weights were replaced keeps its model.name, so its runs keep their ids: a run stopped and
    resumed after the swap went on from other starting weights (its KL reference among them), and its report pooled
    runs of two starting policies (the seventh hostile pass). summary.json records the digest of the weights a run
    starts from, warm-started or not; a resume from others is refused; back on its own it continues."""
    from harness.policy.models import load_model
    from harness.run.config import load_experiment, run_configs
    from tests.helpers.tiny import TINY_RUN, TINY_SPEC

    folder, other, kept = tmp_path / "model", tmp_path / "other", tmp_path / "kept.safetensors"
    for seed, where in ((0, folder), (1, other)):
        model, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=seed)
        model.save_pretrained(where)
        tokenizer.save_pretrained(where)
    settings = [setting for setting in TINY_RUN if not setting.startswith("model.tiny.")]
    (run,) = run_configs(load_experiment("base", [*settings, f"results_dir={tmp_path}", f"model.name={folder}",
                                                  "train.steps=3"]))
    with stopped_before(2):
        train(run, tmp_path / "run", progress=False)
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())["start_weights"]
    shutil.copy(folder / "model.safetensors", kept)
    shutil.copy(other / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"run was begun from other starting weights \(digest {recorded}, these "
                       rf"[0-9a-f]{{16}}\): model '{folder}' has changed since; put its weights back"):
        train(run, tmp_path / "run", progress=False)
    shutil.copy(kept, folder / "model.safetensors")
    summary = train(run, tmp_path / "run", progress=False)
    assert summary["status"] == "finished" and summary["start_weights"] == recorded


def test_summary_counts_the_cpu_seconds_of_every_attempt(tmp_path, monkeypatch):
    """summary.json's cpu_time_s is this process's CPU time since its records opened plus the attempts it resumes
    (a resumed run's cost is the sum of its processes', each with its own clock)."""
    clock = {"now": 10.0}
    monkeypatch.setattr(records.time, "process_time", lambda: clock["now"])
    run = tiny_run(tmp_path)
    summary = lambda: json.loads((tmp_path / "run" / "summary.json").read_text())  # noqa: E731
    first = RunRecords(run, tmp_path / "run", None, None, "native")
    with first.recording():
        first.log({"step": 0, "eval_accuracy": 0.5})
        clock["now"] = 12.5
        first.log({"step": 1, "loss": 0.1})
    assert summary()["cpu_time_s"] == 2.5
    clock["now"] = 50.0  # the resuming process's own clock
    again = RunRecords(run, tmp_path / "run", 1, None, "native")
    with again.recording():
        clock["now"] = 51.0
        again.log({"step": 2, "loss": 0.1})
    assert summary()["cpu_time_s"] == 3.5


@pytest.mark.slow  # a run, then its restart: make test
def test_an_ended_run_keeps_one_checkpoint_without_the_optimizer_and_started_again_trains_nothing(tmp_path):
    """Else an ended run keeps two checkpoints with AdamW's moments (six copies of its weights) beside final/, and a
    sweep of SmolLM2 runs fills a disk. What stays is what a run started again at its end reads."""
    run = tiny_run(tmp_path, VARIED_REWARD, "train.steps=2")
    train(run, tmp_path / "run", progress=False)
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.pt"]
    last = records.load_tensors(folder / "last.pt")
    assert last["state"]["step"] == 2 and last["policy"] and not {"optimizer", "scheduler"} & set(last)
    rows = without_timing(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert train(run, tmp_path / "run", progress=False)["status"] == "finished"  # nothing trained, nothing twice
    assert without_timing(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == rows
    kept = tiny_run(tmp_path, VARIED_REWARD, "train.steps=2", KEEP)
    train(kept, tmp_path / "kept", progress=False)
    assert {"optimizer", "scheduler"} <= set(records.load_tensors(tmp_path / "kept" / "checkpoints" / "last.pt"))
    assert (tmp_path / "kept" / "checkpoints" / "previous.pt").exists()


def test_an_ended_trl_run_keeps_its_newest_checkpoint_and_no_link_is_followed(tmp_path):
    run = tiny_run(tmp_path)
    run_dir, outside = tmp_path / "run", tmp_path / "outside.pt"
    for step in (4, 8, 12, 16):  # checkpoint-16: cut short (no trainer_state.json)
        (run_dir / "trl" / f"checkpoint-{step}").mkdir(parents=True)
        if step < 16:
            (run_dir / "trl" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    outside.write_bytes(b"a user's file")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run))  # the run's, written first
    holder = RunRecords(run, run_dir, None, None, "trl")  # a link there now would be refused (check_run_folder)
    (run_dir / "checkpoints" / "previous.pt").symlink_to(outside)  # one put there while the run runs
    holder.end("finished")
    holder.close(failed=False)
    assert sorted(p.name for p in (run_dir / "trl").iterdir()) == ["checkpoint-12"]
    assert (run_dir / "checkpoints" / "previous.pt").is_symlink() and outside.read_bytes() == b"a user's file"


@pytest.mark.parametrize("held", [["metrics.jsonl"], ["draft.tmp"], ["notes.txt", "checkpoints/"]])
def test_a_folder_that_holds_files_but_no_run_is_refused_and_left_as_it_was(tmp_path, held):
    """--run-dir at a folder of other files: the run would have rewritten its metrics.jsonl, and removed a *.tmp as
    a killed write's leftover. Refused in one line naming them; what a run's folder holds before its config.yaml
    (its lock, its launcher's log, config.yaml's temporary, an earlier attempt's traceback) is not refused, nor is a
    run's folder."""
    run, folder = tiny_run(tmp_path), tmp_path / "folder"
    folder.mkdir()
    for name in held:
        (folder / name.rstrip("/")).mkdir() if name.endswith("/") else (folder / name).write_text("mine")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(ConfigError, match=rf"^{folder} holds {', '.join(sorted(n.rstrip('/') for n in held))} but no "
                                          r"run \(no config.yaml\): a run there would write over or remove what it "
                                          r"holds; give a new or empty --run-dir$"):
        check_resume(run, folder)
    with pytest.raises(ConfigError, match="but no run"):
        RunRecords(run, folder, None, None, "native")
    assert sorted(p.name for p in folder.iterdir()) == before
    starting = tmp_path / "starting"
    starting.mkdir()
    for name in (".run.lock", "train.log", "config.yaml.tmp", f".config.yaml.{os.getpid()}.tmp", "traceback.txt"):
        (starting / name).write_text("")
    check_resume(run, starting)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(run))  # the run's own folder: continued
    check_resume(run, folder)
