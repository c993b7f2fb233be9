"""The package's layout holds: training's two rooms (scratch/ and conversion/) never import each other, and
no module imports, at its top level, a module that imports it back (directly or around a circle)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """cloverlm modules imported outside functions (what runs at import time); `from a import b` names
    a.b where that is a module."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names} & modules
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in (SRC / "cloverlm").rglob("*.py")}
    return {name: _top_level_imports(path, set(files)) for name, path in files.items()}


def test_the_two_training_rooms_do_not_import_each_other():
    every = {}
    for path in (SRC / "cloverlm" / "training").rglob("*.py"):
        text = path.read_text()
        every[_module(path)] = text
    for name, text in every.items():
        if ".training.scratch" in name:
            assert "cloverlm.training.conversion" not in text, name
        if ".training.conversion" in name:
            assert "cloverlm.training.scratch" not in text, name


def test_no_module_imports_in_a_circle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for child in graph.get(name, ()):
            if state.get(child) == 1:
                raise AssertionError(" -> ".join(trail[trail.index(child) :] + [child]) if child in trail else child)
            if child not in state:
                visit(child, trail + [child])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
