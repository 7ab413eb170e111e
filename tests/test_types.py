"""The type checker runs with the tests: mypy in strict mode over what its configuration names (pyproject.toml,
``[tool.mypy]`` ``files``: protocol/, trainer/ and peer/), so the annotations are checked, not promises. It keeps its
cache in .mypy_cache/ at the repository root: a run after the first rechecks only what changed (docs/layout.md, "Type
checking")."""

from __future__ import annotations

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
