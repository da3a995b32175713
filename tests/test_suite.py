"""The suite's own rules: a ``pytest.mark`` sits on a test (a mark on a helper marks nothing, and an end-to-end test
whose ``slow`` mark slipped onto its helper runs in ``make test-fast``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def marks_off_tests(source: str) -> list[str]:
    """The functions and classes of ``source`` that carry a ``@pytest.mark...`` decorator but are no test (a function
    named test_..., a class named Test...)."""
    found, nodes = [], list(ast.parse(source).body)
    for node in nodes:  # the module's statements and its classes' (where pytest collects tests)
        if isinstance(node, ast.ClassDef):
            nodes += node.body
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        marked = any("pytest.mark." in ast.unparse(d) for d in node.decorator_list)
        test = node.name.startswith("Test" if isinstance(node, ast.ClassDef) else "test_")
        if marked and not test:
            found.append(f"{node.name} (line {node.lineno})")
    return found


def test_every_mark_sits_on_a_test():
    misplaced = {path.name: found for path in sorted(TESTS.rglob("*.py"))
                 if (found := marks_off_tests(path.read_text()))}
    assert not misplaced, f"pytest marks on functions that are no test (move them onto the test): {misplaced}"


def test_a_mark_on_a_helper_is_found():
    source = ("import pytest\n\n@pytest.mark.slow\ndef helper():\n    pass\n\n"
              "@pytest.mark.slow\ndef test_x():\n    pass\n\n"
              "class TestY:\n    @pytest.mark.slow\n    def test_z(self):\n        pass\n\n"
              "    @pytest.mark.slow\n    def helper(self):\n        pass\n")
    assert marks_off_tests(source) == ["helper (line 4)", "helper (line 17)"]
