"""The supervised warm start: the starting policy of a run, trained on the task's solutions until it solves some
problems, cached, the same for every run of a sweep (like an RL run's starting checkpoint).

    recipe = WarmStartRecipe(max_steps=3000, lr=1e-3, batch_size=32, seed=0, target=(0.30, 0.45))
    model, sidecar = warm_start(model, tokenizer, task, recipe)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig
from safetensors import SafetensorError
from safetensors.torch import load_model
from safetensors.torch import save_model as save_safetensors
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from harness.policy.matmul import cpu_matmul, resolve
from harness.policy.models import build_prompt, cache_dir
from harness.policy.sampler import sample_problems
from harness.run.atomic import atomic_write
from harness.run.checks import register_check
from harness.run.errors import ConfigError
from harness.run.provenance import cpu, tensors_digest
from harness.run.threads import fixed_threads
from harness.tasks import Task

log = logging.getLogger(__name__)

WARM_START_RECIPE = 3  # bump on a change to the recipe that the source hash below would not see (3: oneDNN's kernels)
# Torch threads of the warm start's training and checks, whatever the caller's: CPU reductions round differently with
# another count, and over a warm start's many steps the weights part ways (stopping at another step, with another
# eval accuracy: docs/loop.md, "The starting policy"). Every run of a sweep starts from this one policy, so a
# difference here is shared by all its seeds, not averaged out by them; a fixed count builds the same starting policy
# on an idle or a busy machine and with any number of cores (on one CPU family: other instruction sets round otherwise).
WARM_START_THREADS = 1
# The kernel of its linear layers, whatever the run's train.cpu_matmul (harness/policy/matmul.py), for the same reason:
# auto's, which depends on the CPU alone (the CPU already decides the rounding).
WARM_START_MATMUL = "auto"
CHECK_CHUNK = 64  # check-set problems per sampler call
MISSED_SUFFIX = ".missed.json"  # beside the cached policies: a recipe that missed its band, its error and checks


class WarmStartError(ValueError):
    """The warm start could not stop inside its target band (a command exits with :data:`MISSED_BAND`)."""


MISSED_BAND = 3  # the exit status of a command whose warm start missed its band (harness/apps/cli.py)
# task arguments the warm-started weights do not depend on, left out of the cache key (a cached policy keeps its key
# when a task gains one): which held-out set, how long a reasoning-gym answer's scoring may take
NOT_IN_KEY = ("eval_set", "score_timeout_s")


@register_check("warm_start")
def check_warm_start(run: DictConfig) -> None:
    """``model.warm_start_*``: a step cap and a check interval, a band [low, high] inside [0, 1] with a cap."""
    m = run.model
    if m.warm_start_steps < 0 or m.warm_start_check_every < 1:
        raise ConfigError(f"need model.warm_start_steps >= 0 and model.warm_start_check_every >= 1, got "
                          f"{m.warm_start_steps} and {m.warm_start_check_every}")
    target = m.warm_start_target
    if target is not None and (len(target) != 2 or not 0 <= target[0] <= target[1] <= 1):
        raise ConfigError(f"model.warm_start_target must be [low, high] with 0 <= low <= high <= 1, got "
                          f"{list(target)}")
    if target is not None and not m.warm_start_steps:
        raise ConfigError(f"model.warm_start_target={list(target)} needs model.warm_start_steps > 0 (the step cap); "
                          "for no warm start set both: model.warm_start_steps=0 model.warm_start_target=null")


@dataclass(frozen=True)
class WarmStartRecipe:
    """How the warm start trains (:func:`warm_start`)."""

    max_steps: int  # steps (the cap, with a target)
    lr: float  # AdamW, constant
    batch_size: int  # problems per step
    seed: int  # the batches' random stream
    target: tuple[float, float] | None = None  # (low, high): stop at the first check in the band
    check_every: int = 50  # steps between checks (with a target)
    check_size: int = 128  # train problems held out as the check set (with a target)


class WarmStartProgress:
    """What the warm start says on stderr: that it builds its policy and where it is cached, then that it built it,
    whatever ``progress``; when asked (``progress``) also where a loaded one came from, and while it builds a bar of
    its steps against the cap with the last check's accuracy beside the target band and an ETA (to the cap: it stops
    at the first check inside the band). Reads the loss and the checks, never a random stream nor the thread count:
    the weights are the same with or without it. A loss that is not finite stops the build there
    (:class:`WarmStartError`), shown or not: the weights it came from are not finite either, and every later step up
    to the cap would be the same."""

    def __init__(self, recipe: WarmStartRecipe, weights: Path, enabled: bool):
        self.recipe, self.weights, self.enabled = recipe, weights, enabled
        self.bar, self.postfix, self.steps = None, {}, 0

    def say(self, text: str, always: bool = False) -> None:
        """``text`` on stderr when progress is shown, or ``always`` (a build's start and end: minutes of silence
        otherwise under --no-progress, which turns off the bars, not the news)."""
        if self.enabled or always:
            tqdm.write(text, file=sys.stderr)

    def loaded(self, sidecar: dict) -> None:
        self.say(f"starting policy: loaded {self.weights} (warm start built once: {_reached(sidecar)})")

    def built(self, sidecar: dict) -> None:
        self.say(f"starting policy: built in {sidecar['wall_time_s']:.0f} s ({_reached(sidecar)}), cached at "
                 f"{self.weights}", always=True)

    def building(self) -> None:
        r = self.recipe
        until = (f"up to {r.max_steps} steps, stopping at the first check (every {r.check_every}) of held-out "
                 f"accuracy in {_band(r.target)}" if r.target is not None else f"{r.max_steps} steps")
        self.say(f"starting policy: building it once (supervised warm start, {until}); cached at {self.weights} "
                 "for every later run", always=True)
        self.bar = tqdm(total=r.max_steps, desc="warm start", unit="step", file=sys.stderr, disable=not self.enabled,
                        dynamic_ncols=True)
        self.postfix = {"loss": "", **({"check": "none yet", "band": _band(r.target)} if r.target is not None else {})}
        if self.enabled:
            self.bar.set_postfix(self.postfix)  # drawn now, not at the first refresh (a fast step may skip it)

    def step(self, loss: torch.Tensor) -> None:
        self.steps += 1
        if not torch.isfinite(loss.detach()).all():
            raise WarmStartError(
                f"warm start: the loss is {loss.item()} at step {self.steps}: the weights are no longer finite, and "
                f"no later step can make them so; with model.dtype=float16 (no loss scaling) use float32 or bfloat16, "
                f"else a lower model.warm_start_lr (now {self.recipe.lr:g})")
        if self.enabled:
            self.postfix["loss"] = f"{loss.item():.3f}"
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(1)

    def check(self, step: int, accuracy: float) -> None:
        if self.enabled:
            self.postfix["check"] = f"{accuracy:.3f} at step {step}"
            self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _reached(sidecar: dict) -> str:
    """``50 steps, check accuracy 0.094``: what a warm start's sidecar says it reached."""
    accuracy = sidecar.get("accuracy")
    return f"{sidecar['steps']} steps" + (f", check accuracy {accuracy:.3f}" if accuracy is not None else "")


def _band(target: tuple[float, float]) -> str:
    return f"[{target[0]:.2f}, {target[1]:.2f}]"


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, recipe: WarmStartRecipe,
               cache_key_extra: str = "", progress: bool = False) -> tuple[PreTrainedModel, dict]:
    """Supervised fine-tuning on the task's reference solutions, so that RL starts from a policy that solves
    some problems. Returns ``(model, sidecar)``: ``model`` updated in place, in eval mode, and the cache
    sidecar (a dict, see below).

    Each step samples ``recipe.batch_size`` problems (``random.Random(seed)``) from the train problems, builds
    ``build_prompt(question)`` + ``solution`` + EOS and minimises the token-mean cross-entropy on the
    completion tokens only, with AdamW at a constant ``lr``.

    ``target=None``: exactly ``max_steps`` steps. ``target=(low, high)``: the first ``check_size`` train
    problems are held out as a check set (never trained on, nor is any train problem with the same
    question); every ``check_every`` steps (and at ``max_steps``) the greedy accuracy on it is measured
    and training stops at the first check with ``low <= acc <= high``. A check above ``high``, or
    ``max_steps`` reached below ``low``, raises :class:`WarmStartError` and records the miss in the cache
    (``<key>.missed.json``: its error, settings, wall time): a later call with the same key raises it again at once
    instead of training to the same miss (a sweep's or the zoo's starting policies are prepared in processes of their
    own, which would each pay the cap again). The batch stream is the same
    whatever the checks find, so a given step count always gives the same weights.

    The result is cached under ``cache_dir()/warm_start`` as ``<key>.safetensors`` and the JSON sidecar
    ``<key>.json`` (steps taken, check accuracy reached, every check's accuracy, the settings, wall time,
    torch threads, library versions, the CPU it was built on, build time, the weights' digest). ``key`` hashes the
    model (config and a sample of its weights), the tokenizer, the task, the settings, ``cache_key_extra``,
    :data:`WARM_START_RECIPE` and the source code of the training functions, so a change to that code invalidates the
    cache. The key names what the policy is built from, not what the build gave: another CPU rounds otherwise and can
    stop at another step with other weights (docs/loop.md, "The starting policy"). So the returned record also holds
    ``weights_sha256``, the digest of the weights the run starts from (computed on every load: a cached file whose
    weights differ from its sidecar's digest is an error), and a starting policy is its key and that digest
    (analysis/load.py): runs whose policies were built apart on two CPUs are never pooled as seeds of one.

    ``progress``: say on stderr whether the policy was loaded or is built and where it is cached, with a progress
    bar while it builds (:class:`WarmStartProgress`).
    """
    settings = _settings(recipe)
    version = {"recipe": WARM_START_RECIPE, "recipe_source_hash": RECIPE_SOURCE_HASH,
               "matmul": resolve(WARM_START_MATMUL), "torch_threads": WARM_START_THREADS}
    key = _warm_start_key(model, tokenizer, task, [settings, version, cache_key_extra])
    folder = cache_dir() / "warm_start"
    weights = folder / f"{key}.safetensors"
    report = WarmStartProgress(recipe, weights, progress)
    cached = _cached(model, weights, folder / f"{key}{MISSED_SUFFIX}", report)
    if cached is not None:
        return model.eval(), cached
    start = time.perf_counter()
    built = {"key": key, **version, **settings, "torch_version": torch.__version__,
             "transformers_version": transformers.__version__, "cpu": cpu(),
             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        step, checks = _build(model, tokenizer, task, recipe, report)
    except WarmStartError as e:  # recorded: the same recipe would train to the same miss
        record = {**built, "error": str(e), "wall_time_s": round(time.perf_counter() - start, 2),
                  "built_at": datetime.now(UTC).isoformat(timespec="seconds")}
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / f"{key}{MISSED_SUFFIX}", record)
        raise
    sidecar = {
        **built, "steps": step, "accuracy": checks.get(step), "checks": checks,
        "wall_time_s": round(time.perf_counter() - start, 2),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"), "weights_sha256": weights_digest(model),
    }
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(weights, lambda name: save_safetensors(model, name))
    _write_json(weights.with_suffix(".json"), sidecar)
    log.info("warm start: %d steps in %.1f s, cached at %s", step, sidecar["wall_time_s"], weights)
    report.built(sidecar)
    return model, json.loads(json.dumps(sidecar))  # as a cache hit returns it (string step keys)


def builds_since(when: datetime) -> tuple[int, int]:
    """How many starting policies were built into the cache from ``when`` on, by any process that shares the cache
    (their sidecars' ``built_at``, to the second: a build that ended in ``when``'s second counts), and how many of
    those builds missed their band (``<key>.missed.json``). A file without a time with its zone is not a sidecar."""
    built = missed = 0
    for path in (cache_dir() / "warm_start").glob("*.json"):
        try:
            at = datetime.fromisoformat(json.loads(path.read_text())["built_at"])
            new = at >= when.replace(microsecond=0)  # TypeError: a time without its zone
        except (OSError, ValueError, TypeError, KeyError):  # another file, or one being written
            continue
        built += new
        missed += new and path.name.endswith(MISSED_SUFFIX)
    return built, missed


def _settings(recipe: WarmStartRecipe) -> dict:
    """The recipe's settings as the cache key and the sidecar hold them (the check's only with a target)."""
    target = recipe.target
    if target is not None and not 0.0 <= target[0] <= target[1] <= 1.0:
        raise ValueError(f"warm start target must be (low, high) with 0 <= low <= high <= 1, got {target!r}")
    checked = target is not None
    return {
        "max_steps": recipe.max_steps, "lr": recipe.lr, "batch_size": recipe.batch_size, "seed": recipe.seed,
        "target": list(target) if checked else None,
        "check_every": recipe.check_every if checked else None, "check_size": recipe.check_size if checked else None,
    }


def _cached(model, weights: Path, missed: Path, report: WarmStartProgress) -> dict | None:
    """The sidecar of the cached policy ``weights``, loaded into ``model``; None when there is none to load; a
    recorded miss (``missed``) raised again as the WarmStartError it was."""
    sidecar_path = weights.with_suffix(".json")
    if weights.is_file() and sidecar_path.is_file():
        load_safetensors(model, weights, device=str(model.device))
        sidecar = json.loads(sidecar_path.read_text())
        sidecar["weights_sha256"] = _checked_digest(model, sidecar, weights)
        report.loaded(sidecar)
        return sidecar
    if missed.is_file():
        record = json.loads(missed.read_text())
        raise WarmStartError(f"{record['error']} (recorded in {missed} when this policy was built, "
                             f"{record['built_at']}; remove that file to build it again)")
    return None


def _build(model, tokenizer, task: Task, recipe: WarmStartRecipe,
           report: WarmStartProgress) -> tuple[int, dict[int, float]]:
    """:func:`_train` at the warm start's own thread count and kernel, whatever the caller's; the progress bar shown
    while it trains and closed however it ends."""
    report.building()
    try:
        with fixed_threads(WARM_START_THREADS), cpu_matmul(WARM_START_MATMUL):
            return _train(model, tokenizer, task, recipe, report)
    finally:
        report.close()


def weights_digest(model) -> str:
    """The first 16 hex digits of the sha256 of ``model``'s weights (harness.run.provenance.tensors_digest)."""
    return tensors_digest(model.state_dict())[:16]


def load_safetensors(model, weights: Path, device: str) -> None:
    """Load a cached starting policy's ``weights`` into ``model`` (safetensors' load_model), after reading its .json
    sidecar: a cache file that cannot be read (cut short, overwritten, another model's) is a ConfigError naming it
    and what to do, not the parser's error."""
    try:
        if not isinstance(json.loads(weights.with_suffix(".json").read_text()), dict):
            raise ValueError(f"{weights.with_suffix('.json').name} is not a JSON object")
        load_model(model, weights, device=device)
    except torch.OutOfMemoryError:
        raise  # the device's memory, not the file
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # JSON's and UTF-8's errors are ValueErrors;
        # RuntimeError: another model's names or shapes
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"the cached starting policy {weights} or its .json sidecar cannot be read "
                          f"({type(e).__name__}: {reason}); remove both, and the next run builds it again") from None


def _checked_digest(model, sidecar: dict, weights: Path) -> str:
    """The digest of the weights just loaded from ``weights``; a ConfigError when their ``sidecar`` records another
    (the file changed after it was built). A sidecar from before the digest was recorded is taken as it is."""
    digest, recorded = weights_digest(model), sidecar.get("weights_sha256")
    if recorded is not None and recorded != digest:
        raise ConfigError(f"the cached starting policy {weights} has weights of digest {digest}, its sidecar records "
                          f"{recorded}: the file changed after it was built; remove it and its .json sidecar, and "
                          "the next run builds it again")
    return digest


def _train(model, tokenizer, task: Task, recipe: WarmStartRecipe,
           report: WarmStartProgress) -> tuple[int, dict[int, float]]:
    """The warm start's training (:func:`warm_start`'s docstring): the steps taken and each check's accuracy; the
    model is left in eval mode. ``report`` is told each step's loss and each check's accuracy."""
    r, target = recipe, recipe.target
    max_steps, check_every, checked = r.max_steps, r.check_every, target is not None
    problems = list(task.train_problems())
    check_set = problems[: r.check_size] if checked else []
    held_out = {problem.question for problem in check_set}
    pool = [problem for problem in problems[len(check_set):] if problem.question not in held_out]
    if not pool:
        raise ValueError(f"no train problems left for the warm start after holding out {len(check_set)}")
    rng = random.Random(r.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=r.lr)
    checks: dict[int, float] = {}
    model.train()
    step = 0
    while step < max_steps:
        batch = [pool[rng.randrange(len(pool))] for _ in range(r.batch_size)]
        loss = model(**_supervised_batch(tokenizer, batch, model.device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        report.step(loss)
        if step % 50 == 0:
            log.info("warm start step %d/%d loss %.4f", step, max_steps, loss.item())
        if checked and (step % check_every == 0 or step == max_steps):
            checks[step] = _check_accuracy(model, tokenizer, task, check_set)
            report.check(step, checks[step])
            log.info("warm start step %d: check accuracy %.3f (target %s)", step, checks[step], target)
            if checks[step] > target[1]:
                raise WarmStartError(
                    f"warm start overshot its target band [{target[0]:.2f}, {target[1]:.2f}]: check accuracy "
                    f"{_history(checks)}; lower check_every or lr, or widen the band")
            if checks[step] >= target[0]:
                break
    if checked and checks[step] < target[0]:
        raise WarmStartError(
            f"warm start reached max_steps={max_steps} below its target band [{target[0]:.2f}, {target[1]:.2f}]: "
            f"check accuracy {_history(checks)}; raise max_steps or lr, or lower the band")
    model.eval()
    return step, checks


def _check_accuracy(model, tokenizer, task: Task, problems) -> float:
    """Greedy accuracy on ``problems`` (chunks of :data:`CHECK_CHUNK`, at most the longest solution + EOS new
    tokens, the sampler's defaults); the model's train/eval mode is restored."""
    max_new_tokens = 1 + max(len(tokenizer(p.solution, add_special_tokens=False).input_ids) for p in problems)
    was_training = model.training
    model.eval()
    correct = 0.0
    with torch.no_grad():
        for i in range(0, len(problems), CHECK_CHUNK):
            chunk = problems[i : i + CHECK_CHUNK]
            texts = sample_problems(model, tokenizer, chunk, max_new_tokens=max_new_tokens, greedy=True).texts
            correct += sum(task.score(text, problem).correct for text, problem in zip(texts, chunk, strict=True))
    model.train(was_training)
    return correct / len(problems)


def _history(checks: dict[int, float]) -> str:
    """The last few checks as ``0.12 at step 100, 0.50 at step 150``."""
    return ", ".join(f"{acc:.2f} at step {step}" for step, acc in list(checks.items())[-4:])


def _recipe_source_hash() -> str:
    """Hash of the source code of the functions that train the warm start (not of the caching around them: an edit
    there leaves the cached policies as they are)."""
    source = "".join(inspect.getsource(f) for f in (_build, _train, _supervised_batch, _check_accuracy))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _write_atomic(path: Path, write) -> None:
    """``write(temp_name)`` to a temporary file of this process's own beside ``path``, then renamed to ``path``
    (harness.run.atomic.atomic_write; other processes may write the same cache file meanwhile)."""
    atomic_write(path, write=lambda tmp: write(str(tmp)), shared=True)


def _write_json(path: Path, record: dict) -> None:
    _write_atomic(path, lambda name: Path(name).write_text(json.dumps(record, indent=1) + "\n"))


def _supervised_batch(tokenizer, problems, device) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    rows = []
    for problem in problems:
        prompt = tokenizer(build_prompt(tokenizer, problem.question), add_special_tokens=False).input_ids
        completion = tokenizer(problem.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    width = max(len(ids) for ids, _ in rows)
    pad = [tokenizer.pad_token_id]
    input_ids = torch.tensor([ids + pad * (width - len(ids)) for ids, _ in rows], device=device)
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows], device=device)
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows], device=device)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _warm_start_key(model, tokenizer, task: Task, settings: list) -> str:
    """Hash of everything the warm-started weights depend on (weights sampled: fast even for 135M params)."""
    digest = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype"):  # dtype: the actual one is hashed
        config.pop(volatile, None)
    content = [
        config,
        str(model.dtype),
        sorted(tokenizer.get_vocab().items()),
        tokenizer.chat_template,
        task.name,
        {k: v for k, v in task.config().items() if k not in NOT_IN_KEY},
    ]
    digest.update(json.dumps(content + settings, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256]
        digest.update(name.encode() + sample.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


# taken when the module is imported: the code this process runs (read later, an edit of this file made meanwhile
# would be read at the old line numbers and give a spurious key)
RECIPE_SOURCE_HASH = _recipe_source_hash()
