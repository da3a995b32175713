"""Golden metrics: short tiny-model runs whose every logged value a restructuring must leave bit-identical.

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_golden           # rewrite tests/golden/golden.json
    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_golden --check   # run again, compare, write nothing

Each entry of :data:`RUNS` is one run (native loop, TRL backend, or the gradient lab) of the tiny test model on
one-digit arithmetic after a short supervised warm start (so rewards vary and every update moves the policy), one
torch thread, every setting written out (never ``threads=0``: it follows the machine's load). What is kept of a run:
every metrics.jsonl value except time and memory (:data:`TIMING_METRICS`), every eval sample, and a digest of the
final weights (a lab: its table and position rows and a digest of its gradient sketches).

tests/test_equivalence.py reruns them and requires exact float equality. Float results depend on the CPU (its
instruction set, and its make: an AMD EPYC and a Xeon, both AVX512, round otherwise) and on the torch / transformers /
trl builds, so the file holds one entry per build (:func:`build`):
``{"goldens": [{"build": {...}, "runs": {...}}, ...]}``; the test uses the entry of the build it runs on and skips,
naming the builds it has, on another: add that build's entry from a commit you trust
(``git worktree add /tmp/base <commit>`` and run this module there with ``PYTHONPATH=/tmp/base``, then copy
its entry over), then check the new code against it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from harness.run.provenance import cpu
from harness.run.provenance import tensors_digest as digest

GOLDEN = Path(__file__).resolve().parent / "golden.json"

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=64"]
# every run: a warm-started tiny model (rewards that vary), one-digit sums, 4 prompts x 4 samples, 3 steps with an
# evaluation at steps 0, 2 and 3, one torch thread
COMMON = [*TINY, "device=cpu", "threads=1", "seed=0", "task.name=arith", "task.args.digits=1", "task.eval_size=8",
          "task.format_weight=0.5", "model.warm_start_steps=100", "model.warm_start_lr=1e-2",
          "model.warm_start_batch_size=32", "train.prompts_per_step=4", "train.group_size=4",
          "train.max_new_tokens=16", "train.num_minibatches=2", "train.steps=3", "train.eval_every=2",
          "train.lr=1e-3"]

# name -> (kind, overrides): what each run reaches is in its name
RUNS: dict[str, tuple[str, list[str]]] = {
    "native_grpo_kl_epochs_warmup_passk": ("native", [
        "objective.name=grpo", "objective.params.beta=0.04", "train.epochs=2", "train.warmup_steps=1",
        "train.pass_k=2"]),
    "native_gspo_micro_ungrouped_order_padded": ("native", [  # minibatches of 4 rows < a group of 8: shuffled rows
        "objective.name=gspo", "train.prompts_per_step=2", "train.group_size=8", "train.num_minibatches=4",
        "train.micro_batch_size=2", "train.epochs=2", "train.padding_free=false"]),
    "native_ctpo_recompute_cache_decoder": ("native", [
        "objective.name=ctpo", "train.old_logp=recompute", "train.decoder=cache"]),
    "native_p3o_microbatch_statistics": ("native", [
        "objective.name=p3o", "train.micro_batch_size=4", "train.epochs=2"]),
    "native_cispo_bf16_sampler_token_truncate": ("native", [
        "objective.name=cispo", "model.sampler_dtype=bfloat16", "train.rollout_correction.mode=token_truncate"]),
    "native_gspo_token_bf16_sequence_mask_per_row": ("native", [
        "objective.name=gspo_token", "model.sampler_dtype=bfloat16", "train.rollout_correction.mode=sequence_mask",
        "train.rollout_correction.threshold=1.5", "train.decoder=per_row"]),
    "native_tbpo_bf16_sampler_recompute": ("native", [  # the sampler's log-probs reach the objective
        "objective.name=tbpo", "model.sampler_dtype=bfloat16", "train.old_logp=recompute"]),
    "native_cispo_bf16_sampler_mismatch": ("native", [  # the sampler's log-probs as behaviour: mismatch metrics
        "objective.name=cispo", "model.sampler_dtype=bfloat16", "train.micro_batch_size=4"]),
    "native_dapo_dynamic_sampling_overlong_hf": ("native", [
        "objective.name=dapo", "train.dynamic_sampling=true", "train.max_sampling_rounds=3",
        "task.overlong_buffer=4", "train.sampler=hf"]),
    "native_conspo_whole_groups": ("native", [
        "objective.name=conspo", "train.num_minibatches=1", "train.micro_batch_size=8"]),
    "trl_grpo_kl_micro": ("trl", [
        "backend=trl", "objective.name=grpo", "objective.params.beta=0.04", "train.micro_batch_size=4",
        "train.steps=2"]),
    "trl_gspo_rollout_correction": ("trl", [
        "backend=trl", "objective.name=gspo", "train.rollout_correction.mode=token_truncate", "train.steps=2",
        "train.epochs=2"]),
    "trl_p3o_minibatch_statistics": ("trl", [
        "backend=trl", "objective.name=p3o", "train.micro_batch_size=4", "train.steps=2"]),
    "lab_staleness_and_bf16": ("lab", [
        "name=goldenlab", "lab.objectives=[grpo,gspo,p3o,cispo]", "lab.batches=2", "lab.staleness=[0,1]",
        "lab.mismatch=[bfloat16]", "lab.reference_samples=2"]),
}


def build() -> dict:
    """What the floats depend on besides the code: the libraries, the CPU's vector instructions and the CPU itself
    (two CPUs with the same instructions can round otherwise: their BLAS kernels differ)."""
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            "python": platform.python_version(), "cpu": cpu()}


def _config(overrides: list[str], results: Path):
    import harness.apps  # noqa: F401  (every component's config checks, as `python -m harness` registers them)
    from harness.run.config import load_experiment, run_configs

    cfg = load_experiment("base", [*COMMON, *overrides, f"results_dir={results}"])
    return cfg, run_configs(cfg)[0]


def run_one(name: str, workdir: Path) -> dict:
    """Run ``RUNS[name]`` under ``workdir``; what the goldens keep of it (JSON-ready)."""
    from safetensors.torch import load_file

    from harness.run.records import TIMING_METRICS, read_jsonl

    kind, overrides = RUNS[name]
    cfg, run = _config(overrides, workdir / "results")
    if kind == "lab":
        from harness.apps.lab import run_lab

        folder = run_lab(cfg, progress=False)
        batches = [torch.load(p, weights_only=False) for p in sorted((folder / "batches").glob("*.pt"))]
        return {"rows": [b["rows"] for b in batches], "positions": [b["positions"] for b in batches],
                "sketches": digest({f"{i}/{point}/{objective}": sketch for i, b in enumerate(batches)
                                    for point, by_objective in b["sketches"].items()
                                    for objective, sketch in by_objective.items()}),
                "references": digest({f"{i}/{k}": v for i, b in enumerate(batches)
                                      for k, v in b["references"].items()})}
    run_dir = workdir / name
    if kind == "trl":
        from harness.loop.trl_backend import train_trl as train
    else:
        from harness.loop.native import train
    summary = train(run, run_dir, progress=False)
    assert summary["status"] == "finished", summary
    metrics = [{k: v for k, v in row.items() if k not in TIMING_METRICS}
               for row in read_jsonl(run_dir / "metrics.jsonl")]
    return {"metrics": metrics, "eval_samples": read_jsonl(run_dir / "eval_samples.jsonl"),
            "final_weights": digest(load_file(run_dir / "final" / "model.safetensors"))}


def compared(entry: dict, name: str, run: dict) -> dict:
    """What of ``run`` (``run_one``'s output, or the entry's record of it) is compared with the entry: all of it, less
    the metrics the entry marks stale for that run (``entry["stale"][name]``: metrics whose definition changed after
    the entry was made, which only a session on its build can record again; ``entry["stale_why"]`` says what
    changed). Every other value of the run is still compared bit for bit."""
    stale = set(entry.get("stale", {}).get(name, ()))
    if not stale or "metrics" not in run:
        return run
    return {**run, "metrics": [{k: v for k, v in row.items() if k not in stale} for row in run["metrics"]]}


def load_goldens() -> list[dict]:
    """golden.json's entries, one per build."""
    return json.loads(GOLDEN.read_text())["goldens"] if GOLDEN.exists() else []


def build_entry(goldens: list[dict], here: dict) -> dict:
    """The entry made on the build ``here`` (an empty one when there is none). An entry whose ``cpu`` names only a
    vendor (the first entries, made on Intel Xeons before the CPU was recorded) holds for that vendor's CPUs."""
    def same(made: dict) -> bool:
        rest = {k: v for k, v in made.items() if k != "cpu"}
        return rest == {k: v for k, v in here.items() if k != "cpu"} and \
            (here.get("cpu", "") == made.get("cpu") or here.get("cpu", "").startswith(f"{made.get('cpu')} family"))

    return next((g for g in goldens if same(g["build"])), {"build": here, "runs": {}})


def fresh_cache() -> tempfile.TemporaryDirectory:
    """An empty RLVR_CACHE for the whole process, so that the warm start runs here (its code is covered too)."""
    folder = tempfile.TemporaryDirectory(prefix="golden-cache-")
    os.environ["RLVR_CACHE"] = folder.name
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with golden.json instead of writing it")
    parser.add_argument("names", nargs="*", help="runs to make (default: all)")
    args = parser.parse_args(argv)
    cache = fresh_cache()
    golden = build_entry(load_goldens(), build())
    found, differ = {}, []
    with tempfile.TemporaryDirectory(prefix="golden-") as work:
        for name in args.names or RUNS:
            found[name] = json.loads(json.dumps(run_one(name, Path(work) / name)))  # as the file will hold it
            want = compared(golden, name, golden["runs"].get(name, {}))
            if args.check and compared(golden, name, found[name]) != want:
                differ.append(name)
            print(f"{name}: {'differs' if name in differ else 'done'}", file=sys.stderr)
    cache.cleanup()
    if args.check:
        print(f"{len(found) - len(differ)}/{len(found)} runs equal the goldens" +
              (f"; differ: {', '.join(differ)}" if differ else ""), file=sys.stderr)
        return 1 if differ else 0
    golden["runs"] = {**golden["runs"], **found} if args.names else found
    stale, why = golden.pop("stale", {}), golden.pop("stale_why", None)
    stale = {name: keys for name, keys in stale.items() if name not in found}  # the runs made now are whole again
    if stale:
        golden.update(stale=stale, stale_why=why)
    goldens = load_goldens()  # the entry replaced where it stands (a new build's appended): a diff shows the change
    where = next((i for i, g in enumerate(goldens) if g["build"] == golden["build"]), len(goldens))
    goldens[where:where + 1] = [golden]
    GOLDEN.write_text(json.dumps({"goldens": goldens}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
