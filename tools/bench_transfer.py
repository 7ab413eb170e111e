#!/usr/bin/env python3
"""One message's transfer time on the emulated WAN: the project's RPC (``protocol.rpc.call`` over hivemind's p2pd)
against a plain TCP connection, per message size.

A sync barrier exchanges a stage's whole gradient (1.7 MB fp32 for the default run) once per flush, an averaging
round a partition of the weights, a state transfer chunks of up to 4 MiB; a pipeline frame of the default run is
131 KB. An RPC opens a fresh libp2p stream unless a kept one is at hand, and a fresh stream's flow-control window
starts small and grows per round trip (yamux: 256 KiB, doubling), so a message larger than that costs round trips a
long-lived TCP connection does not: this tool measures how many. Both sides run in their own network namespace on
``tools/wan.py``'s links (root); each size is sent ``--reps`` times, ``--gap-s`` apart (the idle time between two
barriers), over one TCP connection kept open, over one RPC per message from a stranger and from a peer the server
knows (whose large requests keep their stream for the next: ``RpcLimits.keep_min_bytes``), and over one libp2p
stream kept open for all of them with the same framing; the first send of each, which dials or opens, is left out.

    python tools/bench_transfer.py --json docs/bench/transfer.json

The JSON holds, per network (``wan-<delay>ms``) and size, the medians ``tcp_s``, ``rpc_s``, ``rpc_known_s`` and
``kept_stream_s``, the ideal ``rtt + size / rate``, and ``extra_rtts`` = (rpc - tcp) / rtt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the packages importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TCP_PORT = 9944
READY = "transfer server ready"
KEPT_PROTOCOL = "/asyncmesh-bench/kept-stream"
KEEP_MIN_BYTES = 256 * 1024  # the known caller's requests from this size on keep their stream (a peer: off)
RESULT = "transfer result"
MIN_RTT_S = 0.002  # below this (loopback-like) round trips are not a unit to count in
DEFAULT_SIZES = (1_000, 131_072, 262_144, 524_288, 1_048_576, 1_700_000, 4_194_304)


# ----- the two ends (run inside the namespaces) -------------------------------------------------------------------
def _tcp_sink(ip: str) -> None:
    """Accept connections; per message (8-byte length, then the bytes) answer one byte."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ip, TCP_PORT))
    srv.listen(4)

    def serve(conn: socket.socket) -> None:
        with conn:
            while len(head := conn.recv(8, socket.MSG_WAITALL)) == 8:
                left = int.from_bytes(head, "little")
                while left > 0 and (chunk := conn.recv(min(1 << 20, left))):
                    left -= len(chunk)
                conn.sendall(b"k")

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


async def _serve(ip: str) -> None:
    from hivemind.p2p import P2P

    from protocol.framing import StreamEnded, read_message, write_message
    from protocol.messages import Ack, Message
    from protocol.rpc import RpcLimits, RpcServer

    threading.Thread(target=_tcp_sink, args=(ip,), daemon=True).start()
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"])
    server = RpcServer(p2p, RpcLimits())

    async def sink(msg: Message, peer: str) -> Message:
        return Ack()

    await server.add_handler("transfer", sink)

    async def trust(msg: Message, peer: str) -> Message:  # the caller becomes a known peer (as validated work does)
        server.vouch(peer)
        return Ack()

    await server.add_handler("trust_me", trust)

    async def kept(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # one stream for many messages (what a stream kept open between calls would give): frames in, one byte out
        try:
            while True:
                await read_message(reader, max_frame_bytes=1 << 24, max_message_bytes=1 << 28)
                await write_message(writer, b"k", frame_bytes=1 << 20)
        except StreamEnded:
            pass
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(KEPT_PROTOCOL, kept)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs() if ip in str(m)]
    print(READY, maddrs[0], flush=True)
    await asyncio.Event().wait()  # until terminated


async def _client(ip: str, maddr: str, sizes: list[int], reps: int, gap_s: float) -> dict[str, Any]:
    import torch
    from hivemind.p2p import P2P, PeerID

    from protocol.codecs.registry import encode
    from protocol.framing import read_message, write_message
    from protocol.messages import Forward, pack
    from protocol.rpc import RpcLimits, call

    out: dict[str, Any] = {}
    tcp = socket.create_connection((ip, TCP_PORT))
    p2p = await P2P.create(initial_peers=[maddr])
    known = await P2P.create(initial_peers=[maddr])  # a second identity, which the server vouches for
    peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
    limits = RpcLimits(keep_min_bytes=KEEP_MIN_BYTES)
    hello = Forward(run_id="transfer", mb_id=0, route=["a"], activations=encode(torch.zeros(1, 1, 1), "none"),
                    targets=None, is_eval=False, sent_at=0.0)
    await call(known, peer, "trust_me", hello, timeout=60.0)
    async def timed(send: Callable[[], Awaitable[object]]) -> list[float]:
        """``reps`` sends ``gap_s`` apart, timed; the first (it dials, opens or warms up) left out."""
        times = []
        for _ in range(reps + 1):
            await asyncio.sleep(gap_s)
            t0 = time.monotonic()
            await send()
            times.append(time.monotonic() - t0)
        return times[1:]

    async def one_size(size: int) -> dict[str, list[float]]:
        data = os.urandom(size)

        async def over_tcp() -> None:
            tcp.sendall(len(data).to_bytes(8, "little") + data)
            tcp.recv(1)

        x = torch.zeros(max(1, size // 4))
        msg = Forward(run_id="transfer", mb_id=0, route=["a"], activations=encode(x.view(1, 1, -1), "none"),
                      targets=None, is_eval=False, sent_at=0.0)
        tcp_s = await timed(over_tcp)
        rpc_s = await timed(lambda: call(p2p, peer, "transfer", msg, timeout=120.0, limits=limits))
        known_s = await timed(lambda: call(known, peer, "transfer", msg, timeout=120.0, limits=limits))
        payload = pack(msg)
        _, reader, writer = await p2p.call_binary_stream_handler(peer, KEPT_PROTOCOL)

        async def over_kept_stream() -> None:
            await write_message(writer, payload, frame_bytes=limits.send_frame_bytes)
            await read_message(reader, max_frame_bytes=1024, max_message_bytes=1024)

        try:
            kept_s = await timed(over_kept_stream)
        finally:
            writer.close()
        return {"tcp_s": tcp_s, "rpc_s": rpc_s, "rpc_known_s": known_s, "kept_stream_s": kept_s}

    try:
        for size in sizes:
            out[str(size)] = await one_size(size)
    finally:
        tcp.close()
        await p2p.shutdown()
        await known.shutdown()
    return out


# ----- the driver ---------------------------------------------------------------------------------------------------
def summarise(raw: dict[str, Any], *, rtt_s: float, rate_mbit: float) -> dict[str, Any]:
    """Medians and the round trips the RPC adds over TCP, per size (``raw``: size -> {tcp_s, rpc_s} lists)."""
    rows = {}
    for size, got in raw.items():
        tcp, rpc = statistics.median(got["tcp_s"]), statistics.median(got["rpc_s"])
        kept = statistics.median(got["kept_stream_s"]) if got.get("kept_stream_s") else None
        known = statistics.median(got["rpc_known_s"]) if got.get("rpc_known_s") else None
        ideal = rtt_s + (int(size) * 8 / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0)
        rows[size] = {"tcp_s": round(tcp, 4), "rpc_s": round(rpc, 4), "ideal_s": round(ideal, 4),
                      "kept_stream_s": round(kept, 4) if kept is not None else None,
                      "rpc_known_s": round(known, 4) if known is not None else None,
                      "rpc_over_tcp": round(rpc / tcp, 3) if tcp > 0 else None,
                      "extra_rtts": round((rpc - tcp) / rtt_s, 2) if rtt_s >= MIN_RTT_S else None,
                      "samples": got}
    return rows


def measure(delay_ms: float, rate_mbit: float, sizes: list[int], reps: int, gap_s: float, subnet: str) -> dict:
    from tools.wan import Wan, WanConfig

    me = [sys.executable, str(Path(__file__).resolve())]
    with Wan(WanConfig(n=2, delay_ms=delay_ms, rate_mbit=rate_mbit, subnet=subnet)) as wan:
        server = wan.popen(1, [*me, "--serve", wan.ip(1)], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        maddr = None
        deadline = time.monotonic() + 60
        while maddr is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                raise RuntimeError("the transfer server exited before it was ready (run as root, see tools/wan.py)")
            if line.startswith(READY):
                maddr = line.split()[-1]
        if maddr is None:
            raise RuntimeError("the transfer server did not start within 60 s")
        client = wan.run(0, [*me, "--client", wan.ip(1), maddr, "--sizes", *map(str, sizes), "--reps", str(reps),
                             "--gap-s", str(gap_s)], timeout=60 + len(sizes) * (reps + 1) * (gap_s + 30))
        if client.returncode != 0:
            raise RuntimeError(f"the transfer client failed: {client.stderr[-2000:]}")
        line = next(x for x in client.stdout.splitlines() if x.startswith(RESULT))
        rtt = wan.rtt(0, 1)
    return {"delay_ms": delay_ms, "rate_mbit": rate_mbit, "rtt_s": round(rtt, 4),
            "sizes": summarise(json.loads(line[len(RESULT):]), rtt_s=rtt, rate_mbit=rate_mbit)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 50.0], help="one-way delays (RTT = 2x)")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="uplink cap per namespace")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    ap.add_argument("--reps", type=int, default=5, help="timed sends per size and transport")
    ap.add_argument("--gap-s", type=float, default=1.0, help="idle time before each send")
    ap.add_argument("--subnet", default="100.64.9", help="first three octets of the namespaces' addresses")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--serve", metavar="IP", help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=2, metavar=("IP", "MADDR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.client:
        raw = asyncio.run(_client(args.client[0], args.client[1], args.sizes, args.reps, args.gap_s))
        print(RESULT, json.dumps(raw), flush=True)
        return 0
    if args.reps < 1 or any(s < 1 for s in args.sizes):
        ap.error("--reps and every --sizes value must be >= 1")
    load = [os.getloadavg()[0]]
    networks = {}
    for delay in args.delays_ms:
        key = f"wan-{delay:g}ms"
        networks[key] = measure(delay, args.rate_mbit, args.sizes, args.reps, args.gap_s, args.subnet)
        for size, row in networks[key]["sizes"].items():
            print(f"{key} {int(size):>9} B: tcp {row['tcp_s']:.3f} s, rpc {row['rpc_s']:.3f} s (a known caller "
                  f"{row['rpc_known_s']:.3f} s), one stream kept {row['kept_stream_s']:.3f} s (ideal "
                  f"{row['ideal_s']:.3f} s; rpc adds {row['extra_rtts']} RTTs)", flush=True)
        load.append(os.getloadavg()[0])
    command = " ".join(["python tools/bench_transfer.py", *(argv if argv is not None else sys.argv[1:])])
    meta = {"command": command, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "cores": os.cpu_count(), "loadavg_start_per_network": [round(x, 2) for x in load],
            "python": platform.python_version()}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"networks": networks, "meta": meta}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
