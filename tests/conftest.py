"""Shared fixtures: the local GSM8K copy, a tiny model and tokenizer, a private cache directory.

Nothing heavy is imported at module level: pytest-xdist's controller process loads this file too, and with torch
and transformers imported here it would spend seconds before starting the workers that import them again."""

from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def config_checks():
    """Every component's config check registered (harness/run/checks.py), as the entry points have them: a test may
    validate a config without importing an app."""
    import harness.apps  # noqa: F401


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """../shared/data/gsm8k relative to the repository (never committed); tests using it skip without it."""
    path = REPO.parent / "shared" / "data" / "gsm8k"
    if not (path / "train.jsonl").is_file():
        pytest.skip(f"no local GSM8K copy at {path}")
    return path


@pytest.fixture
def tiny_model():
    """A small randomly initialised char-level Llama (hidden 32, 2 layers) and its tokenizer."""
    from harness.policy.models import load_model
    from tests.helpers.tiny import TINY_SPEC

    return load_model("tiny", tiny=TINY_SPEC)


@pytest.fixture(scope="module")
def fixed():
    """The TRL tests' fixed rollout batch of the tiny model (tests/helpers/trl.py), one per test module."""
    from tests.helpers.trl import fixed_batch

    return fixed_batch()


@pytest.fixture
def rlvr_cache(tmp_path) -> Path:
    """An empty ``RLVR_CACHE`` for this test, set apart from the test's own ``monkeypatch``: its ``undo()`` leaves it
    set (with the test's monkeypatch, a test that undid its patches built its later policies in the user's cache)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
        yield tmp_path / "cache"


def pytest_collection_modifyitems(config, items):
    """The files with the most end-to-end (slow) tests first, each file's tests in their order. `make test` hands
    whole files to its workers in this order (--dist loadfile --no-loadscope-reorder): the long files start first
    and the many short ones fill the end, so no worker waits alone on a long file at the end. A file's count of slow
    tests stands for its length (the longest first balances the workers best), without a record of past times."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # a stable sort: each file's tests stay together, in their order
