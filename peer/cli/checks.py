"""What ``join`` checks before anything starts: every flag a user can get wrong fails in one line, at once.

Run before the DHT, the status server or any model is built, so a typo costs a second instead of a DHT timeout:
multiaddr syntax (``--initial-peers``, ``--host-maddrs``, ``--announce-maddrs``), a free ``--metrics-port``, and the
data a stage-0 peer would read. The data is checked whatever stage the peer asks for: an ``auto`` peer may move to
stage 0 later, and a fixed one may be restarted there.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from peer.errors import UserError
from trainer.config import RunConfig

EXAMPLE_PEER = "/ip4/203.0.113.5/tcp/31337/p2p/QmPeer..."


def check_multiaddrs(flag: str, values: Sequence[str], *, need_peer_id: bool = False) -> None:
    """Each value parses as a multiaddr (and names a peer with /p2p/ID when ``need_peer_id``)."""
    from hivemind.utils.multiaddr import Multiaddr

    for value in values:
        try:
            names = [p.name for p in Multiaddr(value).protocols()]
        except Exception as e:  # the multiaddr parser raises several types; every one means "not a multiaddr"
            raise UserError(f"{flag} {value!r} is not a multiaddr ({e}); expected e.g. {EXAMPLE_PEER}") from None
        if need_peer_id and "p2p" not in names:
            raise UserError(f"{flag} {value!r} names no peer: append /p2p/PEER_ID (a running peer prints its full "
                            f"multiaddr, e.g. {EXAMPLE_PEER})")


def check_port_free(flag: str, host: str, port: int | None) -> None:
    """``host:port`` can be bound now (0 and None pick or need nothing)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use (another peer on this machine?)" if e.errno == errno.EADDRINUSE else f"cannot be bound " \
                                                                                                  f"({e.strerror})"
            raise UserError(f"{flag} {port}: {host}:{port} {why}; pass a free port, or 0 to pick one") from None


def check_data(run: RunConfig, data_path: str | None) -> None:
    """The corpus a stage-0 peer of ``run`` would read (``data_path`` overriding the run's) loads: it exists, is
    readable, holds usable files and enough tokens for both splits."""
    from trainer.data import load_corpus

    if data_path is None and run.data.source == "stdlib":
        return  # the embedded corpus ships with the interpreter; its peers load it anyway
    cfg = run.data if data_path is None else run.replace(data={"source": data_path}).data
    flag = "--data" if data_path is not None else f"the run's data.source {cfg.source!r}"
    try:
        if cfg.streamed:  # opened by the stage-0 driver; here: the files exist and the packages and tokenizer load
            from trainer.sources import HUB_PREFIX
            from trainer.stream import local_files
            from trainer.tokenizer import import_hf, load_tokenizer

            import_hf("datasets", f"data.source {cfg.source!r}")
            load_tokenizer(cfg)
            if not cfg.source.startswith(HUB_PREFIX):
                local_files(cfg.source)
        else:
            load_corpus(cfg, run.model.vocab_size)
    except (ValueError, OSError, ImportError) as e:
        raise UserError(f"{flag}: {e}") from None


def check_join(args: object, run: RunConfig, metrics_host: str = "127.0.0.1") -> None:
    """Every check above for ``join``'s parsed arguments."""
    check_multiaddrs("--initial-peers", getattr(args, "initial_peers", []) or [], need_peer_id=True)
    check_multiaddrs("--host-maddrs", getattr(args, "host_maddrs", None) or [])
    check_multiaddrs("--announce-maddrs", getattr(args, "announce_maddrs", []) or [])
    check_port_free("--metrics-port", metrics_host, getattr(args, "metrics_port", None))
    check_data(run, getattr(args, "data", None))
