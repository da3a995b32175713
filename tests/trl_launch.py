"""``python tests/trl_launch.py train ...`` = ``python -m harness train ...`` for tests/test_trl_distributed.py, run
alone or by ``accelerate launch``, with two test-only instruments:

- ``RLVR_TEST_ROW_SEEDS=1``: every sampled completion is drawn from its own seed (the rollout step and the row's
  place in the global generation batch), so the draws do not depend on how the batch is split over processes.
  TRL samples each process's share with that process's torch RNG, so a 2-process run draws other completions than
  a 1-process run (as any DDP sampler does); with these draws the two see the same rollouts and their updates can be
  compared number for number.
- ``RLVR_TEST_WRITES=<folder>``: every file or folder this process creates, opens for writing, renames, truncates
  or removes under the run folder is appended to ``<folder>/writes.<RANK>.txt``: Python's audit events, and the
  paths given to ``torch.save`` and safetensors' ``save_file`` (which write from C++ / Rust, unseen by the hooks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RANK = int(os.environ.get("RANK", "0"))


def row_seeded_generate(patch=setattr) -> None:
    """Installs the row-seeded draws (``patch``: how to set an attribute; a MonkeyPatch's setattr undoes them)."""
    import torch
    from transformers.generation.utils import GenerationMixin

    import harness.loop.trl_backend as trl_backend

    state = {"step": 0}
    original_rollout = trl_backend.RegistryGRPOTrainer._generate_and_score_completions

    def rollout(self, inputs):
        state["step"] = self.state.global_step
        return original_rollout(self, inputs)

    original_generate = GenerationMixin.generate

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        if generation_config is None or not generation_config.do_sample:
            return original_generate(self, input_ids=input_ids, attention_mask=attention_mask,
                                     generation_config=generation_config, **kwargs)
        rows, pad = [], generation_config.pad_token_id
        for i in range(input_ids.size(0)):  # each row alone, without its padding, from its own seed
            keep = attention_mask[i].bool()
            with torch.random.fork_rng():
                torch.manual_seed(1_000_003 * state["step"] + RANK * input_ids.size(0) + i)
                out = original_generate(self, input_ids=input_ids[i][keep][None], attention_mask=None,
                                        generation_config=generation_config, **kwargs)[0]
            rows.append(torch.cat([input_ids[i][~keep], out]))  # the left padding back: TRL cuts at its width
        width = max(len(r) for r in rows)
        return torch.stack([torch.cat([r, r.new_full((width - len(r),), pad)]) for r in rows])

    patch(trl_backend.RegistryGRPOTrainer, "_generate_and_score_completions", rollout)
    patch(GenerationMixin, "generate", generate)


def record_writes(run_dir: str, log: Path) -> None:
    root = os.path.realpath(run_dir)
    writes = open(log, "a", buffering=1)
    flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path) -> str | None:
        if isinstance(path, int | type(None)):
            return None
        path = os.path.realpath(os.fsdecode(path))
        return path if path.startswith(root) else None

    def hook(event, args):
        paths = []
        if event == "open" and ((args[1] and any(c in str(args[1]) for c in "wax+")) or (args[2] or 0) & flags):
            paths = [args[0]]
        elif event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.truncate", "shutil.rmtree"):
            paths = list(args[:2]) if event == "os.rename" else [args[0]]
        for path in filter(None, map(inside, paths)):
            writes.write(f"{event} {path}\n")

    sys.addaudithook(hook)

    import safetensors.torch
    import torch
    import transformers.modeling_utils

    def logged(name, save):
        def wrapper(obj, path, *args, **kwargs):
            inner = inside(path) if isinstance(path, str | os.PathLike) else None
            if inner:
                writes.write(f"{name} {inner}\n")
            return save(obj, path, *args, **kwargs)

        return wrapper

    torch.save = logged("torch.save", torch.save)
    safetensors.torch.save_file = logged("safetensors", safetensors.torch.save_file)
    transformers.modeling_utils.safe_save_file = logged("safetensors", transformers.modeling_utils.safe_save_file)


if __name__ == "__main__":
    if os.environ.get("RLVR_TEST_ROW_SEEDS"):
        row_seeded_generate()
    if os.environ.get("RLVR_TEST_WRITES"):
        record_writes(sys.argv[sys.argv.index("--run-dir") + 1],
                      Path(os.environ["RLVR_TEST_WRITES"]) / f"writes.{RANK}.txt")
    from harness.__main__ import main

    sys.exit(main(sys.argv[1:]))
