"""The red team's swarms and its judge: an attacked swarm and its twin, and the loss of their weights.

``Swarm`` starts one swarm of the tiny run with ``replicas`` peers per stage (``peer.ops.procs``) and watches its
stage-0 peers' optimiser steps (the stall figure). The red team starts two of them together, the same run file,
seed, layout and settings: the attacked one and a twin that nobody attacks, trained alongside over the same seconds.

``Judge`` is a stranger's libp2p identity that fetches each peer's stage weights through the state RPC (what any
joiner may do, ``peer.state.sync``), chains them into pipelines and evaluates them on fixed validation batches in
this process. A peer's own ``/status`` loss passes through its own filters (an outlier is not reported), so it can
read healthy while its weights are ruined; the weights cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from peer.ops.metrics import PeerMetrics
from peer.ops.procs import PeerProcess, free_port, join_command, terminate
from peer.state.sync import StateSyncConfig, load_state_from_peers
from trainer.data import load_corpus, val_batches
from trainer.model import build_stage

if TYPE_CHECKING:
    from tools.redteam import Attacker
    from trainer.config import RunConfig

Batches = list[tuple[torch.Tensor, torch.Tensor]]
StageWeights = dict[str, torch.Tensor]


def peer_id_of(p: PeerProcess) -> str:
    return p.wait_maddrs()[0].rsplit("/p2p/", 1)[1]


class Swarm:
    """One swarm of ``run_path`` on loopback: ``replicas`` peers per stage, named ``{prefix}{stage}{replica}``
    (the first stage-0 peer, ``peers[0][0]``, is the one the others join through), and any extra peers an attack
    adds while it runs (``extra``: they are judged too)."""

    def __init__(self, name: str, root: Path, run_path: Path, n_stages: int, replicas: int,
                 settings: Sequence[str], cwd: Path) -> None:
        self.name, self.root, self.run_path, self.settings, self.cwd = name, root, run_path, tuple(settings), cwd
        self.n_stages, self.replicas = n_stages, replicas
        self.peers: list[list[PeerProcess]] = [[] for _ in range(n_stages)]
        self.extra: dict[str, tuple[int, PeerProcess]] = {}  # name -> (stage, process)
        self.samples: dict[str, list[tuple[float, int, float | None]]] = {}
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    def spawn(self, label: str, stage: int, initial: Sequence[str] = ()) -> PeerProcess:
        port = free_port()
        return PeerProcess.spawn(label, join_command(self.root / label, port=port, run=self.run_path, stage=stage,
                                                     settings=self.settings, initial=initial),
                                 self.root / label, port, cwd=self.cwd)

    def start_first(self) -> None:
        self.peers[0].append(self.spawn(f"{self.name}00", 0))

    def start_rest(self) -> None:
        initial = self.initial
        for stage in range(self.n_stages):
            for r in range(len(self.peers[stage]), self.replicas):
                self.peers[stage].append(self.spawn(f"{self.name}{stage}{r}", stage, initial))

    @property
    def initial(self) -> list[str]:
        return self.peers[0][0].wait_maddrs()[:1]

    def all(self) -> list[PeerProcess]:
        return [p for stage in self.peers for p in stage] + [p for _, p in self.extra.values()]

    def wait_training(self, timeout: float) -> None:
        for p in self.all():
            p.wait_status(lambda s: s.get("state") == "training", timeout, "training")
        self.peers[0][0].wait_status(lambda s: (s.get("local_step") or 0) > 3 and s.get("val_loss") is not None,
                                     timeout, "a validation loss")

    def watch(self) -> None:
        """Poll every stage-0 peer's /status in a thread: (time, local_step, reported val_loss)."""
        def run() -> None:
            while not self._stop.is_set():
                for p in self.peers[0]:
                    s = p.status()
                    if s is not None:
                        self.samples.setdefault(p.name, []).append(
                            (time.monotonic(), int(s.get("local_step") or 0), s.get("val_loss")))
                time.sleep(0.2)
        self._watch = threading.Thread(target=run, daemon=True)
        self._watch.start()

    def window(self, t0: float, t1: float) -> tuple[float, float | None]:
        """(longest stretch in [t0, t1] without a new step of some stage-0 peer, the first one's latest reported
        val loss)."""
        stall, reported = 0.0, None
        for i, p in enumerate(self.peers[0]):
            s, loss = stall_and_loss([x for x in self.samples.get(p.name, []) if t0 <= x[0] <= t1], t0, t1)
            stall = max(stall, s)
            reported = loss if i == 0 else reported
        return stall, reported

    def rss_mib(self) -> float:
        out = 0.0
        for p in self.all():
            try:
                for line in Path(f"/proc/{p.proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out = max(out, int(line.split()[1]) / 1024)
            except OSError:
                pass
        return out

    def alive(self) -> bool:
        return all(p.alive() for stage in self.peers for p in stage)

    def steps(self) -> dict[str, int]:
        return {p.name: int((p.status() or {}).get("local_step") or 0) for stage in self.peers for p in stage}

    def close(self) -> None:
        self._stop.set()
        terminate([p.proc for p in self.all()], 10.0)


def stall_and_loss(inside: list[tuple[float, int, float | None]], t0: float, t1: float) -> tuple[float, float | None]:
    """Longest gap in [t0, t1] between two samples at which the step grew, and the latest loss of the samples."""
    steps = [b[0] for a, b in zip(inside, inside[1:], strict=False) if b[1] > a[1]]
    marks = [t0, *steps, t1]
    vals = [s[2] for s in inside if s[2] is not None]
    return max(b - a for a, b in zip(marks, marks[1:], strict=False)), (vals[-1] if vals else None)


def pipeline_loss(run: RunConfig, stages: Sequence[StageWeights], batches: Batches) -> float:
    """Mean validation loss of the model made of ``stages`` (one weight dict per stage, in order) on ``batches``."""
    modules = []
    for s, weights in enumerate(stages):
        module = build_stage(run, s)
        module.load_state_dict(weights)
        modules.append(module.eval())
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = modules[-1].loss  # type: ignore[assignment]
    losses = []
    with torch.no_grad():
        for x, y in batches:
            h = x
            for m in modules:
                h = m(h)
            losses.append(float(loss_of(h.float(), y)))
    return sum(losses) / len(losses)


@dataclass
class Verdict:
    """The judge's reading of one swarm at one moment: the loss of each pipeline it could assemble."""
    losses: dict[str, float] = field(default_factory=dict)  # pipeline name -> validation loss
    missing: list[str] = field(default_factory=list)  # peers whose weights could not be fetched

    def mean(self, names: Sequence[str] | None = None) -> float | None:
        vals = [v for k, v in self.losses.items() if names is None or k in names]
        return statistics.fmean(vals) if vals else None

    def to_json(self) -> dict[str, Any]:
        return {"losses": {k: round(v, 4) for k, v in self.losses.items()}, "missing": self.missing}


def ratio(attacked: float | None, twin: float | None) -> float | None:
    """``attacked / twin``: the honest loss against the twin's at the same moment (None if either is missing)."""
    if attacked is None or twin is None or twin <= 0:
        return None
    return attacked / twin


def pipelines(layout: list[list[str]], extra: dict[str, int]) -> dict[str, list[str]]:
    """The pipelines the judge evaluates, as peer names per stage: replica r of every stage (``r0``, ``r1``, ...),
    and each extra peer in place of replica 0 of its stage (named after it)."""
    out = {f"r{r}": [layout[s][min(r, len(layout[s]) - 1)] for s in range(len(layout))]
           for r in range(max(len(stage) for stage in layout))}
    for name, stage in extra.items():
        out[name] = [name if s == stage else layout[s][0] for s in range(len(layout))]
    return out


class Judge:
    """A stranger that fetches stage weights through the state RPC and evaluates them here."""

    def __init__(self, run: RunConfig, key: Path, eval_batches: int) -> None:
        self.run, self.key = run, key
        corpus = load_corpus(run.data, run.model.vocab_size)
        self.batches = val_batches(corpus, run.model.block_size, run.data.batch_size, eval_batches)
        self.p2p: P2P | None = None

    async def start(self, initial: Sequence[str]) -> None:
        if not self.key.exists():
            P2P.generate_identity(str(self.key))
        self.p2p = await P2P.create(identity_path=str(self.key), initial_peers=list(initial),
                                    host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def close(self) -> None:
        if self.p2p is not None:
            await self.p2p.shutdown()

    async def weights(self, peer_id: str, maddrs: Sequence[str], stage: int) -> StageWeights | None:
        """The stage weights the peer ``peer_id`` (listening on ``maddrs``) serves now through the state RPC (None: it
        would not or could not serve them)."""
        assert self.p2p is not None, "start() first"
        try:
            addrs = [Multiaddr(m.rsplit("/p2p/", 1)[0]) for m in maddrs]
            await self.p2p._client.connect(PeerID.from_base58(peer_id), addrs)
        except Exception:  # routing may still find it through the swarm
            pass
        state = await load_state_from_peers(p2p=self.p2p, run=self.run, stage=stage,
                                            metrics=PeerMetrics("judge", stage), donors=[peer_id],
                                            config=StateSyncConfig(chunk_retries=2))
        return None if state is None else state["model"]

    async def judge(self, swarm: Swarm) -> Verdict:
        """Every peer's weights fetched at once, then every pipeline of ``pipelines`` evaluated."""
        who: dict[str, tuple[int, PeerProcess]] = {p.name: (s, p) for s, stage in enumerate(swarm.peers)
                                                   for p in stage}
        who.update({n: v for n, v in swarm.extra.items() if v[1].alive()})
        got = await asyncio.gather(*(self.weights(peer_id_of(p), p.maddrs, s) for s, p in who.values()),
                                   return_exceptions=True)
        weights = {n: w for n, w in zip(who, got, strict=True) if isinstance(w, dict)}
        verdict = Verdict(missing=sorted(set(who) - set(weights)))
        layout = [[p.name for p in stage] for stage in swarm.peers]
        extra = {n: s for n, (s, _) in swarm.extra.items() if n in weights}
        for name, chain in pipelines(layout, extra).items():
            if all(n in weights for n in chain):
                verdict.losses[name] = await asyncio.to_thread(pipeline_loss, self.run,
                                                               [weights[n] for n in chain], self.batches)
        return verdict


@contextlib.asynccontextmanager
async def honest_peer(att: Attacker, name: str, stage: int,
                      timeout: float = 120.0) -> AsyncIterator[tuple[PeerProcess, dict[str, Any]]]:
    """An honest peer of the attacked swarm's run joining it for part of an attack (a joiner, an extra replica):
    yields it and its /status once it trains; it is judged with the swarm while it lives, and reaped on exit."""
    assert att.swarm is not None, "the attacker has no swarm"
    peer = att.swarm.spawn(name, stage, att.initial)
    att.swarm.extra[name] = (stage, peer)
    try:
        status = await asyncio.to_thread(peer.wait_status, lambda st: st.get("state") == "training", timeout,
                                         f"{name} training")
        yield peer, status
    finally:
        att.swarm.extra.pop(name, None)
        terminate([peer.proc], 10.0)


async def judge_now(att: Attacker) -> None:
    """Judge both swarms now (an attack calls it before its extra peers leave; the driver does it otherwise)."""
    if att.judge is not None:
        await att.judge()
