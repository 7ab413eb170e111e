"""Exception family and wire error codes of the asyncmesh protocol.

Everything that goes wrong while reading bytes from a peer raises a subclass of `ProtocolError`, so the network
boundary can catch exactly one type, answer with an `ErrorCode`, count the reason and carry on. Errors that the
*remote* side reported come back to a caller as `RemoteError` with the code it sent.
"""

from __future__ import annotations

import enum

__all__ = [
    "ErrorCode",
    "ProtocolError",
    "FrameTooLarge",
    "MalformedMessage",
    "ValidationError",
    "VersionMismatch",
    "RemoteError",
    "RateLimited",
    "PeerUnreachable",
    "error_code_for",
]


class ErrorCode(enum.IntEnum):
    """Codes carried by an `Error` reply. Values are part of the wire format: never renumber, only append."""

    BAD_REQUEST = 1  # malformed frame or message, a tensor that failed validation
    WRONG_RUN = 2  # the request names another run id
    WRONG_STAGE = 3  # the request was sent to a peer serving another stage
    VERSION_MISMATCH = 4  # no protocol version in common
    TOO_LARGE = 5  # a frame or message exceeds the receiver's limits
    BUSY = 6  # the receiver is saturated; retry elsewhere or later
    RATE_LIMITED = 7  # the sender exceeded its byte budget at this receiver
    UNAUTHORIZED = 8  # the sender is not allowed to call this handler
    NOT_READY = 9  # the receiver is still joining or loading state
    TIMEOUT = 10  # the receiver gave up waiting for the rest of the request
    INTERNAL = 11  # the receiver's handler failed; not the sender's fault
    NOT_FOUND = 12  # the receiver holds no such item (a testimony about a micro-batch it never trained)
    OUT_OF_BOUNDS = 13  # a tensor far from the receiver's recent traffic (its norm bounds): the sender's work is what
    # looks wrong, not the receiver; an older peer reads it as any error


class ProtocolError(Exception):
    """Base of every error raised while reading, decoding or validating what a peer sent."""


class FrameTooLarge(ProtocolError):
    """A frame or a whole message announced more bytes than the receiver accepts; its body was not read."""

    def __init__(self, announced: int, limit: int, what: str = "frame") -> None:
        self.announced, self.limit, self.what = announced, limit, what
        super().__init__(
            f"{what} announces {announced} bytes, more than the limit of {limit} bytes; "
            f"split the payload into smaller chunks or raise the receiver's limit"
        )


class MalformedMessage(ProtocolError):
    """Bytes that do not form a valid frame or message (bad magic, truncated, wrong types, unknown kind)."""


class ValidationError(ProtocolError):
    """A well-formed message whose content breaks the spec the receiver expects (shape, dtype, finiteness...)."""

    def __init__(self, field: str, peer: str, reason: str = "does not match the expected spec") -> None:
        self.field, self.peer, self.reason = field, peer, reason
        super().__init__(f"invalid {field} from peer {peer}: {reason}")


class VersionMismatch(ProtocolError):
    """The sender speaks a protocol version this peer does not; the message lists the versions each side speaks."""

    def __init__(self, theirs: int | str, ours: tuple[int, ...]) -> None:
        self.theirs, self.ours = theirs, ours
        super().__init__(
            f"peer speaks protocol version {theirs}, this peer speaks version(s) {', '.join(map(str, ours))}; "
            f"upgrade the older peer to a release that speaks a common version"
        )


class RemoteError(ProtocolError):
    """The remote peer answered with an `Error` reply."""

    def __init__(self, code: ErrorCode | int, message: str) -> None:
        try:
            code = ErrorCode(code)
        except ValueError:
            pass
        self.code, self.message = code, message
        name = code.name if isinstance(code, ErrorCode) else f"code {code}"
        super().__init__(f"remote peer replied {name}: {message}")


class RateLimited(ProtocolError):
    """A peer sent more bytes than its budget at this receiver allows; answered with RATE_LIMITED."""


class PeerUnreachable(ProtocolError):
    """A stream to the peer could not be opened (no route, the peer is gone, or it does not serve that handler), or it
    ended before a complete reply."""


class StreamNotOpened(PeerUnreachable):
    """No stream to the peer could be opened: nothing of the request was sent (a dial that failed, a connection still
    being set up), so trying again costs no bytes."""


def error_code_for(exc: BaseException) -> ErrorCode:
    """The code a receiver should answer with when reading or handling a request raised `exc`."""
    if isinstance(exc, FrameTooLarge):
        return ErrorCode.TOO_LARGE
    if isinstance(exc, VersionMismatch):
        return ErrorCode.VERSION_MISMATCH
    if isinstance(exc, RateLimited):
        return ErrorCode.RATE_LIMITED
    if isinstance(exc, MalformedMessage | ValidationError):
        return ErrorCode.BAD_REQUEST
    if isinstance(exc, TimeoutError):
        return ErrorCode.TIMEOUT
    return ErrorCode.INTERNAL
