"""Experiment trackers (harness/run/tracking.py): every metrics.jsonl row reaches TensorBoard, wandb (offline) and
trackio with the same values, from both backends; a resumed run shows each step once; config errors are one line."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.loop.native import train
from harness.run.config import run_id
from harness.run.errors import ConfigError
from harness.run.records import RunRecords, read_jsonl
from harness.run.tracking import numeric
from tests.helpers.tiny import tiny_run

REPO = Path(__file__).resolve().parent.parent


def tensorboard_scalars(folder: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} as TensorBoard's own reader loads it (its purge of restarted steps included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(folder))
    reader.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in reader.Tags()["scalars"]:
        for event in reader.Scalars(tag):
            assert tag not in steps.setdefault(event.step, {}), f"{tag} at step {event.step} twice"
            steps[event.step][tag] = event.value
    return steps


def assert_same_rows(tracked: dict[int, dict[str, float]], rows: list[dict]) -> None:
    """The tracker holds exactly metrics.jsonl's numeric values, step by step (float32 precision)."""
    assert sorted(tracked) == [r["step"] for r in rows]
    for row in rows:
        assert tracked[row["step"]] == pytest.approx(numeric(row), rel=1e-6, abs=1e-12), row["step"]


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_tensorboard_event_files_hold_the_metrics_jsonl_values(tmp_path):
    pytest.importorskip("tensorboard")
    run = tiny_run(tmp_path, "logging.backends=[jsonl,tensorboard]", "train.eval_every=1")
    assert run_id(run) == run_id(tiny_run(tmp_path, "train.eval_every=1"))  # trackers do not change the run
    train(run, tmp_path / "run", progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[1]
    assert_same_rows(tensorboard_scalars(tmp_path / "run" / "tensorboard"), rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    reader.Reload()
    assert "config/text_summary" in reader.Tags()["tensors"]  # the resolved config
    hparams = reader.PluginTagToContent("hparams")
    assert hparams and b"train.group_size" in b"".join(hparams.values())


@pytest.mark.slow
def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    run = tiny_run(tmp_path, "logging.backends=[jsonl,tensorboard]")
    first = RunRecords(run, tmp_path / "run", None, None, "native")
    with first.recording():
        for step in range(4):  # killed after logging step 3, its checkpoint at step 1
            first.log({"step": step, "reward_mean": float(step), "grad_norm": None})
    again = RunRecords(run, tmp_path / "run", 1, None, "native")
    with again.recording():
        for step in (2, 3, 4):
            again.log({"step": step, "reward_mean": 10.0 + step})
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["reward_mean"] for r in rows] == [0, 1, 12, 13, 14]
    assert_same_rows(tensorboard_scalars(tmp_path / "run" / "tensorboard"), rows)
    fresh = RunRecords(run, tmp_path / "run", None, None, "native")  # a restart from step 0 clears the folder
    with fresh.recording():
        fresh.log({"step": 0, "reward_mean": 5.0})
    assert tensorboard_scalars(tmp_path / "run" / "tensorboard") == {0: {"reward_mean": 5.0}}


def test_new_settings_at_their_defaults_keep_run_ids(tmp_path):
    plain = run_id(tiny_run(tmp_path))
    assert run_id(tiny_run(tmp_path, "logging.backends=[jsonl]", "train.export_every=0")) == plain
    assert run_id(tiny_run(tmp_path, "logging.backends=[jsonl,tensorboard]", "logging.project=x")) == plain
    assert run_id(tiny_run(tmp_path, "train.export_every=2")) != plain  # a different run: it writes exports


@pytest.mark.slow
def test_logging_backends_are_checked_before_any_run(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown backend 'tensorbord'. Did you mean 'tensorboard'\?"):
        tiny_run(tmp_path, "logging.backends=[jsonl,tensorbord]")
    with pytest.raises(ConfigError, match=r"must include jsonl .* logging.backends=\[jsonl,tensorboard\]"):
        tiny_run(tmp_path, "logging.backends=[tensorboard]")
    with pytest.raises(ConfigError, match=r"must include jsonl .* logging.backends=\[jsonl\]$"):  # was jsonl alone,
        tiny_run(tmp_path, "logging.backends=[]")  # silently, while [tensorboard] was refused
    with pytest.raises(ConfigError, match=r"^logging.backends lists jsonl more than once: list each backend once$"):
        tiny_run(tmp_path, "logging.backends=[jsonl,jsonl]")  # taken without a word (the seventh hostile pass)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as error:
        tiny_run(tmp_path, "logging.backends=[jsonl,wandb]")
    assert str(error.value) == ('logging.backends: wandb is not installed: pip install -e ".[track]" '
                                "(or pip install wandb)")
    for project in ("'../../x'", '"a\\nb"', "team/proj", "''", ".hidden", "'a\\b'"):  # before the tracker is looked for
        with pytest.raises(ConfigError, match="a tracker project is one name, not empty, not a path"):
            tiny_run(tmp_path, "logging.backends=[jsonl,trackio]", f"logging.project={project}")
    tiny_run(tmp_path, "logging.project='../../x'")  # jsonl alone: no project is used
    with pytest.raises(ConfigError, match="trackio is not installed"):  # a name with a space passes the name check
        real_find = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "trackio" else real_find(n, *a))
        tiny_run(tmp_path, "logging.backends=[jsonl,trackio]", "logging.project='My project-2'")


@pytest.mark.slow  # an end-to-end run in this process: make test
def test_a_failing_tracker_leaves_the_run_and_metrics_jsonl_alone(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    from harness.run import tracking

    monkeypatch.setattr(tracking.TensorBoardTracker, "log", lambda self, step, values: 1 / 0)
    train(tiny_run(tmp_path, "logging.backends=[jsonl,tensorboard]"), tmp_path / "run", progress=False)
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
    assert capsys.readouterr().err.count("logging.backends tensorboard failed at step 0") == 1


@pytest.mark.slow
def test_the_trl_backend_tracks_through_the_same_records(tmp_path):
    pytest.importorskip("tensorboard")
    from harness.loop.trl_backend import train_trl

    train_trl(tiny_run(tmp_path, "backend=trl", "logging.backends=[jsonl,tensorboard]"), tmp_path / "run",
              progress=False)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "pg_loss" in rows[1]
    assert_same_rows(tensorboard_scalars(tmp_path / "run" / "tensorboard"), rows)


@pytest.mark.slow
def test_a_sweep_resumes_its_runs_with_the_trackers_asked_for_now(tmp_path):
    pytest.importorskip("tensorboard")
    from omegaconf import OmegaConf

    from harness.apps.sweep import run_sweep
    from harness.run.config import load_experiment, run_configs
    from tests.helpers.tiny import TINY_RUN

    def experiment(*overrides):
        return load_experiment("base", [*TINY_RUN, f"results_dir={tmp_path}", "name=swept", "train.steps=1",
                                        *overrides])

    (run,) = run_configs(experiment())
    run_dir = tmp_path / "swept" / run_id(run)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(run))  # an earlier sweep's, before any tracker
    (entry,) = run_sweep(experiment("logging.backends=[jsonl,tensorboard]"), progress=False)
    assert entry["status"] == "finished" and entry["run_id"] == run_dir.name  # the same run, resumed
    assert list(OmegaConf.load(run_dir / "config.yaml").logging.backends) == ["jsonl", "tensorboard"]
    assert_same_rows(tensorboard_scalars(run_dir / "tensorboard"), read_jsonl(run_dir / "metrics.jsonl"))


# wandb and trackio run in a child process: their environment (offline, private folders) is set before they are
# imported, and a timeout stops the test rather than hang should either ever try the network.
CHILD = """
import json, sys
from pathlib import Path
from harness.loop.native import train
from tests.helpers.tiny import tiny_run

tmp = Path(sys.argv[1])
train(tiny_run(tmp, "logging.backends=[jsonl,{backend}]", "name=tracked"), tmp / "run", progress=False)
"""


def run_child(tmp_path: Path, backend: str, env: dict, code: str = "") -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    environment.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **env)
    script = textwrap.dedent(CHILD.format(backend=backend)) + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning: logging.backends" not in done.stderr, done.stderr[-3000:]


def wandb_records(path: Path) -> list[bytes]:
    """The records of an offline .wandb file (a LevelDB-style log: 7-byte header, 32 KiB blocks, each record
    [crc32 u32][length u16][type u8] data, type 1 full, 2 first, 3 middle, 4 last)."""
    data, records, pending, position = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B", "not a wandb transaction log"
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:  # block padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason='wandb not installed (pip install -e ".[track]")')
def test_wandb_runs_offline_by_default_with_every_row(tmp_path):
    from wandb.proto import wandb_internal_pb2

    # no WANDB_MODE, no user settings (a private WANDB_CONFIG_DIR, no ./wandb/settings): offline
    run_child(tmp_path, "wandb", {"WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_SILENT": "true"})
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history, runs = [], []
    for data in wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif record.WhichOneof("record_type") == "run":
            runs.append(record.run)
    assert runs[0].display_name == "run" and runs[0].run_group == "tracked" and runs[0].project == "rlvr-harness"
    assert {item.key for item in runs[0].config.update} >= {"train", "objective", "model", "task"}
    tracked = {h["_step"]: {k: v for k, v in h.items() if not k.startswith("_")} for h in history}
    assert_same_rows(tracked, read_jsonl(tmp_path / "run" / "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trackio") is None,
                    reason='trackio not installed (pip install -e ".[track]")')
def test_trackio_logs_every_row_locally(tmp_path):
    read_back = """
    from trackio.sqlite_storage import SQLiteStorage
    logs = SQLiteStorage.get_logs("rlvr-harness", "run")
    (tmp / "tracked.json").write_text(json.dumps({"logs": logs, "runs": SQLiteStorage.get_runs("rlvr-harness"),
                                                  "config": SQLiteStorage.get_run_config("rlvr-harness", "run")}))
    """
    run_child(tmp_path, "trackio", {"TRACKIO_DIR": str(tmp_path / "trackio")}, read_back)
    tracked = json.loads((tmp_path / "tracked.json").read_text())
    assert tracked["runs"] == ["run"] and tracked["config"]["_Group"] == "tracked"
    assert tracked["config"]["train"]["group_size"] == 4
    values = {log["step"]: {k: v for k, v in log.items() if k not in ("step", "timestamp")} for log in tracked["logs"]}
    assert_same_rows(values, read_jsonl(tmp_path / "run" / "metrics.jsonl"))
