"""The operator's terminal dashboard (rich), for one peer or for a local swarm of them.

API (what ``join`` and ``swarm`` use)::

    dash = Dashboard(metrics)                 # one peer: its in-process PeerMetrics
    dash = Dashboard(lambda: snapshots)       # swarm parent: a callable returning a list of /status snapshots
    dash = Dashboard([])                      #   ... or a list it keeps, replaced with dash.update(snapshots)
    task = asyncio.create_task(dash.run())    # draws at ~2 Hz on the event loop until cancelled or stop is set
    dash.render()                             # the rich renderable (tests print it to a recorded Console)

``metrics_source`` is a PeerMetrics, a snapshot dict, a list of snapshots, or a zero-argument callable returning
either: one snapshot draws the single-peer panel, a list the compact multi-peer table (an entry may be ``{"name",
"error"}`` for a child that did not answer, or ``{"name", "phase"}`` for one still starting, ``peer.ops.startup``).
Drawing holds the event loop a few milliseconds per refresh, not the compute thread (docs/dashboard.md). Everything
fits 80 columns; while the peer drains, the state line shows a countdown bar and what is still in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich import box, get_console
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from peer.ids import short_id
from peer.lifecycle import PeerState
from peer.ops.logs import install_fork_guard
from peer.ops.metrics import PeerMetrics
from peer.ops.progress import progress_line
from peer.ops.startup import SHORT_PHASE, STARTING, Phase, phase

Snapshot = dict[str, Any]
Source = PeerMetrics | Snapshot | list[Snapshot] | Callable[[], Snapshot | list[Snapshot]]

SPARK = "▁▂▃▄▅▆▇█"
#: the colour of a peer state (single-peer panel, ``monitor``) and of a start-up phase (``swarm``'s table)
STATE_STYLE: dict[str, str] = {
    PeerState.JOINING: "cyan", PeerState.LOADING_STATE: "cyan", PeerState.TRAINING: "green",
    PeerState.DRAINING: "yellow", PeerState.STOPPED: "red", "unreachable": "red", Phase.WAITING: "dim",
    Phase.STARTING: "cyan", Phase.JOINING_DHT: "cyan", Phase.CHOOSING_STAGE: "cyan", Phase.LOADING_STATE: "cyan",
    Phase.EXITED: "red", Phase.FAILED: "bold red"}


# ---- formatting helpers (pure; unit-tested) -------------------------------------------------------------------------
def human(x: float | None, unit: str = "", digits: int = 1) -> str:
    """1234 -> '1.2k', 5e6 -> '5.0M'; None -> '-'."""
    if x is None:
        return "-"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}f}{suffix}{unit}"
    return f"{x:.{digits}f}{unit}" if isinstance(x, float) and x != int(x) else f"{int(x)}{unit}"


def human_bytes(x: float | None, per: str = "") -> str:
    """Bytes in decimal units: 1500 -> '1.5 kB'."""
    if x is None:
        return "-"
    for div, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if x >= div:
            return f"{x / div:.1f} {suffix}{per}"
    return f"{x:.0f} B{per}"


def duration(seconds: float | None) -> str:
    """75 -> '1m15s'; 4000 -> '1h06m'."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def sparkline(values: Sequence[float], width: int = 24) -> str:
    """The values as block characters, averaged down to at most ``width`` of them (low = low loss)."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [sum(chunk) / len(chunk) for chunk in
                  (values[int(i * step):max(int((i + 1) * step), int(i * step) + 1)] for i in range(width))]
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(SPARK[0 if span == 0 else min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


def _loss(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}")


def swarm_tokens_per_s(snaps: Sequence[Snapshot]) -> float:
    """Swarm throughput: the tokens/s of the stage-0 peers. Every stage counts each token it processes, so summing
    all peers would count a token once per stage; stage 0 counts it when its backward pass has come back."""
    total: float = sum(s.get("tokens_per_s", 0.0) for s in snaps if "error" not in s and s.get("stage") == 0)
    return total


# ---- the dashboard --------------------------------------------------------------------------------------------------
class Dashboard:
    """Live terminal view of a PeerMetrics (one peer) or of a list of snapshots (a local swarm).

    Args:
        metrics_source: see the module docstring.
        console: where to draw; defaults to rich's global console, which is also the one the log handler of
            ``peer.ops.logs.setup_logging`` prints to, so log lines scroll above the dashboard.
        refresh_hz: redraws per second; 2 is smooth enough for figures averaged over 10 s.
        title: shown in the panel's border (e.g. the run name).
        linger_s: one peer: after ``stop`` is set, keep drawing at most this long (beyond the drain deadline) for the
            peer to reach 'stopped'; 30 s covers the final checkpoint and the DHT withdrawal.
    """

    def __init__(self, metrics_source: Source, *, console: Console | None = None, refresh_hz: float = 2.0,
                 title: str = "asyncmesh", linger_s: float = 30.0) -> None:
        if refresh_hz <= 0:
            raise ValueError(f"refresh_hz must be positive, got {refresh_hz}")
        if linger_s < 0:
            raise ValueError(f"linger_s must be >= 0, got {linger_s}")
        self.linger_s = linger_s
        self._drain_end: float | None = None
        self.source = metrics_source
        self.console = console
        self.refresh_hz = refresh_hz
        self.title = title
        self.render_s = 0.0  # wall time of the last render, for the curious

    def update(self, snapshots: Snapshot | list[Snapshot]) -> None:
        """Replace the snapshots shown (swarm parent: after each poll of its children)."""
        self.source = snapshots

    def snapshots(self) -> Snapshot | list[Snapshot]:
        src = self.source
        if isinstance(src, PeerMetrics):
            return src.snapshot()
        return src() if callable(src) else src

    def render(self) -> RenderableType:
        t0 = time.perf_counter()
        snap = self.snapshots()
        out = render_swarm(snap, self.title) if isinstance(snap, list) else render_peer(snap, self.title)
        self.render_s = time.perf_counter() - t0
        return out

    def __rich__(self) -> RenderableType:
        return self.render()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Draw until cancelled or until ``stop`` is set; the last frame stays on the screen.

        For one peer (a PeerMetrics source) a set ``stop`` is not the end: the daemon sets its stop event when Ctrl-C
        or SIGTERM arrives, and the drain that follows is what the operator wants to watch. The dashboard keeps drawing
        until the peer's state is 'stopped', or ``linger_s`` after stop was set (past the drain deadline when one is
        known), whichever comes first.
        """
        install_fork_guard()  # a process forked while we draw must not inherit our console's lock
        console = self.console
        if console is None:
            console = get_console()
        period = 1.0 / self.refresh_hz
        stop_seen: float | None = None
        self._drain_end = None
        with Live(self.render(), console=console, auto_refresh=False, transient=False) as live:
            try:
                while True:
                    live.update(self.render(), refresh=True)
                    if stop is not None and stop.is_set():
                        stop_seen = time.monotonic() if stop_seen is None else stop_seen
                        if self._finished(stop_seen):
                            return
                        await asyncio.sleep(period)
                    elif stop is None:
                        await asyncio.sleep(period)
                    else:
                        try:
                            await asyncio.wait_for(stop.wait(), period)
                        except TimeoutError:
                            pass
            finally:
                live.update(self.render(), refresh=True)

    def _finished(self, stop_seen: float) -> bool:
        src = self.source
        if not isinstance(src, PeerMetrics) or src.state is PeerState.STOPPED:
            return True
        now = time.monotonic()
        limit = stop_seen + self.linger_s
        if src.state is PeerState.DRAINING:
            remaining = src.snapshot()["drain_remaining_s"]
            if self._drain_end is None and remaining is not None:
                self._drain_end = now + remaining  # fixed once: the clamped countdown stops moving at 0
            if self._drain_end is not None:
                limit = max(limit, self._drain_end + self.linger_s)
        return now > limit


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _row(grid: Table, label: str, value: RenderableType) -> None:
    grid.add_row(Text(label, style="bold cyan"), value)


def memory_text(m: dict[str, Any]) -> Text:
    """This stage's memory estimate against the limit, e.g. 'needs 37.0 MB (bf16) of 9.8 GB free GPU memory · fits
    stages 0,1 · peak 32.5 MB' (peak: the GPU's peak allocation); red when the stage served does not fit."""
    est, limit, fits = m.get("estimate_bytes"), m.get("limit_bytes"), m.get("fits")
    text = Text()
    if fits is None:
        return Text(f"not estimated ({m.get('limit_source', '')}): every stage is taken to fit", style="yellow")
    if est is not None:
        text.append(f"needs {human_bytes(est)}", style="bold")
    else:
        text.append("needs " + " / ".join(human_bytes(b) for b in m.get("stage_bytes", [])))
    text.append(f" ({m.get('precision', '?')}) of ")
    text.append(human_bytes(limit) if limit is not None else "?", style="bold")
    text.append(f" {m.get('limit_source', '')} · fits stage{'s' if len(fits) != 1 else ''} "
                + (",".join(map(str, fits)) or "none"))
    if m.get("peak_bytes") is not None:
        text.append(f" · peak {human_bytes(m['peak_bytes'])}")
    if limit is not None and est is not None and est * m.get("headroom", 1.0) > limit:
        text.stylize("bold red")
    return text


def render_peer(s: Snapshot, title: str = "asyncmesh") -> RenderableType:
    """The single-peer panel."""
    c = s.get("counters", {})
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=10, no_wrap=True)
    grid.add_column(ratio=1)
    state = s["state"]
    state_text = Text.assemble((state, f"bold {STATE_STYLE.get(state, 'white')}"),
                               f" for {duration(s.get('state_for_s'))} · up {duration(s.get('uptime_s'))}")
    if not s.get("healthy", True):
        state_text.append("  UNHEALTHY: " + "; ".join(s.get("health_reasons", [])), style="bold red")
    _row(grid, "state", state_text)
    if state == PeerState.DRAINING and s.get("drain_remaining_s") is not None:
        left = s["drain_remaining_s"]
        total = max(left + s.get("state_for_s", 0.0), 1e-9)
        bar = Table.grid(padding=(0, 1))
        bar.add_column(width=30)
        bar.add_column()
        bar.add_row(ProgressBar(total=total, completed=total - left, width=30, complete_style="yellow"),
                    Text(f"{left:.0f} s left · {s.get('inflight', 0)} in flight, {s.get('queued', 0)} queued",
                         style="yellow"))
        _row(grid, "draining", bar)
    _row(grid, "progress", Text.assemble(
        "step ", (f"{s.get('local_step', 0):,}", "bold"), " · ", (human(s.get("tokens_per_s", 0.0)), "bold"),
        " tok/s · ", human(s.get("tokens_total", 0)), " tokens"))
    loss = Text.assemble("train ", (_loss(s.get("train_loss")), "bold"))
    if s.get("train_loss_history"):
        loss.append(" " + sparkline(s["train_loss_history"], 20), style="magenta")
    if s.get("train_loss_avg") is not None:
        loss.append(f" avg {s['train_loss_avg']:.3f}")
    loss.append(" · val ")
    loss.append(_loss(s.get("val_loss")), style="bold")
    loss.append(" " + sparkline(s.get("val_loss_history", []), 12), style="blue")
    _row(grid, "loss", loss)
    tau = s.get("avg_tau")
    _row(grid, "staleness", Text(f"pipeline {s.get('pipeline_delay', 0.0):.1f} steps · averaging τ "
                                 + ("-" if tau is None else f"{tau:.1f} steps")))
    _row(grid, "batches", Text(
        f"in flight {s.get('inflight', 0)} · queued {s.get('queued', 0)} · dropped "
        f"{c.get('microbatches_dropped', 0)} · retries {c.get('retries', 0)} · requeued "
        f"{c.get('microbatches_requeued', 0)}"))
    bpt = s.get("bytes_per_token")
    _row(grid, "network", Text(f"in {human_bytes(s.get('bytes_in_per_s', 0.0), '/s')} · out "
                               f"{human_bytes(s.get('bytes_out_per_s', 0.0), '/s')} · "
                               + ("-" if bpt is None else human_bytes(bpt)) + "/token"))
    group = s.get("avg_group_size")
    _row(grid, "averaging", Text(
        f"rounds {c.get('averaging_rounds_ok', 0)} ok / {c.get('averaging_rounds_failed', 0)} failed · group "
        + ("-" if group is None else str(group)) + " · last τ " + ("-" if tau is None else f"{tau:.1f}")
        + " · mean τ " + _num(s.get("avg_delay_steps"), ".1f") + " · averaged/step "
        + _num(s.get("avg_fraction_per_step"), ".3f")))
    pps = s.get("peers_per_stage", {})
    swarm = Text()
    for i, (stage, n) in enumerate(pps.items()):
        if i:
            swarm.append(" · ")
        mine = s.get("stage") is not None and str(s["stage"]) == str(stage)
        swarm.append(f"stage {stage}: {n}" + (" (me)" if mine else ""),
                     style="bold red" if n == 0 else ("bold" if mine else ""))
    _row(grid, "swarm", swarm if pps else Text("not fetched yet", style="dim"))
    _row(grid, "run", Text(progress_line(s.get("swarm"), duration, human), style="" if s.get("swarm") else "dim"))
    if s.get("memory"):
        _row(grid, "memory", memory_text(s["memory"]))
    if s.get("backup"):
        b = s["backup"]
        _row(grid, "backup", Text(f"copy of stage {b['stage']} at step {b['step']}, {duration(b.get('age_s'))} old",
                                  style="dim"))
    rejected = s.get("rejected", {})
    _row(grid, "rejected", Text(" · ".join(f"{r} {n}" for r, n in sorted(rejected.items())) or "none",
                                style="red" if rejected else "dim"))
    warnings = s.get("warnings", [])[-3:]
    for i, w in enumerate(warnings):
        count = f" (x{w['count']})" if w.get("count", 1) > 1 else ""
        _row(grid, "warning" if i == 0 else "", Text(f"{w['text']}{count} · {duration(w.get('age_s'))} ago",
                                                     style="yellow"))
    stage = "?" if s.get("stage") is None else s["stage"]
    n_stages = s.get("n_stages")
    head = f"{title} · peer {short_id(s.get('peer_id', ''))} · stage {stage}" + (f"/{n_stages}" if n_stages
                                                                                        else "")
    if s.get("access"):
        head += f" · {s['access']} run"
    return Panel(grid, title=head, title_align="left", border_style=STATE_STYLE.get(state, "white"), width=80,
                 subtitle="Ctrl-C drains and exits", subtitle_align="right")


def render_swarm(snaps: Sequence[Snapshot], title: str = "asyncmesh") -> RenderableType:
    """The compact multi-peer table of a local swarm."""
    table = Table(box=box.SIMPLE_HEAD, padding=0, pad_edge=False, show_edge=False)
    columns: tuple[tuple[str, JustifyMethod, int], ...] = (
        ("peer", "left", 9), ("st", "right", 2), ("state", "left", 6), ("step", "right", 6), ("tok/s", "right", 5),
        ("loss", "right", 5), ("val", "right", 5), ("fly/q", "right", 5), ("drop", "right", 4), ("avg", "right", 5),
        ("B/s i/o", "right", 9))
    for name, justify, width in columns:
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis", min_width=width)

    def key(s: Snapshot) -> tuple[bool, int, str]:
        staged = s.get("stage") is not None  # rows without a stage keep their order (peer0, peer1, ...)
        return (not staged, s.get("stage") or 0, s.get("peer_id", "") if staged else "")

    for s in sorted(snaps, key=key):
        if "error" in s:
            table.add_row(str(s.get("name", "?"))[:9], "", Text("down", style="red"))
            continue
        ph = phase(s)
        if "state" not in s:  # a child with no status yet: its start-up phase only
            table.add_row(str(s.get("name", "?"))[:9], "", Text(SHORT_PHASE.get(ph, ph[:6]),
                                                               style=STATE_STYLE.get(ph, "white")))
            continue
        c = s.get("counters", {})
        state = SHORT_PHASE.get(ph, ph[:6]) + ("" if s.get("healthy", True) else "!")
        step = s.get("local_step", 0)
        table.add_row(
            short_id(s.get("peer_id", "")) if s.get("peer_id") else str(s.get("name", "?"))[:9],
            "?" if s.get("stage") is None else str(s["stage"]),
            Text(state, style=STATE_STYLE.get(ph, "white")), str(step) if step < 100_000 else human(step),
            human(s.get("tokens_per_s", 0.0), digits=0), _loss(s.get("train_loss")), _loss(s.get("val_loss")),
            f"{s.get('inflight', 0)}/{s.get('queued', 0)}", str(c.get("microbatches_dropped", 0)),
            f"{c.get('averaging_rounds_ok', 0)}/{c.get('averaging_rounds_failed', 0)}",
            f"{human(s.get('bytes_in_per_s', 0.0), digits=0)}/{human(s.get('bytes_out_per_s', 0.0), digits=0)}")
    live = [s for s in snaps if "error" not in s and "state" in s]
    starting = sum(phase(s) in STARTING for s in snaps if "error" not in s)
    up = sum(phase(s) not in STARTING for s in live)
    losses = [s["train_loss"] for s in live if s.get("train_loss") is not None]
    per_stage: dict[str, int] = {}
    for s in live:
        if s.get("stage") is not None:
            per_stage[str(s["stage"])] = per_stage.get(str(s["stage"]), 0) + 1
    footer = Text.assemble(
        (f"{up}/{len(snaps)} peers up", "bold"), (f" ({starting} starting)" if starting else ""),
        " · stages ",
        " ".join(f"{k}:{v}" for k, v in sorted(per_stage.items())) or "-", " · ",
        (human(swarm_tokens_per_s(snaps)), "bold"), " tok/s · mean loss ",
        (_loss(sum(losses) / len(losses) if losses else None), "bold"))
    warnings = [(short_id(s.get("peer_id", "")), w["text"]) for s in live for w in s.get("warnings", [])[-1:]]
    progress = max((s["swarm"] for s in live if s.get("swarm")), key=lambda p: (p.get("step", 0), p.get("tokens", 0)),
                   default=None)  # every peer computes it from the DHT; the most advanced view is the freshest
    parts: list[RenderableType] = [table, footer, Text(progress_line(progress, duration, human), overflow="ellipsis",
                                                       no_wrap=True, style="" if progress else "dim")]
    parts += [Text(f"{s.get('name', '?')}: not answering ({s['error']})", style="red", overflow="ellipsis",
                   no_wrap=True) for s in snaps if "error" in s]
    parts += [Text(f"{pid}: {text}", style="yellow", overflow="ellipsis", no_wrap=True) for pid, text in warnings[-3:]]
    return Panel(Group(*parts), title=f"{title} · local swarm", title_align="left", width=80,
                 subtitle="Ctrl-C drains every peer", subtitle_align="right")
