"""The peer's one handler table: each name registered once on the server, peer-wide or bound by the stage served."""

from __future__ import annotations

import asyncio

import pytest

from peer.handlers.table import Handlers
from protocol.errors import ErrorCode
from protocol.messages import Error, Message
from protocol.rpc import Handler, RpcLimits

PING = Error(code=ErrorCode.BAD_REQUEST, message="ping")  # any message: the table does not read it


class FakeRpc:  # a protocol.rpc.HandlerTable that refuses a second registration, as p2pd does
    limits, count = RpcLimits(), None

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    async def add_handler(self, name: str, fn: Handler) -> None:
        assert name not in self.handlers, "registered twice"
        self.handlers[name] = fn


def test_stage_handlers_register_once_and_rebind_on_a_stage_move() -> None:
    refused: list[str] = []

    async def go() -> list[object]:
        rpc = FakeRpc()
        table = Handlers(rpc, count=refused.append)

        def answer(tag: str) -> Handler:
            async def handler(msg: Message, peer: str) -> Message:
                return Error(code=ErrorCode.BAD_REQUEST, message=tag)
            return handler

        await table.reserve("forward")  # served from the start, NOT_READY until a stage binds it
        await table.serve("reach", answer("reach"))
        out: list[object] = [await rpc.handlers["forward"](PING, "p")]
        await table.add_handler("forward", answer("stage0"))
        await table.add_handler("state", answer("stage0"))
        out += [await rpc.handlers[n](PING, "p") for n in ("forward", "state")]
        table.clear()  # the stage leaves
        out += [await rpc.handlers[n](PING, "p") for n in ("forward", "state", "reach")]
        await table.add_handler("state", answer("stage1"))
        out.append(await rpc.handlers["state"](PING, "p"))
        with pytest.raises(ValueError, match="peer-wide"):
            await table.add_handler("reach", answer("stage1"))
        with pytest.raises(ValueError, match="already"):
            await table.serve("state", answer("x"))
        return out

    out = asyncio.run(go())
    messages = [(m.code, m.message) if isinstance(m, Error) else m for m in out]
    not_ready = ErrorCode.NOT_READY
    assert [m[0] == not_ready for m in messages] == [True, False, False, True, True, False, False]
    assert [m[1] for m in messages if m[0] != not_ready] == ["stage0", "stage0", "reach", "stage1"]
    assert refused == ["rejected:not_ready"] * 3
