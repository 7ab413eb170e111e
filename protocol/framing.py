"""Length-prefixed frames over an asyncio stream, with every size checked before a body is read.

Frame layout (12-byte header, big-endian):

    offset 0  2 bytes  magic b"AM"
    offset 2  1 byte   framing version (1)
    offset 3  1 byte   flags: bit 0 = END (last frame of a message); other bits must be 0
    offset 4  8 bytes  body length, unsigned

A message (msgpack bytes, see protocol.messages) is sent as one or more frames; the last carries END. The reader
refuses a frame whose announced length exceeds `max_frame_bytes`, or would take the message past
`max_message_bytes`, or is not covered by the caller's `admit` callback (byte budgets) — in each case *before*
reading the body, so a peer announcing 2**40 bytes costs us 12 bytes of reading. The length field is 8 bytes
precisely so that such announcements are representable and refused rather than silently truncated.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

from protocol.errors import FrameTooLarge, MalformedMessage

__all__ = [
    "StreamEnded",
    "HEADER",
    "MAGIC",
    "FRAMING_VERSION",
    "FLAG_END",
    "frame_header",
    "read_message",
    "write_message",
]

HEADER = struct.Struct(">2sBBQ")
MAGIC = b"AM"
FRAMING_VERSION = 1
FLAG_END = 1


class StreamEnded(MalformedMessage):
    """The stream closed before a complete message arrived (the sender hung up or crashed)."""


def frame_header(length: int, *, end: bool) -> bytes:
    return HEADER.pack(MAGIC, FRAMING_VERSION, FLAG_END if end else 0, length)


async def _read_exactly(reader: asyncio.StreamReader, n: int, what: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise StreamEnded(f"stream ended after {len(e.partial)} of {n} bytes of {what}") from None
    except ConnectionError as e:
        raise StreamEnded(f"connection lost while reading {what}: {e}") from None


async def read_message(
    reader: asyncio.StreamReader,
    *,
    max_frame_bytes: int,
    max_message_bytes: int,
    admit: Callable[[int], None] | None = None,
) -> bytes | bytearray:
    """Read one message (a run of frames ending with END) and return its bytes.

    Raises FrameTooLarge (body not read), MalformedMessage (bad magic/version/flags) or StreamEnded. `admit(n)` is
    called with each frame's length before its body is read and may raise to refuse it (e.g. a byte budget).
    """
    buffer = bytearray()  # multi-frame messages grow one buffer: peak memory ~1x the message, not 2x as with join
    total = 0
    while True:
        magic, version, flags, length = HEADER.unpack(await _read_exactly(reader, HEADER.size, "a frame header"))
        if magic != MAGIC:
            raise MalformedMessage(f"bad frame magic {magic!r}; the peer does not speak the asyncmesh protocol")
        if version != FRAMING_VERSION or flags & ~FLAG_END:
            raise MalformedMessage(f"unsupported framing version {version} or flags {flags:#04x}")
        if length > max_frame_bytes:
            raise FrameTooLarge(length, max_frame_bytes, "frame")
        total += HEADER.size + length  # headers count, so a stream of empty frames is bounded too
        if total > max_message_bytes:
            raise FrameTooLarge(total, max_message_bytes, "message")
        if admit is not None:
            admit(length)
        body = await _read_exactly(reader, length, "a frame body") if length else b""
        if flags & FLAG_END:
            if not buffer:
                return body
            buffer += body
            return buffer
        buffer += body


async def write_message(writer: asyncio.StreamWriter, data: bytes, *, frame_bytes: int) -> None:
    """Write `data` as frames of at most `frame_bytes` bytes, draining after each so memory stays flat."""
    if frame_bytes <= 0:
        raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
    view = memoryview(data)
    offset = 0
    while True:
        chunk = view[offset : offset + frame_bytes]
        offset += len(chunk)
        end = offset >= len(view)
        writer.write(frame_header(len(chunk), end=end))
        writer.write(chunk)
        await writer.drain()
        if end:
            return
