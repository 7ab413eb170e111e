"""The type checker runs with the tests: mypy in strict mode over what its configuration names (pyproject.toml,
``[tool.mypy]`` ``files``: protocol/, trainer/ and peer/), so the annotations are checked, not promises. It keeps its
cache in .mypy_cache/ at the repository root: a run after the first rechecks only what changed (docs/layout.md, "Type
checking")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_error():
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


MAX_ANY_IN_PEER = 60
"""``Any`` in peer/'s annotations outside ``dict[str, Any]`` (decoded JSON and msgpack): JSON-shaped values, and
callables run for any result; anything else has a type to name (docs/layout.md, "Type checking")."""


def any_outside_json(source: str) -> int:
    """How many ``Any`` names the code of ``source`` uses, ``dict[str, Any]`` not counted (nor imports: not names)."""
    tree = ast.parse(source)
    json_any = {id(node.slice.elts[1]) for node in ast.walk(tree)
                if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "dict"
                and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2
                and all(isinstance(e, ast.Name) for e in node.slice.elts)
                and [e.id for e in node.slice.elts if isinstance(e, ast.Name)] == ["str", "Any"]}
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "Any"
               and id(node) not in json_any)


def test_any_stays_rare_in_peer():
    counts = {str(p.relative_to(ROOT)): any_outside_json(p.read_text()) for p in sorted((ROOT / "peer").rglob("*.py"))}
    assert sum(counts.values()) <= MAX_ANY_IN_PEER, {p: n for p, n in counts.items() if n}
    assert any_outside_json("from typing import Any\nx: dict[str, Any] = {}\ny: list[Any] = []\n") == 1
