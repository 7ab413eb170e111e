"""The house rules of the source tree: imports flow protocol <- trainer <- peer, and no module imports itself back.

Every import counts, module-level or inside a function: a lazy import hides a cycle from the interpreter, not from a
reader. Edges to a module's own ancestor packages are ignored (their ``__init__`` holds only a docstring).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "trainer", "peer")
#: which of our packages each package may import
ALLOWED = {"protocol": {"protocol"}, "trainer": {"protocol", "trainer"}, "peer": {"protocol", "trainer", "peer"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``path`` imports (``from a.b import c`` counts as a.b.c when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in PACKAGES)
    return out


def graph() -> dict[str, set[str]]:
    modules = our_modules()
    g = {}
    for name, path in modules.items():
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        g[name] = {m for m in imports_of(path, modules) if m != name and m not in ancestors}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_flow_protocol_to_trainer_to_peer() -> None:
    wrong = [f"{src} imports {dst}" for src, deps in graph().items() for dst in deps
             if dst.split(".")[0] not in ALLOWED[src.split(".")[0]]]
    assert wrong == []


def test_every_package_says_what_it_owns() -> None:
    silent = [str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")
              if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert silent == []
