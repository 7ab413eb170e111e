"""Length-prefixed frames over an asyncio stream, with every size checked before a body is read.

Frame layout (12-byte header, big-endian):

    offset 0  2 bytes  magic b"AM"
    offset 2  1 byte   framing version (1)
    offset 3  1 byte   flags: bit 0 = END (last frame of a message); bit 1 = KEEP, only with END (a request's: the
                       caller would send another request on this stream; a reply's: the server takes one); other
                       bits must be 0
    offset 4  8 bytes  body length, unsigned

A message (msgpack bytes, see protocol.messages) is sent as one or more frames; the last carries END. The reader
refuses a frame whose announced length exceeds `max_frame_bytes`, or would take the message past
`max_message_bytes` — *before* reading the body, so a peer announcing 2**40 bytes costs us 12 bytes of reading. The
length field is 8 bytes precisely so that such announcements are representable and refused rather than silently
truncated. Bodies are read in chunks of at most ``CHUNK`` bytes and each chunk is charged to the caller's ``admit``
callback (byte budgets) once it arrived, not when announced: announcing costs a sender nothing it has not sent. An
optional ``deadline(received)`` bounds how long the next chunk may take, which lets a server require a minimum rate.
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
    "FLAG_KEEP",
    "frame_header",
    "read_message",
    "write_message",
]

HEADER = struct.Struct(">2sBBQ")
CHUNK = 64 * 1024
MAGIC = b"AM"
FRAMING_VERSION = 1
FLAG_END = 1
FLAG_KEEP = 2


class StreamEnded(MalformedMessage):
    """The stream closed before a complete message arrived (the sender hung up or crashed)."""


def frame_header(length: int, *, end: bool, keep: bool = False) -> bytes:
    return HEADER.pack(MAGIC, FRAMING_VERSION, (FLAG_END if end else 0) | (FLAG_KEEP if end and keep else 0), length)


async def _read_exactly(reader: asyncio.StreamReader, n: int, what: str, deadline: float | None = None) -> bytes:
    try:
        if deadline is None:
            return await reader.readexactly(n)
        async with asyncio.timeout_at(deadline):
            return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise StreamEnded(f"stream ended after {len(e.partial)} of {n} bytes of {what}") from None
    except ConnectionError as e:
        raise StreamEnded(f"connection lost while reading {what}: {e}") from None


async def _read_some(reader: asyncio.StreamReader, n: int, deadline: float | None) -> bytes:
    """Whatever arrives first, 1..n bytes of a frame body (before ``deadline``)."""
    try:
        if deadline is None:
            data = await reader.read(n)
        else:
            async with asyncio.timeout_at(deadline):
                data = await reader.read(n)
    except ConnectionError as e:
        raise StreamEnded(f"connection lost while reading a frame body: {e}") from None
    if not data:
        raise StreamEnded("stream ended inside a frame body")
    return data


async def read_message(
    reader: asyncio.StreamReader,
    *,
    max_frame_bytes: int,
    max_message_bytes: int,
    admit: Callable[[int], None] | None = None,
    deadline: Callable[[int], float] | None = None,
    kept: list[bool] | None = None,
    first: bytes | None = None,
) -> bytes | bytearray:
    """Read one message (a run of frames ending with END) and return its bytes; ``kept``, when given, gets whether
    the last frame carried KEEP appended; ``first``: the first frame's header, already read from ``reader``.

    Raises FrameTooLarge (body not read), MalformedMessage (bad magic/version/flags), StreamEnded, or TimeoutError
    when ``deadline`` passes. ``admit(n)`` is called for every chunk of ``n`` body bytes as it arrives (chunks of at
    most CHUNK bytes) and may raise to refuse the message (e.g. a byte budget). ``deadline(received)`` returns the
    event-loop time by which the next read (of up to CHUNK bytes) must have completed, given the bytes received.
    """
    buffer = bytearray()  # multi-frame messages grow one buffer: peak memory ~1x the message, not 2x as with join
    total = 0
    received = 0

    def due(n: int) -> float | None:
        return deadline(received + n) if deadline is not None else None

    while True:
        if first is not None:
            head, first = first, None
            if len(head) != HEADER.size:
                raise MalformedMessage(f"a frame header is {HEADER.size} bytes, not {len(head)}")
        else:
            head = await _read_exactly(reader, HEADER.size, "a frame header", due(HEADER.size))
        received += HEADER.size
        magic, version, flags, length = HEADER.unpack(head)
        if magic != MAGIC:
            raise MalformedMessage(f"bad frame magic {magic!r}; the peer does not speak the asyncmesh protocol")
        if version != FRAMING_VERSION or flags & ~(FLAG_END | FLAG_KEEP) or flags == FLAG_KEEP:
            raise MalformedMessage(f"unsupported framing version {version} or flags {flags:#04x}")
        if length > max_frame_bytes:
            raise FrameTooLarge(length, max_frame_bytes, "frame")
        total += HEADER.size + length  # headers count, so a stream of empty frames is bounded too
        if total > max_message_bytes:
            raise FrameTooLarge(total, max_message_bytes, "message")
        left = length
        while left:
            chunk = await _read_some(reader, min(left, CHUNK), due(min(left, CHUNK)))
            if admit is not None:
                admit(len(chunk))  # charged once it arrived (at most CHUNK bytes are held uncharged)
            buffer += chunk
            received += len(chunk)
            left -= len(chunk)
        if flags & FLAG_END:
            if kept is not None:
                kept.append(bool(flags & FLAG_KEEP))
            return buffer


async def write_message(writer: asyncio.StreamWriter, data: bytes, *, frame_bytes: int, keep: bool = False) -> None:
    """Write `data` as frames of at most `frame_bytes` bytes, draining after each so memory stays flat; ``keep``
    sets KEEP on the last frame."""
    if frame_bytes <= 0:
        raise ValueError(f"frame_bytes must be positive, got {frame_bytes}")
    view = memoryview(data)
    offset = 0
    while True:
        chunk = view[offset : offset + frame_bytes]
        offset += len(chunk)
        end = offset >= len(view)
        writer.write(frame_header(len(chunk), end=end, keep=keep))
        writer.write(chunk)
        await writer.drain()
        if end:
            return
