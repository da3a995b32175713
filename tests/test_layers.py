"""The house's rules, read from the code: every import (function-local ones included) points down the layers
apps -> analysis -> loop -> policy -> tasks -> run -> objectives, and no two modules import each other through any
chain (README "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# lowest first; a module may import its own layer or any below it
LAYERS = ("objectives", "harness.run", "harness.tasks", "harness.policy", "harness.loop", "analysis", "harness.apps",
          "harness.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    matches = [i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add its package to LAYERS"
    return matches[-1]


def house_imports() -> dict[str, set[str]]:
    """module -> the house modules it imports anywhere in its file (top level or inside a function)."""
    modules = {module_name(p): p for d in ("harness", "objectives", "analysis") for p in (ROOT / d).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from harness.policy import sampler``: the module sampler; ``from harness.run.config import X``
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules}
        graph[name] = found - {name}
    return graph


@pytest.mark.slow
def test_every_import_points_down_the_layers():
    upward = [f"{source} -> {target}" for source, targets in house_imports().items() for target in targets
              if layer(target) > layer(source) and not target.startswith(source + ".")]  # a package's face
    assert upward == []


@pytest.mark.slow
def test_no_import_circle():
    graph = house_imports()
    for package_face in [m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").exists()]:
        graph[package_face] = {t for t in graph[package_face] if not t.startswith(package_face + ".")}
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                pytest.fail("import circle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


@pytest.mark.slow
def test_the_config_layer_imports_nothing_above_it():
    graph = house_imports()
    assert {t for t in graph["harness.run.config"] if not t.startswith(("harness.run.", "objectives"))} == set()




def test_the_layout_names_every_package_and_module():
    """The map of the house: README "Layout" names every package of harness/, docs/layout.md (which it links) every
    module."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    assert "(docs/layout.md)" in layout
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "harness").rglob("__init__.py"))
    assert [p for p in packages if p != "harness" and f"{p}/" not in layout] == []
    files = (ROOT / "docs" / "layout.md").read_text()
    modules = sorted(p.name for p in (ROOT / "harness").rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in files] == []
