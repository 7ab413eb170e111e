"""Our end of p2pd's inbound streams (protocol/inbound.py): p2pd's stream header is parsed from the first bytes,
whatever way they are split, and anything that is not such a header closes the connection. Serving, holding and
closing streams through it are tested with real daemons in tests/test_protocol_gate.py and
tests/test_protocol_budgets.py."""

from __future__ import annotations

import pytest
from hivemind.proto import p2pd_pb2

from protocol.inbound import MAX_HEADER_BYTES, _header

pytestmark = pytest.mark.timeout(120)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_the_stream_header_is_parsed_from_any_split_and_junk_is_refused():
    info = p2pd_pb2.StreamInfo(peer=b"\x12\x20" + bytes(range(32)), addr=b"\x04\x7f\x00\x00\x01", proto="asyncmesh.x")
    body = info.SerializeToString()
    data = _varint(len(body)) + body + b"AM rest"
    for cut in range(len(data) - 7):
        assert _header(data[:cut]) is None  # not complete yet
    peer, proto, end = _header(data)
    assert (peer, proto, data[end:]) == (info.peer, "asyncmesh.x", b"AM rest")
    with pytest.raises(ValueError):
        _header(_varint(MAX_HEADER_BYTES + 1) + b"x")  # larger than any p2pd header
    with pytest.raises(ValueError):
        _header(b"\xff" * 10)  # not a length
    with pytest.raises(Exception):  # noqa: B017 - not a StreamInfo (protobuf's DecodeError)
        _header(_varint(3) + b"\xff\xff\xff")


def test_socket_files_of_dead_listeners_are_swept_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from protocol.inbound import SOCKET_PREFIX, sweep_stale_sockets

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{SOCKET_PREFIX}{int(dead.stdout)}-abc.sock"
    mine = tmp_path / f"{SOCKET_PREFIX}{os.getpid()}-def.sock"
    other = tmp_path / f"{SOCKET_PREFIX}notapid.sock"
    for f in (gone, mine, other):
        f.write_text("")
    assert sweep_stale_sockets(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and mine.exists() and other.exists()
