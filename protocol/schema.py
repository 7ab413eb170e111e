"""Strict field checkers for protocol messages.

Each checker takes a value as it came from msgpack (or as a caller passed it) and returns the normalised value, or
raises `SchemaError` saying which field is wrong and why. Bounds are deliberately tight: nothing a peer sends may
make us allocate more than the framing layer already admitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from protocol.envelope import MAX_NDIM, TensorEnvelope

Check = Callable[[Any, str], Any]

MAX_NAME = 256  # run ids, peer ids, tensor names, route entries
MAX_TEXT = 4096  # error messages, string meta values
MAX_DTYPE_NAME = 16


class SchemaError(ValueError):
    """A message field has the wrong type or is out of bounds (a MalformedMessage when it came from the wire)."""


def _fail(where: str, what: str, value: Any) -> SchemaError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return SchemaError(f"{where} must be {what}, got {shown}")


def integer(lo: int, hi: int) -> Check:
    def check(v: Any, where: str) -> int:
        if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
            raise _fail(where, f"an int in [{lo}, {hi}]", v)
        return v

    return check


def real(lo: float, hi: float, *, lo_open: bool = False) -> Check:
    def check(v: Any, where: str) -> float:
        if type(v) not in (int, float) or not math.isfinite(v) or not (lo < v if lo_open else lo <= v) or v > hi:
            raise _fail(where, f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]", v)
        return float(v)

    return check


def text(max_len: int = MAX_NAME) -> Check:
    def check(v: Any, where: str) -> str:
        if type(v) is not str or len(v) > max_len:
            raise _fail(where, f"a str of at most {max_len} chars", v)
        return v

    return check


def boolean(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise _fail(where, "a bool", v)
    return v


def optional(inner: Check) -> Check:
    def check(v: Any, where: str) -> Any:
        return None if v is None else inner(v, where)

    return check


def sequence(item: Check, max_items: int) -> Check:
    def check(v: Any, where: str) -> list[Any]:
        if type(v) not in (list, tuple) or len(v) > max_items:
            raise _fail(where, f"a list of at most {max_items} items", v)
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return check


def mapping(value: Check, max_items: int, key: Check | None = None) -> Check:
    key = key or text(MAX_NAME)

    def check(v: Any, where: str) -> dict[Any, Any]:
        if type(v) is not dict or len(v) > max_items:
            raise _fail(where, f"a map of at most {max_items} entries", v)
        return {key(k, f"{where} key"): value(x, f"{where}[{k!r}]") for k, x in v.items()}

    return check


def scalar(v: Any, where: str) -> int | float | str | bool:
    """A meta value: bool, int64, finite float or short str."""
    if type(v) is bool:
        return v
    if type(v) is int:
        return int(integer(-(2**63), 2**63 - 1)(v, where))
    if type(v) is float:
        return float(real(-math.inf, math.inf)(v, where))
    return str(text(MAX_TEXT)(v, where))


def blob(max_len: int) -> Check:
    """Bytes of at most ``max_len``."""
    def check(v: Any, where: str) -> bytes:
        if type(v) is not bytes:
            raise _fail(where, "bytes", type(v).__name__)
        if len(v) > max_len:
            raise _fail(where, f"at most {max_len} bytes", f"{len(v)} bytes")
        return v
    return check


_dim = integer(0, 2**40 - 1)


def envelope(v: Any, where: str) -> TensorEnvelope:
    """A tensor envelope, from a TensorEnvelope or its wire form [codec, dtype, shape, data]."""
    if isinstance(v, TensorEnvelope):
        fields = (v.codec, v.dtype, v.shape, v.data)
    elif type(v) is list and len(v) == 4:
        fields = tuple(v)
    else:
        raise _fail(where, "a tensor envelope [codec, dtype, shape, data]", v)
    codec, dtype, shape, data = fields
    integer(0, 255)(codec, f"{where}.codec")
    text(MAX_DTYPE_NAME)(dtype, f"{where}.dtype")
    shape = tuple(sequence(_dim, MAX_NDIM)(shape, f"{where}.shape"))
    if type(data) is not bytes:
        raise _fail(f"{where}.data", "bytes", type(data).__name__)
    if isinstance(v, TensorEnvelope) and shape == v.shape:
        return v
    return TensorEnvelope(codec=codec, dtype=dtype, shape=shape, data=data)


def to_wire(v: Any) -> Any:
    """The msgpack-able form of a checked value."""
    if isinstance(v, TensorEnvelope):
        return [v.codec, v.dtype, list(v.shape), v.data]
    if isinstance(v, list | tuple):
        return [to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: to_wire(x) for k, x in v.items()}
    if isinstance(v, int) and not isinstance(v, bool):
        return int(v)  # IntEnum -> int
    return v
