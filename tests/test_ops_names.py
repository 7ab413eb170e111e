"""Every counter and refusal name the code counts under is registered (peer/ops/names.py), and exported from 0.

The source is read with ``ast``: a literal name passed to a counter (``metrics.inc("x")``, a guard's ``count``) must be
registered; an f-string name must match at least one registered name (its family is registered); a refusal reason
passed to the handlers' helpers (``_reject``, ``_refuse``, ``Refused``) is registered under its prefix. At run time the
tests run with ``names.STRICT`` (conftest.py), so a dynamic name that slips through raises where it is counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from peer.ops import names
from peer.ops.metrics import PeerMetrics
from peer.ops.prom import metric_name, prometheus_text

ROOT = Path(__file__).resolve().parent.parent
COUNTING_CALLS = {"inc", "count", "_count"}
# helper -> (argument index of the reason, prefix of its counter name)
REASON_CALLS = {"_reject": (0, "rejected:"), "Refused": (1, "rejected:avg_")}
REFUSE_PREFIX = {"peer/state/sync.py": (1, "rejected:state_"), "peer/pipeline/infer.py": (0, "rejected:infer_")}


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _pattern(node: ast.JoinedStr) -> re.Pattern[str]:
    parts = [re.escape(v.value) if isinstance(v, ast.Constant) else "[a-z_]+" for v in node.values]
    return re.compile("".join(parts) + "$")


def _used_names() -> list[tuple[str, int, str | re.Pattern[str]]]:
    """(file, line, name or pattern) of every name the code counts under."""
    found: list[tuple[str, int, str | re.Pattern[str]]] = []
    for path in sorted([*ROOT.glob("peer/**/*.py"), *ROOT.glob("protocol/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = _name(node)
            if fn in COUNTING_CALLS:
                index, prefix = 0, ""
                if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Constant):
                    continue  # "text".count(...)
            elif fn in REASON_CALLS:
                index, prefix = REASON_CALLS[fn]
            elif fn == "_refuse" and rel in REFUSE_PREFIX:
                index, prefix = REFUSE_PREFIX[rel]
            else:
                continue
            if len(node.args) <= index:
                continue
            arg = node.args[index]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((rel, node.lineno, prefix + arg.value))
            elif isinstance(arg, ast.JoinedStr):
                found.append((rel, node.lineno, _pattern(ast.JoinedStr(values=[ast.Constant(prefix), *arg.values]))))
    return found


def test_the_scan_sees_the_code():
    used = _used_names()
    literal = {n for _, _, n in used if isinstance(n, str)}
    assert {"tokens", "rejected:wrong_run", "rejected:avg_not_member", "rejected:state_bad_chunk"} <= literal
    assert any(not isinstance(n, str) for _, _, n in used)


def test_every_name_the_code_counts_under_is_registered():
    registered = [n for n in (*names.COUNTERS, *(names.REJECTED_PREFIX + r for r in names.REJECTIONS), *names.EVENTS)]
    missing = []
    for rel, line, name in _used_names():
        if isinstance(name, str):
            if not names.is_registered(name):
                missing.append(f"{rel}:{line}: {name}")
        elif not any(name.match(r) for r in registered):
            missing.append(f"{rel}:{line}: no registered name matches {name.pattern}")
    assert not missing, "register these in peer/ops/names.py:\n" + "\n".join(missing)


def test_an_unregistered_name_raises_in_the_tests_and_is_folded_in_a_peer(monkeypatch, caplog):
    m = PeerMetrics()
    with pytest.raises(ValueError, match="not registered"):
        m.inc("made_up_counter")
    monkeypatch.setattr(names, "STRICT", False)
    for round_no in range(100):  # a name built from what a peer sent must not grow the counters
        m.inc(f"rejected:avg_round {round_no} is over here")
    m.inc("made_up_counter")
    counters = m.snapshot()["counters"]
    assert counters.get("rejected:other") == 100 and counters.get("unregistered") == 1
    assert not [k for k in counters if "round" in k]


def test_every_registered_name_is_exported_from_zero():
    text = prometheus_text(PeerMetrics().snapshot())
    for counter in names.COUNTERS:
        assert re.search(rf"^{metric_name(counter)} 0(\.0)?$", text, re.M), counter
    for reason in names.REJECTIONS:
        assert f'asyncmesh_rejected_total{{reason="{reason}"}} 0.0' in text, reason
