"""harness/policy/warm_start.py: the supervised warm start stops in its band, is cached under a key that covers its
recipe, and errors outside the band."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_model

import harness.policy.warm_start
from harness.policy.models import cache_dir, load_model
from harness.policy.warm_start import WarmStartError, WarmStartRecipe, _check_accuracy, warm_start
from harness.run.errors import ConfigError
from harness.run.provenance import cpu, tensors_digest
from harness.tasks import get_task
from tests.helpers.tiny import TINY_SPEC
from tests.helpers.tiny_moe import TINY_MOE_SPEC, tiny_moe_run


def _no_training(*args, **kwargs):
    raise AssertionError("trained on a cache hit")


def _easy_task():
    return get_task("arith", num_operands=2, digits=1, train_size=2000, eval_size=8)

BAND = {"max_steps": 150, "lr": 1e-2, "batch_size": 16, "seed": 0, "target": (0.05, 1.0), "check_every": 10,
        "check_size": 32}


@pytest.mark.slow  # trains a warm start: make test
def test_warm_start_stops_in_band_and_is_cached(rlvr_cache, monkeypatch):
    task = _easy_task()
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    model, sidecar = warm_start(model, tokenizer, task, WarmStartRecipe(**BAND))
    accuracies = {int(step): acc for step, acc in sidecar["checks"].items()}
    assert sidecar["steps"] == max(accuracies) and sidecar["steps"] % BAND["check_every"] == 0
    assert 0.05 <= sidecar["accuracy"] == accuracies[sidecar["steps"]] <= 1.0
    assert all(acc < 0.05 for step, acc in accuracies.items() if step < sidecar["steps"])
    check_set = task.train_problems()[: BAND["check_size"]]
    assert _check_accuracy(model, tokenizer, task, check_set) == sidecar["accuracy"] and not model.training
    assert sidecar["target"] == [0.05, 1.0] and sidecar["max_steps"] == 150 and sidecar["torch_threads"] >= 1
    folder = rlvr_cache / "warm_start"
    assert json.loads((folder / f"{sidecar['key']}.json").read_text()) == sidecar
    assert (folder / f"{sidecar['key']}.safetensors").is_file() and not list(folder.glob(".*"))  # no temp files

    monkeypatch.setattr(torch.optim, "AdamW", _no_training)
    fresh, _ = load_model("tiny", tiny=TINY_SPEC)
    fresh, hit = warm_start(fresh, tokenizer, task, WarmStartRecipe(**BAND))
    assert hit == sidecar and not fresh.training
    trained = model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in fresh.state_dict().items())

    (folder / f"{sidecar['key']}.json").unlink()  # a hit needs the weights and the sidecar
    with pytest.raises(AssertionError, match="cache hit"):
        warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, task, WarmStartRecipe(**BAND))


@pytest.mark.slow  # trains a warm start: make test
def test_a_starting_policy_records_its_weights_digest_and_cpu_and_a_changed_cache_file_is_refused(rlvr_cache):
    task, recipe = _easy_task(), WarmStartRecipe(**BAND)
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    model, sidecar = warm_start(model, tokenizer, task, recipe)
    assert sidecar["weights_sha256"] == tensors_digest(model.state_dict())[:16] and len(sidecar["weights_sha256"]) == 16
    assert sidecar["cpu"] == cpu() and sidecar["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    fresh, hit = warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, task, recipe)
    assert hit == sidecar  # recomputed from the loaded weights: the same

    folder = rlvr_cache / "warm_start"
    sidecar_path, weights = folder / f"{sidecar['key']}.json", folder / f"{sidecar['key']}.safetensors"
    older = {k: v for k, v in sidecar.items() if k != "weights_sha256"}  # a sidecar from before the digest
    sidecar_path.write_text(json.dumps(older))
    assert warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, task, recipe)[1] == sidecar

    sidecar_path.write_text(json.dumps(sidecar))
    with torch.no_grad():
        next(fresh.parameters()).add_(1.0)
    save_model(fresh, str(weights))  # the cached weights changed after they were built
    with pytest.raises(ConfigError, match=f"records {sidecar['weights_sha256']}: the file changed after it was built"):
        warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, task, recipe)

    unreadable = "cannot be read .*; remove both, and the next run builds it again"
    for damage in ("cut short", "sidecar not JSON", "sidecar a list", "another model's weights"):
        save_model(fresh, str(weights))
        sidecar_path.write_text(json.dumps(sidecar))
        if damage == "cut short":
            weights.write_bytes(weights.read_bytes()[:1000])
        elif damage == "sidecar not JSON":
            sidecar_path.write_text("{garbage")
        elif damage == "sidecar a list":
            sidecar_path.write_text("[]")
        else:
            save_model(torch.nn.Linear(2, 2), str(weights))
        with pytest.raises(ConfigError, match=f"^the cached starting policy {weights} .*{unreadable}") as e:
            warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, task, recipe)
        assert "\n" not in str(e.value), damage


@pytest.mark.slow
@pytest.mark.parametrize("name, spec", [("tiny", TINY_SPEC), ("tiny_moe", TINY_MOE_SPEC)])
def test_warm_start_reaches_the_band_and_builds_the_same_weights_with_1_and_2_threads(rlvr_cache, name, spec):
    """The caller's thread count changes neither the steps taken nor a bit of the weights (the warm start trains with
    WARM_START_THREADS; with the caller's threads the tiny model's weights differ after 30 steps), and the caller's
    count is restored."""
    task, threads = _easy_task(), torch.get_num_threads()
    built = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            model, tokenizer = load_model(name, tiny=spec)
            model, sidecar = warm_start(model, tokenizer, task, WarmStartRecipe(**BAND),
                                        cache_key_extra=f"threads={n}")  # built twice, not a cache hit
            assert torch.get_num_threads() == n and sidecar["torch_threads"] == 1
            assert 0.05 <= sidecar["accuracy"] <= 1.0
            built.append((sidecar["steps"], sidecar["checks"], model.state_dict()))
    finally:
        torch.set_num_threads(threads)
    (steps1, checks1, weights1), (steps2, checks2, weights2) = built
    assert (steps1, checks1) == (steps2, checks2)
    assert all(torch.equal(weights1[k], weights2[k]) for k in weights1)


def test_a_build_without_progress_still_says_it_builds_and_where(rlvr_cache, capsys):
    """--no-progress turned off the bars and the news too: a build of minutes printed nothing."""
    recipe = WarmStartRecipe(**{**BAND, "max_steps": 3, "check_every": 5, "check_size": 8, "target": None})
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    _, sidecar = warm_start(model, tokenizer, _easy_task(), recipe, progress=False)
    err = capsys.readouterr().err
    weights = rlvr_cache / "warm_start" / f"{sidecar['key']}.safetensors"
    assert f"starting policy: building it once (supervised warm start, 3 steps); cached at {weights}" in err
    assert "starting policy: built in " in err and "warm start:" not in err and "loss=" not in err  # no bar
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    warm_start(model, tokenizer, _easy_task(), recipe, progress=False)
    assert capsys.readouterr().err == ""  # a cache hit: nothing to say without progress


@pytest.mark.slow
def test_the_warm_start_says_what_it_builds_with_a_bar_and_builds_the_same_weights(rlvr_cache, capsys):
    """progress=True: a line naming the cache and the band, a bar of steps against the cap with the last check and
    an ETA, then on a cache hit "loaded <path>"; the steps, checks and every weight bit as without the bar."""
    task, built = _easy_task(), []
    recipe = WarmStartRecipe(**{**BAND, "max_steps": 12, "check_every": 5, "check_size": 8, "target": (0.0, 1.0)})
    for progress in (False, True):
        model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
        model, sidecar = warm_start(model, tokenizer, task, recipe, progress=progress,
                                    cache_key_extra=f"progress={progress}")  # built twice, not a cache hit
        built.append((sidecar["steps"], sidecar["checks"], model.state_dict()))
    (steps0, checks0, weights0), (steps1, checks1, weights1) = built
    assert (steps0, checks0) == (steps1, checks1) and all(torch.equal(weights0[k], weights1[k]) for k in weights0)
    err = capsys.readouterr().err
    weights = rlvr_cache / "warm_start" / f"{sidecar['key']}.safetensors"
    assert f"building it once (supervised warm start, up to 12 steps, stopping at the first check (every 5) " \
           f"of held-out accuracy in [0.00, 1.00]); cached at {weights}" in err
    last = f"{sidecar['accuracy']:.3f} at step 5"
    assert "5/12 [" in err and f"check={last}, band=[0.00, 1.00]]" in err  # the cap
    assert "check=none yet" in err and "<00:" in err and "loss=" in err  # before the first check; the ETA
    assert err.endswith(f"starting policy: built in {sidecar['wall_time_s']:.0f} s (5 steps, check accuracy "
                        f"{sidecar['accuracy']:.3f}), cached at {weights}\n") and "loaded" not in err

    fresh, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    warm_start(fresh, tokenizer, task, recipe, progress=True, cache_key_extra="progress=True")
    err = capsys.readouterr().err
    assert err == f"starting policy: loaded {weights} (warm start built once: {steps1} steps, check accuracy " \
                  f"{sidecar['accuracy']:.3f})\n"


def test_warm_start_errors_outside_the_band(rlvr_cache, monkeypatch):
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    settings = {**BAND, "max_steps": 3, "target": (0.9, 1.0)}
    with pytest.raises(WarmStartError, match=r"max_steps=3 below .*0\.00 at step 3; raise max_steps") as error:
        warm_start(model, tokenizer, _easy_task(), WarmStartRecipe(**settings))
    assert "\n" not in str(error.value)
    (record,) = (rlvr_cache / "warm_start").glob("*")  # the miss, recorded; no policy
    assert record.name.endswith(".missed.json") and json.loads(record.read_text())["error"] == str(error.value)

    def trains(*args):
        raise AssertionError("a recorded miss was trained again")

    with monkeypatch.context() as patch, pytest.raises(WarmStartError, match=rf"max_steps=3 below .*; raise "
                                                       rf"max_steps.* \(recorded in {record} when"):
        patch.setattr("harness.policy.warm_start._train", trains)
        warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, _easy_task(), WarmStartRecipe(**settings))
    record.unlink()

    accuracies = iter([0.0, 0.8])

    def jumping_check(model, tokenizer, task, problems):
        return next(accuracies)

    monkeypatch.setattr("harness.policy.warm_start._check_accuracy", jumping_check)
    settings = {**BAND, "max_steps": 10, "check_every": 1, "target": (0.3, 0.45)}
    with pytest.raises(WarmStartError, match=r"overshot .*0\.00 at step 1, 0\.80 at step 2; lower check_every"):
        warm_start(load_model("tiny", tiny=TINY_SPEC)[0], tokenizer, _easy_task(), WarmStartRecipe(**settings))
    assert [p.suffixes for p in (rlvr_cache / "warm_start").glob("*")] == [[".missed", ".json"]]  # no policy


@pytest.mark.slow
def test_warm_start_key_covers_recipe_and_target(rlvr_cache, monkeypatch):
    task = _easy_task()
    settings = {**BAND, "max_steps": 1, "check_every": 1, "check_size": 8, "target": (0.0, 1.0)}

    def key(**overrides) -> str:
        model, tokenizer = load_model("tiny", tiny=TINY_SPEC)  # fresh: the key covers the initial weights
        return warm_start(model, tokenizer, task, WarmStartRecipe(**{**settings, **overrides}))[1]["key"]

    first = key()
    assert key() == first and key(target=(0.0, 0.9)) != first
    source_hash = harness.policy.warm_start._recipe_source_hash()
    # each patch in a context of its own: monkeypatch.undo() would also undo rlvr_cache's RLVR_CACHE, and the builds
    # after it would write into the user's own cache
    for name, value in [("WARM_START_RECIPE", harness.policy.warm_start.WARM_START_RECIPE + 1),
                        ("RECIPE_SOURCE_HASH", "changed"), ("WARM_START_THREADS", 2)]:  # other threads round otherwise
        with monkeypatch.context() as patch:
            patch.setattr(f"harness.policy.warm_start.{name}", value)
            assert key() != first
    assert len(list((rlvr_cache / "warm_start").glob("*.safetensors"))) == 5  # every policy built in this test's cache

    def edited_check(model, tokenizer, task, problems):
        return 0.5

    def edited_cache(model, weights, missed, report):
        return None

    with monkeypatch.context() as patch:
        patch.setattr("harness.policy.warm_start._cached", edited_cache)  # the caching: not what trains
        assert harness.policy.warm_start._recipe_source_hash() == source_hash
    for trains in ("_check_accuracy", "_build"):
        with monkeypatch.context() as patch:
            patch.setattr(f"harness.policy.warm_start.{trains}", edited_check)
            assert harness.policy.warm_start._recipe_source_hash() != source_hash


def test_warm_start_without_target_runs_exactly_max_steps(rlvr_cache):
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    recipe = WarmStartRecipe(max_steps=7, lr=1e-2, batch_size=4, seed=0)
    model, sidecar = warm_start(model, tokenizer, _easy_task(), recipe)
    assert len(forwards) == 7 and sidecar["steps"] == 7 and sidecar["checks"] == {}
    assert sidecar["accuracy"] is None and sidecar["target"] is None
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow  # four warm starts (seconds): make test
@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_the_warm_start_builds_the_same_weights_with_activation_checkpointing(rlvr_cache, tmp_path, monkeypatch,
                                                                             model):
    """A run with train.activation_checkpointing warm-starts with its activations recomputed too (harness/loop/
    build.py sets the memory settings before the warm start): bit-equal gradients, so the same steps, weights and
    cache key as without."""
    import harness.loop.build
    from harness.loop.build import build_policy, build_task
    from tests.helpers.tiny import tiny_run

    calls, real = [], harness.loop.build.warm_start
    monkeypatch.setattr(harness.loop.build, "warm_start", lambda model, *a, **k: (
        calls.append(getattr(model, "is_activation_checkpointing", False)) or real(model, *a, **k)))
    built = []
    for on in ("false", "true"):
        run = (tiny_moe_run if model == "tiny_moe" else tiny_run)(
            tmp_path, "model.warm_start_steps=4", "model.warm_start_target=null",
            f"train.activation_checkpointing={on}")
        policy, _, sidecar = build_policy(run, build_task(run), torch.device("cpu"))
        (rlvr_cache / "warm_start" / f"{sidecar['key']}.safetensors").unlink()  # the next one trains again
        built.append((sidecar["key"], sidecar["steps"], policy.state_dict(), calls[-1]))
    (key0, steps0, weights0, checkpointed0), (key1, steps1, weights1, checkpointed1) = built
    assert (key0, steps0) == (key1, steps1) and (checkpointed0, checkpointed1) == (False, True)
    assert all(torch.equal(weights0[k], weights1[k]) for k in weights0)


def test_running_out_of_device_memory_while_loading_a_cached_policy_is_not_called_a_damaged_file(tmp_path,
                                                                                                 monkeypatch):
    """The loader names a file it cannot read; the device's memory running out is the device's error, raised as is."""
    weights = tmp_path / "key.safetensors"
    weights.write_bytes(b"")
    weights.with_suffix(".json").write_text("{}")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(harness.policy.warm_start, "load_model", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        harness.policy.warm_start.load_safetensors(torch.nn.Linear(1, 1), weights, "cpu")


def test_the_private_cache_stays_set_when_a_test_undoes_its_own_patches(rlvr_cache, monkeypatch):
    """rlvr_cache's RLVR_CACHE is not the test's monkeypatch's to undo: a test that called monkeypatch.undo() built its
    later starting policies in the user's own cache."""
    monkeypatch.setattr("harness.policy.warm_start.WARM_START_THREADS", 2)
    monkeypatch.undo()
    assert cache_dir() == rlvr_cache


def test_a_warm_start_whose_loss_is_not_finite_stops_at_that_step(rlvr_cache):
    """Weights that are no longer finite (float16 without loss scaling, too large an lr) stay so: the build stops at
    the first such loss in one line, recorded as a miss, instead of training on to the cap."""
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    recipe = WarmStartRecipe(**{**BAND, "max_steps": 40, "check_every": 20})
    with pytest.raises(WarmStartError, match=r"the loss is nan at step 1: .* use float32 or bfloat16") as error:
        warm_start(model, tokenizer, _easy_task(), recipe)
    assert len(forwards) == 1 and "\n" not in str(error.value)
    (record,) = (rlvr_cache / "warm_start").glob("*")
    assert record.name.endswith(".missed.json")


def test_the_band_is_closed_and_a_check_leaves_the_models_mode_as_it_was(rlvr_cache, monkeypatch):
    """A check at exactly the band's top stops there (low <= acc <= high); greedy checks run in eval mode and give the
    training back its train mode."""
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    task = _easy_task()
    model.train()
    _check_accuracy(model, tokenizer, task, task.train_problems()[:2])
    assert model.training
    monkeypatch.setattr("harness.policy.warm_start._check_accuracy", lambda *args: 0.45)
    settings = {**BAND, "max_steps": 4, "check_every": 2, "target": (0.3, 0.45)}
    _, sidecar = warm_start(model, tokenizer, task, WarmStartRecipe(**settings))
    assert sidecar["steps"] == 2 and sidecar["accuracy"] == 0.45


def test_without_a_target_no_check_set_is_held_out(rlvr_cache):
    """With no band there is no check: every train problem is trained on (a train set smaller than check_size too)."""
    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    task = get_task("arith", num_operands=2, digits=1, train_size=16, eval_size=8)
    _, sidecar = warm_start(model, tokenizer, task, WarmStartRecipe(max_steps=1, lr=1e-2, batch_size=2, seed=0))
    assert sidecar["steps"] == 1


def test_the_cache_key_covers_the_weights_and_not_the_held_out_set():
    """A folder model whose weights changed under the same config gets another starting policy; the task's eval_set
    (which held-out set) does not change the warm-started weights, nor the key."""
    from harness.policy.warm_start import _warm_start_key

    model, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    task = get_task("arith", num_operands=2, digits=1, train_size=16, eval_size=8)
    key = _warm_start_key(model, tokenizer, task, [])
    other_set = get_task("arith", num_operands=2, digits=1, train_size=16, eval_size=8, eval_set=1)
    assert _warm_start_key(model, tokenizer, other_set, []) == key
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    assert _warm_start_key(model, tokenizer, task, []) != key


def test_a_check_interval_below_1_is_a_config_error():
    from omegaconf import OmegaConf

    from harness.policy.warm_start import check_warm_start

    model = {"warm_start_steps": 10, "warm_start_check_every": 0, "warm_start_target": [0.1, 0.2]}
    with pytest.raises(ConfigError, match="warm_start_check_every >= 1"):
        check_warm_start(OmegaConf.create({"model": model}))
    check_warm_start(OmegaConf.create({"model": {**model, "warm_start_check_every": 1}}))


def test_the_supervised_batch_trains_on_the_solution_and_eos_only():
    from harness.policy.models import build_prompt
    from harness.policy.warm_start import _supervised_batch

    _, tokenizer = load_model("tiny", tiny=TINY_SPEC)
    problems = _easy_task().train_problems()[:2]
    batch = _supervised_batch(tokenizer, problems, "cpu")
    for row, problem in enumerate(problems):
        prompt = len(tokenizer(build_prompt(tokenizer, problem.question), add_special_tokens=False).input_ids)
        solution = tokenizer(problem.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        length = int(batch["attention_mask"][row].sum())
        assert length == prompt + len(solution)
        labels = batch["labels"][row]
        assert bool((labels[:prompt] == -100).all()) and bool((labels[length:] == -100).all())
        assert labels[prompt:length].tolist() == solution == batch["input_ids"][row, prompt:length].tolist()


def test_the_recipes_seed_and_lr_are_the_ones_it_trains_with(rlvr_cache):
    def weights(**recipe) -> dict:
        model, tokenizer = load_model("tiny", tiny=TINY_SPEC, seed=0)
        settings = {"max_steps": 1, "lr": 1e-2, "batch_size": 2, "seed": 0, **recipe}
        return warm_start(model, tokenizer, _easy_task(), WarmStartRecipe(**settings))[0].state_dict()

    start, first, other = load_model("tiny", tiny=TINY_SPEC, seed=0)[0].state_dict(), weights(), weights(seed=1)
    assert any(not torch.equal(first[k], v) for k, v in other.items())  # another seed: other batches
    assert all(torch.equal(start[k], v) for k, v in weights(lr=0.0).items())  # lr 0: no step moves a weight


def test_builds_since_counts_the_sidecars_built_from_that_second_on(rlvr_cache):
    from datetime import UTC, datetime, timedelta

    from harness.policy.warm_start import builds_since

    at = datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)
    folder = rlvr_cache / "warm_start"
    folder.mkdir(parents=True)
    for name, when in (("same_second.json", at.replace(microsecond=0)), ("later.missed.json", at + timedelta(1)),
                       ("before.json", at - timedelta(1)), ("before.missed.json", at - timedelta(1))):
        (folder / name).write_text(json.dumps({"built_at": when.isoformat(timespec="seconds")}))
    (folder / "no_zone.json").write_text(json.dumps({"built_at": "2026-01-02T03:04:06"}))
    (folder / "other.json").write_text("[]")
    assert builds_since(at) == (2, 1)


def test_no_problem_with_a_check_set_question_is_trained_on(rlvr_cache, monkeypatch):
    """The easy task repeats questions: a train problem asking a check-set question is held out with it."""
    from harness.policy.warm_start import _supervised_batch

    trained = []

    def recording(tokenizer, problems, device):
        trained.extend(problem.question for problem in problems)
        return _supervised_batch(tokenizer, problems, device)

    monkeypatch.setattr("harness.policy.warm_start._supervised_batch", recording)
    monkeypatch.setattr("harness.policy.warm_start._check_accuracy", lambda *args: 0.5)
    task = _easy_task()
    settings = {**BAND, "max_steps": 2, "check_every": 2, "batch_size": 64, "target": (0.0, 1.0)}
    warm_start(load_model("tiny", tiny=TINY_SPEC)[0], load_model("tiny", tiny=TINY_SPEC)[1], task,
               WarmStartRecipe(**settings))
    check = {problem.question for problem in task.train_problems()[: BAND["check_size"]]}
    assert len(trained) == 128 and not check & set(trained)


def test_without_a_target_the_check_settings_are_not_in_the_key():
    from harness.policy.warm_start import _settings

    plain = {"max_steps": 5, "lr": 1e-2, "batch_size": 2, "seed": 0}
    assert _settings(WarmStartRecipe(**plain)) == _settings(WarmStartRecipe(**plain, check_every=7, check_size=9))
    banded = {**plain, "target": (0.1, 0.2)}
    assert _settings(WarmStartRecipe(**banded)) != _settings(WarmStartRecipe(**banded, check_every=7))
