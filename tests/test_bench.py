"""`make bench`: the repeats' summary by hand, and one tiny run of the whole benchmark (native and TRL)."""

import json
import re
import sys

import pytest
import torch

from harness.apps.bench import (
    RATIOS,
    bench_run,
    decode_matmuls,
    main,
    matmul_flops,
    matmul_peak,
    matmul_totals,
    median_of,
    memory_main,
    profile_main,
    scale_main,
    train_batch,
)
from harness.apps.cli import main as cli_main
from harness.policy.models import load_model
from harness.policy.sampler import sample_problems
from harness.run.errors import ConfigError
from tests.helpers.tiny import TINY_SPEC


def test_median_of_repeats_and_the_ratios_range():
    runs = [{"model": "tiny", "rollout_s": s, "warm_up_rollout_s": w, "completion_tokens": 100,
             **{k: r for k in RATIOS}} for s, w, r in ((0.3, 9.0, 2.0), (0.9, 0.1, 1.5), (0.4, 0.2, 2.5))]
    result = median_of(runs)
    assert result["rollout_s"] == 0.4 and result["native_over_trl_rollout_tok_s"] == 2.0
    assert result["warm_up_rollout_s"] == 9.0  # the first repeat's: a compile happens there
    assert result["model"] == "tiny" and result["completion_tokens"] == 100 and result["repeats"] == 3
    assert result["trl_over_native_step_time_min_max"] == "1.500 / 2.500"
    assert median_of(runs[:1]) is runs[0]


@pytest.mark.slow
def test_bench_runs_both_sides_and_writes_its_figures(tmp_path, capsys):
    overrides = ["model.name=tiny", "task.name=arith", "train.max_new_tokens=8", "train.prompts_per_step=2",
                 "train.group_size=2", "train.num_minibatches=2", "model.warm_start_steps=0", "threads=1",
                 f"results_dir={tmp_path}", *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items())]
    assert main(overrides, repeats=2) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert result["repeats"] == 2 and all(f"{k}_min_max" in result for k in RATIOS)
    for key in ("rollout_tok_s", "trl_rollout_tok_s", "trl_over_native_step_time"):  # names scripts read
        assert result[key] > 0 and key in printed
    phases = ("phase_logp_forward_s", "phase_backward_s", "phase_optimizer_s", "phase_update_other_s")
    assert all(result[key] > 0 for key in (*phases, "native_over_trl_generate_tok_s"))
    assert sum(result[key] for key in phases) == pytest.approx(result["update_s"], rel=0.2)  # medians of repeats
    for side in ("", "trl_"):  # each side's own peak memory per phase, and the process's
        assert 0 < result[f"{side}peak_mem_rollout_mb"] <= result[f"{side}peak_mem_mb"] <= result["max_rss_gb"] * 1024
        assert f"{side}peak_mem_update_mb" in printed


def test_decode_matmul_shapes_of_a_model():
    model, _ = load_model("tiny", tiny=TINY_SPEC)
    (row,) = decode_matmuls(model, rows=(3,), rounds=1)
    names = ("lm_head", "q+k+v", "o", "gate+up", "down")
    assert row["rows"] == 3 and set(row) == {"rows", *(f"{n}_{k}_gflop_s" for n in names for k in ("mkl", "onednn"))}
    assert all(value > 0 for value in row.values())


def test_the_matmul_flops_of_each_operator_from_its_shapes():
    assert matmul_flops("mkldnn::_linear_pointwise", [[3, 5, 16], [24, 16], [], [], [], []]) == 2 * 15 * 16 * 24
    assert matmul_flops("mkldnn::_linear_pointwise", [[15, 16], [15, 24], [24, 16], [], []]) == 2 * 15 * 16 * 24
    assert matmul_flops("aten::mm", [[15, 16], [16, 24]]) == 2 * 15 * 16 * 24
    assert matmul_flops("aten::addmm", [[24], [15, 16], [16, 24], [], []]) == 2 * 15 * 16 * 24
    assert matmul_flops("aten::bmm", [[4, 2, 8], [4, 8, 3]]) == 2 * 4 * 2 * 8 * 3
    assert matmul_flops("aten::baddbmm", [[4, 2, 3], [4, 2, 8], [4, 8, 3], [], []]) == 2 * 4 * 2 * 8 * 3
    assert matmul_flops("aten::mul", [[15, 16], [15, 16]]) is None


def test_a_profiles_matmul_flops_are_those_of_the_calls_made():
    from torch.profiler import profile

    from harness.policy.matmul import cpu_matmul, linear, linear_add, onednn_applies

    x, w = torch.randn(64, 16), torch.randn(24, 16)
    with profile(record_shapes=True) as prof:
        linear(x[:15].view(3, 5, 16), w)  # torch's kernel: aten::mm
        linear(x[:15], w, torch.randn(24))  # aten::addmm
        torch.bmm(torch.randn(4, 2, 8), torch.randn(4, 8, 3))
        torch.baddbmm(torch.randn(4, 2, 3), torch.randn(4, 2, 8), torch.randn(4, 8, 3))
        torch.mul(x, x)
    by_name, total = matmul_totals(prof)
    assert {name: flops for name, (flops, _) in by_name.items()} == {
        "aten::mm": 2 * 15 * 16 * 24, "aten::addmm": 2 * 15 * 16 * 24, "aten::bmm": 2 * 4 * 2 * 8 * 3,
        "aten::baddbmm": 2 * 4 * 2 * 8 * 3}
    assert sum(seconds for _, seconds in by_name.values()) <= total  # a share of every operator's time
    with cpu_matmul("onednn"):
        if onednn_applies(x, w):  # x86
            with profile(record_shapes=True) as prof:
                linear(x, w)
                linear_add(torch.randn(64, 24), x, w)  # (X, other, W): its FLOPs are X's and W's
            assert matmul_totals(prof)[0]["mkldnn::_linear_pointwise"][0] == 2 * 2 * 64 * 16 * 24


def test_the_bench_samples_and_updates_on_the_runs_kernel_and_trl_on_torchs(monkeypatch):
    from omegaconf import OmegaConf

    import harness.apps.bench as bench
    from harness.policy import matmul

    kernels = []
    monkeypatch.setattr(bench, "sample_problems", lambda *a, **k: kernels.append(("rollout", matmul._scope[-1])))
    monkeypatch.setattr(bench, "update", lambda *a, **k: kernels.append(("update", matmul._scope[-1])))
    monkeypatch.setattr(bench, "train_batch", lambda *a, **k: None)
    monkeypatch.setattr(bench.UpdatePlan, "of", classmethod(lambda cls, *a, **k: None))
    cfg = OmegaConf.create({"train": {"cpu_matmul": "onednn", "num_minibatches": 1, "epochs": 1}})
    bench.native_rollout(None, None, [], cfg)
    setup = type("Setup", (), {"task": None, "estimator": None})()
    bench.bench_update(None, setup, None, [], cfg, 1)
    assert kernels == [("rollout", "onednn"), ("update", "onednn")]  # as harness/loop/native.py runs them
    assert matmul._scope[-1] == "torch"  # outside: TRL's step keeps torch's kernel


def test_the_matmul_peak_runs_on_the_kernel_named():
    from torch.profiler import profile

    from harness.policy.matmul import _AVAILABLE

    for kernel, operator in ((None, "aten::mm"), ("torch", "aten::mm"), ("onednn", "mkldnn::_linear_pointwise")):
        if kernel == "onednn" and not _AVAILABLE:  # not an x86 CPU: torch's kernel under either setting
            continue
        with profile() as prof:
            assert matmul_peak(torch.float32, size=64, seconds=0.01, kernel=kernel) > 0
        assert operator in {event.name for event in prof.events()}


def test_a_steps_peak_is_the_faster_of_torchs_kernel_and_the_runs(monkeypatch):
    from omegaconf import OmegaConf

    import harness.apps.bench as bench

    calls = []
    rates = {None: 90.0, "onednn": 108.0}
    monkeypatch.setattr(bench, "matmul_peak", lambda dtype, kernel=None: calls.append((dtype, kernel)) or rates[kernel])

    def peak(dtype: str, kernel: str) -> float:
        return bench.machine_peak(OmegaConf.create({"model": {"dtype": dtype}, "train": {"cpu_matmul": kernel}}))

    assert peak("float32", "onednn") == 108.0 and calls == [(torch.float32, None), (torch.float32, "onednn")]
    calls.clear()
    assert peak("float32", "torch") == 90.0 and peak("bfloat16", "onednn") == 90.0  # oneDNN's path: float32 only
    assert calls == [(torch.float32, None), (torch.bfloat16, None)]


@pytest.mark.slow  # a whole run (or several): make test
def test_profile_prints_the_operators_of_one_rollout_and_one_update(capsys):
    overrides = ["model.name=tiny", "task.name=arith", "train.max_new_tokens=8", "train.prompts_per_step=2",
                 "train.group_size=2", "train.num_minibatches=2", "model.warm_start_steps=0", "threads=1",
                 *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items())]
    assert profile_main(overrides, rows=5) == 0
    printed = capsys.readouterr().out
    assert "one rollout (" in printed and "one update (" in printed
    rollout, update = printed.split("one update (")
    # the table's rows are ranked by measured time, so which operators make the top rows depends on the machine's
    # load: check the table's shape, not its ranking
    assert "Self CPU time total" in rollout and "Self CPU time total" in update
    for table in (rollout, update):  # the header and five operator rows, each with Self CPU % and CPU total %
        assert sum(line.count("%") == 2 for line in table.splitlines()) == 1 + 5
        assert "aten::" in table
        operator = r"[a-z_:]+ [0-9.]+ GFLOP in [0-9.]+ s \([0-9.]+ GFLOP/s\); "
        assert re.search(rf"\nmatmuls: ({operator})+[0-9]+% of [0-9.]+ s self CPU time\n", table)
    kernel = r"(torch|onednn)'s kernel [0-9.]+ GFLOP/s"  # torch's, and the run's where it is another
    assert re.search(rf"\na 2048 x 2048 float32 matmul here, 1 thread: torch's kernel [0-9.]+ GFLOP/s(, {kernel})? "
                     r"\(the run's: (torch|onednn)'s\)\n", update)


@pytest.mark.slow  # a whole run: make test
def test_memory_prints_each_phase_peak_and_the_updates_allocations(capsys):
    overrides = ["model.name=tiny", "task.name=arith", "train.max_new_tokens=8", "train.prompts_per_step=2",
                 "train.group_size=2", "train.num_minibatches=2", "model.warm_start_steps=0", "threads=1",
                 *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items())]
    assert memory_main(overrides, rows=5) == 0
    printed = capsys.readouterr().out
    figures = {line.split()[0]: line.split()[1] for line in printed.splitlines() if line.split()[:1] and
               line.split()[0].endswith(("_mb", "_s"))}
    assert {"peak_mem_rollout_mb", "peak_mem_update_mb", "weights_mb", "adamw_moments_mb", "rollout_s",
            "update_s", "sampler_weight_copies_mb", "sampler_keys_values_and_tables_mb"} <= set(figures)
    assert float(figures["adamw_moments_mb"]) == 2 * float(figures["weights_mb"])
    assert "Self CPU Mem" in printed and "aten::" in printed
    (live,) = [line for line in printed.splitlines() if line.startswith("the update's live tensors at their peak")]
    sizes = {part.rsplit(" ", 1)[0]: float(part.rsplit(" ", 1)[1]) for part in live.split("MiB: ")[1].split(", ")}
    assert {"parameter", "optimizer_state"} <= set(sizes)  # the tiny model's, by the profiler's categories
    assert sizes["optimizer_state"] >= sizes["parameter"]  # AdamW: two moments per parameter (MiB, rounded)


def test_the_bench_refuses_an_estimator_that_needs_the_loop_and_passes_lengths_to_the_others():
    tiny = ["model.name=tiny", "task.name=arith", "train.max_new_tokens=8", "train.prompts_per_step=2",
            "train.group_size=2", "train.num_minibatches=1", "model.warm_start_steps=0", "model.warm_start_target=null",
            "threads=1", *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items())]
    with pytest.raises(ConfigError, match="only the training loop provides \\(greedy_baseline\\)"):
        bench_run([*tiny, "objective.advantage=remax"])
    cfg, setup, problems, _ = bench_run([*tiny, "objective.advantage=reinforce_plus_plus"])  # it needs the lengths
    ro = sample_problems(setup.policy, setup.tokenizer, problems, cfg.train)
    batch = train_batch(ro, setup.task, problems, setup.estimator, cfg)
    assert batch.advantages.shape == (4,) and torch.isfinite(batch.advantages).all()


def test_the_bench_samples_the_same_completions_whether_or_not_loading_the_model_drew_random_numbers(monkeypatch):
    """Building the embedded model's cache in the bench's own process (a fresh RLVR_CACHE) draws from torch's
    generator; the bench seeds after loading, so its completions do not depend on it."""
    import harness.apps.bench

    tiny = [*TINY_BENCH, "train.max_new_tokens=8", "train.prompts_per_step=2", "train.group_size=4"]
    completions, real = [], harness.apps.bench.setup_run
    for draws in (0, 5):
        monkeypatch.setattr(harness.apps.bench, "setup_run", lambda *a, draws=draws: (torch.rand(draws), real(*a))[1])
        cfg, setup, problems, _ = bench_run(tiny)
        completions.append(sample_problems(setup.policy, setup.tokenizer, problems, cfg.train).completion_ids)
    assert torch.equal(*completions)


TINY_BENCH = ["model.name=tiny", "task.name=arith", "model.warm_start_steps=0", "model.warm_start_target=null",
              "threads=1", *(f"model.tiny.{k}={v}" for k, v in TINY_SPEC.items())]


@pytest.mark.slow
def test_scale_runs_one_fresh_process_per_point_and_keeps_a_killed_one(tmp_path, monkeypatch, capsys):
    """`bench --scale`'s grid, table and files, with each point's process stubbed (one point killed, as the kernel's
    out-of-memory killer would), and a grid the configuration cannot take refused before any point runs."""
    import subprocess

    calls = []

    def child(argv):
        calls.append(argv)
        rows = 8 * int(next(a for a in argv if a.startswith("train.prompts_per_step=")).split("=")[1])
        tokens = int(next(a for a in argv if a.startswith("train.max_new_tokens=")).split("=")[1])
        if rows == 16 and tokens == 8:
            return subprocess.CompletedProcess(argv, -9, "", "")
        step = {"threads": 1, "step_s": 1.0, "rollout_s": 0.4, "update_s": 0.6, "step_cpu_s": 1.0, "rows": rows,
                "completion_tokens": rows * tokens, "peak_mem_rollout_mb": 400.0 + rows,
                "peak_mem_update_mb": 410.0 + rows, "peak_mem_process_mb": 420.0 + rows * tokens}
        return subprocess.CompletedProcess(argv, 0, "a line the child printed\n" + json.dumps(step) + "\n", "")

    monkeypatch.setattr("harness.apps.bench.scale_point", child)
    assert scale_main([*TINY_BENCH, f"results_dir={tmp_path}"], rows=(8, 16), tokens=(4, 8)) == 0
    assert len(calls) == 4 and all(c[: len(TINY_BENCH) + 1] == [*TINY_BENCH, f"results_dir={tmp_path}"] for c in calls)
    points = json.loads((tmp_path / "bench" / "scale.json").read_text())
    assert [(p["rows"], p["max_new_tokens"]) for p in points] == [(8, 4), (8, 8), (16, 4), (16, 8)]
    assert points[3]["killed"] == "signal 9" and points[2]["peak_mem_process_mb"] == 420 + 64
    table = (tmp_path / "bench" / "scale.md").read_text()
    assert table.strip() == capsys.readouterr().out.strip()
    assert "--rows 8,16 --tokens 4,8" in table and "the process was killed (signal 9)" in table
    assert "| 16 | 4 | 64 | 416 | 426 | 484 |" in table
    with pytest.raises(ConfigError, match="rows \\[12\\] must be multiples of train.group_size=8"):
        scale_main(TINY_BENCH, rows=(8, 12), tokens=(4,))
    with pytest.raises(ConfigError, match="num_minibatches"):  # 8 rows in 4 minibatches: fine; 8 in 3: refused
        scale_main([*TINY_BENCH, "train.num_minibatches=3"], rows=(8,), tokens=(4,))
    assert len(calls) == 4  # no point ran for either

    def refused(argv):  # a setting only the point's model refuses, as it loads (its positions)
        return subprocess.CompletedProcess(argv, 2, "", "loading\nconfig error: train.max_new_tokens=9 leaves no "
                                                        "position for the prompt\n")

    monkeypatch.setattr("harness.apps.bench.scale_point", refused)  # was status 1, 'error: RuntimeError: ...'
    with pytest.raises(ConfigError, match=r"^bench --scale at 8 rows x 9 tokens: train.max_new_tokens=9 leaves no"):
        scale_main([*TINY_BENCH, f"results_dir={tmp_path / 'refused'}"], rows=(8,), tokens=(9,))
    assert not (tmp_path / "refused").exists()  # and an empty results/bench/ was left behind
    calls.clear()
    monkeypatch.setattr("harness.apps.bench.scale_point", child)
    with pytest.raises(ConfigError, match=r"longest prompt \(\d+ tokens\) and train.max_new_tokens=500 need"):
        scale_main([*TINY_BENCH, f"results_dir={tmp_path / 'late'}"], rows=(8,), tokens=(4, 500))  # 512 positions
    assert calls == [] and not (tmp_path / "late").exists()  # the 4-token point ran first, then the 500 one failed


@pytest.mark.slow  # a process: make test
def test_scale_measures_full_length_points_in_fresh_processes(tmp_path):
    assert scale_main([*TINY_BENCH, "train.num_minibatches=2", f"results_dir={tmp_path}"], rows=(8,), tokens=(12,)) == 0
    (point,) = json.loads((tmp_path / "bench" / "scale.json").read_text())
    assert point["completion_tokens"] == 8 * 12  # every row at full length
    assert 0 < point["peak_mem_rollout_mb"] <= point["peak_mem_process_mb"] and point["step_s"] > 0


def test_bad_settings_of_the_bench_are_a_config_error_like_every_command(capsys):
    """`bench model.name=bogus` is a config error with status 2, not 'error: ConfigError: ...' with status 1
    (docs/hostile_pass.md, case 92)."""
    assert cli_main(["bench", "model.name=bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model.name 'bogus' is neither") and err.count("\n") == 1, err


@pytest.mark.parametrize("mode", ["--busy", "--lora"])
def test_bench_busy_and_lora_refuse_bad_settings_before_their_first_process(mode, tmp_path, monkeypatch, capsys):
    """Their children each check the settings, so a mistake was the first child's last line, 13 to 16 s in; now the
    mode itself says it, in one line, before a child starts (a bad key; a cache this machine cannot use)."""
    from harness.apps import bench

    started = []

    def watched(real):  # the bench's children are `python -m harness bench --step` and its busy `python -c`
        def start(command, *args, **kwargs):
            if command[0] == sys.executable:
                started.append(command)
            return real(command, *args, **kwargs)
        return start

    monkeypatch.setattr(bench.subprocess, "run", watched(bench.subprocess.run))
    monkeypatch.setattr(bench.subprocess, "Popen", watched(bench.subprocess.Popen))
    assert cli_main(["bench", mode, *TINY_BENCH, "train.bogus=1"]) == 2
    assert capsys.readouterr().err.startswith("config error: unknown config key 'train.bogus'")
    monkeypatch.setenv("RLVR_CACHE", "relative/cache")  # a check of this machine's, not of the settings
    assert cli_main(["bench", mode, "task.name=arith"]) == 2  # bench.yaml's SmolLM2: the embedded model's cache
    err = capsys.readouterr().err
    assert err.startswith("config error: RLVR_CACHE='relative/cache' is a relative path") and err.count("\n") == 1
    assert started == []


@pytest.mark.slow  # two processes: make test
def test_lora_runs_a_full_and_a_lora_step_in_fresh_processes_on_the_same_rollout(tmp_path, capsys):
    from harness.apps.bench import lora_main

    assert lora_main([*TINY_BENCH, "train.max_new_tokens=8", "train.num_minibatches=2", "model.lora.rank=4",
                      f"results_dir={tmp_path}"]) == 0
    full, lora = json.loads((tmp_path / "bench" / "lora.json").read_text())
    assert (full["side"], lora["side"]) == ("full fine-tuning", "LoRA rank 4")
    adapters = TINY_SPEC["num_layers"] * 4 * (  # rank 4 on q, k, v, o (hidden x hidden) and gate, up, down
        4 * 2 * TINY_SPEC["hidden_size"] + 3 * (TINY_SPEC["hidden_size"] + TINY_SPEC["intermediate_size"]))
    assert lora["trained_parameters"] == adapters < full["trained_parameters"]
    assert lora["completion_tokens"] == full["completion_tokens"] > 0  # B = 0: the same rollout
    table = (tmp_path / "bench" / "lora.md").read_text()
    assert table.strip() == capsys.readouterr().out.strip() and "| LoRA rank 4 | " in table
