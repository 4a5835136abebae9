"""The package's layering: every import points down the stack or within its own package, and nothing cycles.

Deferred imports (inside functions) count like any other: a cycle hidden in a function is still a cycle.
Third-party imports are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "spechead"
# bottom to top: a module may import from its own layer's package or from any layer below it
LAYERS = [
    {"errors", "cache", "timing"},
    {"kernels"},
    {"model"},
    {"heads"},
    {"decoding"},
    {"options"},  # the checks of user-facing options, shared by the API, the CLI and the server
    {"training"},
    {"tuning"},
    {"bench"},
    {"serve"},
    {"integrations"},  # other engines' plugins (vLLM): nothing below imports them
    {"api"},  # the Python API
    {"cli"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_in(source: str, package: str) -> set[str]:
    """Every project module a source file imports, anywhere in it (``from pkg import sub`` names the submodule;
    relative imports are resolved against ``package``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "spechead"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "spechead":
                continue
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES}


def imported_modules(name: str) -> set[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(), package) - {name}


GRAPH = {name: imported_modules(name) for name in MODULES}


def layer_of(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:  # spechead/__init__.py: the top, it may name anything
        return len(LAYERS)
    return next(i for i, group in enumerate(LAYERS) if parts[1] in group)


def test_every_module_has_a_layer():
    for name in MODULES:
        assert name == "spechead" or name.split(".")[1] in set().union(*LAYERS), f"{name} is in no layer"


def test_imports_point_down():
    upward = {name: sorted(m for m in GRAPH[name] if layer_of(m) > layer_of(name)) for name in sorted(MODULES)}
    upward = {name: mods for name, mods in upward.items() if mods}
    assert not upward, f"modules importing from a layer above them: {upward}"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_the_checker_sees_deferred_relative_and_package_imports():
    """The parser must count an import inside a function, resolve relative imports and ``from pkg import sub``."""
    source = (
        "import torch\n"
        "from spechead.heads import lowrank\n"
        "from .base import DraftHead\n"
        "def f():\n"
        "    from spechead.decoding.session import Session\n"
        "    import spechead.bench\n"
    )
    found = imports_in(source, "spechead.heads")
    assert found == {"spechead.heads.lowrank", "spechead.heads.base", "spechead.decoding.session", "spechead.bench"}
    assert layer_of("spechead.decoding.session") > layer_of("spechead.heads.base")
