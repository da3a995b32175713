"""A run stopped as a kill would stop it: after step ``k``'s checkpoint, before step ``k + 1`` is written (both
backends write a step's metrics row before its checkpoint, so raising in the row's write of step ``k + 1`` leaves
exactly step ``k``'s checkpoint and rows)."""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest

from harness.run.records import RunRecords


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
