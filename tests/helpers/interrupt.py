"""A run stopped as a kill would stop it: after step ``k``'s checkpoint, before step ``k + 1`` is written (both
backends write a step's metrics row before its checkpoint, so raising in the row's write of step ``k + 1`` leaves
exactly step ``k``'s checkpoint and rows)."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest

from harness.run.records import RunRecords, read_jsonl
from tests.helpers.tiny import without_timing


@contextmanager
def stopped_before(step: int):
    """Ctrl-C at the moment step ``step``'s metrics row would be written; the block must run the training."""
    original = RunRecords.log

    def log(self, row, eval_records=None):
        if row["step"] == step:
            raise KeyboardInterrupt
        return original(self, row, eval_records)

    with mock.patch.object(RunRecords, "log", log), pytest.raises(KeyboardInterrupt):
        yield


def full_and_resumed(train, run, folder, step: int) -> tuple[list[dict], list[dict]]:
    """``run`` trained uninterrupted into ``folder/full``, and into ``folder/part`` stopped before ``step`` then run
    again (a resume): both runs' metrics rows without timings."""
    train(run, folder / "full", progress=False)
    with stopped_before(step):
        train(run, folder / "part", progress=False)
    train(run, folder / "part", progress=False)
    return tuple(without_timing(read_jsonl(folder / name / "metrics.jsonl")) for name in ("full", "part"))
