"""How one peer process runs: everything a volunteer may set on the command line, as one validated dataclass.

The run (model, optimiser, averaging, data) is ``trainer.config.RunConfig`` and is shared by the whole swarm; a
``PeerConfig`` holds only what may differ between peers: addresses, identity, device, stage, timeouts and budgets.
The CLI only builds this dataclass; the daemon reads nothing else.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

from peer.compute import DevicePace
from peer.membership.relay import RelayMode
from peer.membership.relay import check_modes as check_relay_modes

E = TypeVar("E", bound=StrEnum)


class Mode(StrEnum):
    """How a swarm trains: every peer of one swarm runs the same mode."""

    ASYNC = "async"
    """No barrier anywhere (the product)."""
    SYNC = "sync"
    """GPipe flush and a full gradient average every step (the baseline it is compared with)."""


class Device(StrEnum):
    """Where a peer computes (``trainer.worker.resolve_device`` resolves AUTO)."""

    AUTO = "auto"
    CUDA = "cuda"
    CPU = "cpu"


class Precision(StrEnum):
    """How a peer computes (``trainer.worker.PRECISIONS``, kept torch-free here)."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"


class SyncOptimizer(StrEnum):
    """The sync baseline's optimiser."""

    ADAMW = "adamw"
    NADAM = "nadam"


MODES = tuple(m.value for m in Mode)
MAX_RECORD_TTL_S = 60.0
"""The furthest ahead a DHT record may expire: every node refuses later expirations (membership/signing.py)."""
DEVICES = tuple(d.value for d in Device)
PRECISIONS = tuple(p.value for p in Precision)


def _member(kind: type[E], value: object, flag: str) -> E:
    """``value`` (a member, or the string a config file or the command line gives) as a member of ``kind``."""
    names = tuple(m.value for m in kind)
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{flag} must be one of {names}, got {value!r}")
    return kind(value)


def default_home() -> Path:
    """Where a peer keeps its identity key and checkpoints unless told otherwise (``$ASYNCMESH_HOME``)."""
    return Path(os.environ.get("ASYNCMESH_HOME", Path.home() / ".asyncmesh"))


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """One peer process. Timeouts are in seconds."""

    stage: int | None = None
    """Pipeline stage to serve; None chooses automatically from the swarm's announced throughput."""
    throughput: float = 0.0
    """Work units per second this peer announces (a stage's cost per micro-batch over its compute seconds, as
    ``peer/pipeline/meter.py`` measures it); 0 announces the measured figure. A fixed figure (petals' ``--throughput``)
    suits a peer sharing its machine, whose measured speed swings with its neighbours' load. Stage choice and
    rebalancing read it; routing measures every hop itself and reads it only until then."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of running peers to join through; empty starts a new swarm."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs to listen on; port 0 picks a free port."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs others should dial (a public IP or port forward); empty announces what libp2p observes."""
    identity_path: Path = field(default_factory=lambda: default_home() / "identity.key")
    """Private key file that fixes this peer's id across restarts; created on first start."""
    checkpoint_dir: Path | None = None
    """Directory for periodic and final checkpoints; None disables checkpoints."""
    data_path: str | None = None
    """Overrides the run's data source (text files, a folder, or .bin shards)."""
    device: Device = Device.AUTO
    """'auto' (cuda when available), 'cuda' or 'cpu'."""
    precision: Precision = Precision.AUTO
    """'auto' (bf16 autocast on CUDA, fp32 on the CPU), 'fp32', or 'bf16' (autocast; fp32 master weights and
    optimiser state). Peers of one swarm may differ: what crosses the wire is the same."""
    memory_gb: float = 0.0
    """Memory this peer may use for its stage, in GiB; 0 detects it (the GPU's free memory on CUDA, the machine's
    available memory on the CPU). Stages that do not fit are never chosen (peer/budget.py)."""
    mode: Mode = Mode.ASYNC
    """'async' (no barrier anywhere) or 'sync' (GPipe flush and full gradient average every step, for comparison)."""
    max_steps: int = 0
    """Stop after this many local optimiser steps (0: run until stopped)."""
    max_inflight: int = 0
    """Stage 0: micro-batches in flight at once; 0 uses n_stages + 1."""
    sync_microbatches: int = 4
    """Sync mode: micro-batches per flush (GPipe M)."""
    sync_optimizer: SyncOptimizer = SyncOptimizer.ADAMW
    """Sync mode: the baseline's optimiser, 'adamw' (beta1 0.9, the papers' GPipe baseline) or 'nadam' (beta1 0.99).
    Its warm-up and schedule are the run's divided by sync_microbatches (the same samples as the async mode's)."""
    sync_lr: float = 0.0
    """Sync mode: the baseline's peak learning rate (0: the run's); docs/convergence.md has the sweep that chose it."""
    max_queue: int = 16
    """Work items a peer queues for its compute thread before answering Busy (backpressure)."""
    eval_every_s: float = 10.0
    """Stage 0: send the fixed validation batches this often (0 disables evaluation)."""
    eval_batches: int = 2
    """Validation micro-batches per evaluation."""
    announce_every_s: float = 5.0
    """Re-announce this peer's DHT record this often."""
    record_ttl_s: float = 20.0
    """A DHT record expires this long after its announcement (a dead peer vanishes from routing after it)."""
    dht_timeout_s: float = 5.0
    """Hard timeout on one DHT read."""
    gossip_every_s: float = 10.0
    """Ask one peer for the swarm's signed records this often (peer/membership/gossip.py: a DHT that withholds
    records cannot hide the swarm); 0 disables."""
    rpc_timeout_s: float = 10.0
    """Timeout of one forward/backward RPC."""
    microbatch_timeout_s: float = 60.0
    """A micro-batch whose gradient has not come back after this long is dropped (and re-queued on stage 0)."""
    hop_retries: int = 4
    """Other peers tried for one hop before the micro-batch is dropped."""
    ban_base_s: float = 2.0
    """First ban of a failing peer; doubles per consecutive failure up to ban_max_s."""
    ban_max_s: float = 60.0
    """Longest ban of a failing peer."""
    keep_stream_min_bytes: int = 256 * 1024
    """A request to a known peer at least this large keeps its stream for the next one to the same handler (protocol
    13, ``RpcLimits.keep_min_bytes``: a fresh stream's window starts at 256 KiB and grows per round trip); 0 never.
    Measured on the emulated WAN at 101 ms RTT (docs/performance.md, "With kept streams"): FullSync's barriers of
    1.7 MB made 29 % more tokens/s at 2 x 2, and at 2 x 4 as many or more once the barrier's forks were fixed."""
    rebalance_every_s: float = 60.0
    """How often a peer checks whether moving to another stage would help the swarm (0 disables)."""
    rebalance_quality: float = 0.75
    """Hysteresis: move only if the slowest stage's capacity would rise above current / quality."""
    rebalance_settle_s: float = 2.0
    """A peer about to move announces its claim ('draining'), waits this long for it to reach the DHT, then re-reads
    the swarm and backs off if its stage would empty or another peer of its stage claimed too."""
    rebalance_cooldown_s: float = 120.0
    """No move decision for this long (plus up to as much again at random) after joining, moving or backing off."""
    join_jitter_s: float = 1.0
    """Random wait before acting on a stage choice, then re-check (spreads peers that join at the same time)."""
    checkpoint_every_s: float = 120.0
    """Periodic checkpoint interval when checkpoint_dir is set (0: only the final checkpoint)."""
    backup_every_s: float = 120.0
    """Keep a copy of the next stage's state, refreshed this often, so that stage survives losing all its peers
    (0: off). Low priority: skipped while busy; the copy goes to checkpoint_dir when set, else memory."""
    drain_timeout_s: float = 10.0
    """On SIGTERM: wait this long for in-flight micro-batches before the final checkpoint."""
    state_load_timeout_s: float = 60.0
    """Give up loading state from donors after this long and fall back to a checkpoint or the seeded init."""
    state_snapshot_max_age_s: float = 60.0
    """Serving state: reuse one snapshot for joiners arriving within this many seconds (bounds copies in memory)."""
    reachability_timeout_s: float = 10.0
    """Dial-back timeout of the reachability self-check."""
    summary_json: Path | None = None
    """Write a JSON summary (tokens/s, losses, counters) here on exit."""
    samples_log: Path | None = None
    """Stage 0: append one line per trained micro-batch here (a digest of its tokens), flushed at once, so an
    operator can audit across restarts which samples were trained and how often (``--set samples_log=FILE``)."""
    maddrs_file: Path | None = None
    """Write this peer's multiaddrs here (one a line) once it is listening (launchers and tests read it)."""
    metrics_port: int | None = None
    """Serve the status endpoint on this port (None disables)."""
    metrics_host: str = field(default_factory=lambda: os.environ.get("ASYNCMESH_METRICS_HOST", "127.0.0.1"))
    """Interface of the status endpoint: 127.0.0.1 keeps it on this machine; the Docker image sets 0.0.0.0 (through
    ASYNCMESH_METRICS_HOST) so that its published port can be scraped."""
    torch_threads: int = 0
    """Intra-op CPU threads of the compute thread (0 keeps torch's default; 1 when many peers share a machine)."""
    compute_pace: float = 0.0
    """Test beds only: every compute job lasts this many times the CPU time it used, so that each of many peers on a
    few shared cores behaves as a device of its own, 1/compute_pace the speed of one core (peer/compute.py,
    ``DevicePace``; 0: off). Needs torch_threads = 1 and the CPU."""
    relay: RelayMode = RelayMode.AUTO
    """Listen through a circuit relay: 'auto' (when the reachability check finds us unreachable), 'on', 'off'."""
    relay_service: RelayMode = RelayMode.AUTO
    """Relay for peers behind NAT: 'auto' (when libp2p's AutoNAT finds us public), 'on' (a public organiser's peer),
    'off'."""
    relays: tuple[str, ...] = ()
    """Full multiaddrs of the peers to reserve a relay slot at; empty uses initial_peers."""
    use_ipfs: bool = False
    """Bootstrap through the public IPFS DHT (for NAT traversal); off for private swarms and tests."""
    spot_checks: bool = True
    """Check the next stage's replicas against each other (peer/pipeline/spotcheck.py); off only to measure cost."""
    spot_check_fraction: float = 0.05
    """Share of a trusted next hop's micro-batches also sent to a second replica and compared (untrusted: all)."""
    spot_check_min_cosine: float = 0.1
    """Cosine similarity between two replicas' gradients of one micro-batch below which one of them is blamed."""
    rechecks: bool = True
    """Re-compute a sample of the next stage's work from the held copy of it, with backup_every_s > 0 and spot checks
    on: the last stage's gradients (peer/pipeline/recheck.py), a middle stage's output and gradient with the
    testimony of the peer it sent them on to (peer/pipeline/testimony.py), and in a 2-stage run stage 0's forwards
    (peer/pipeline/fwdcheck.py); off frees the copy's module and compute."""
    recheck_after_warmups: float = 4.0
    """Re-checks use only copies received once this peer's local step reached this many times the run's warm-up
    steps: against a copy of a stage that young, honest gradients failed re-checks (2 of 392 comparisons in the
    tiny run, docs/security.md), and 3 failures in a row would ban an honest lone next stage."""
    recheck_fraction: float = 0.02
    """Share of a trusted next hop's micro-batches whose gradient is re-computed from the held copy (untrusted:
    every one)."""
    recheck_min_cosine: float = 0.1
    """Cosine similarity between a returned gradient and the held copy's below which the hop is blamed."""
    credential_path: Path | None = None
    """Closed runs: this peer's admission credential from the organiser (`asyncmesh-peer admit`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_peers", tuple(self.initial_peers))
        object.__setattr__(self, "host_maddrs", tuple(self.host_maddrs))
        object.__setattr__(self, "announce_maddrs", tuple(self.announce_maddrs))
        object.__setattr__(self, "relays", tuple(self.relays))
        relay, relay_service = check_relay_modes(self.relay, self.relay_service)
        object.__setattr__(self, "relay", relay)
        object.__setattr__(self, "relay_service", relay_service)
        object.__setattr__(self, "identity_path", Path(self.identity_path))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        for name in ("summary_json", "maddrs_file", "credential_path", "samples_log"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"--stage must be 'auto' or a non-negative integer, got {self.stage}")
        object.__setattr__(self, "device", _member(Device, self.device, "--device"))
        object.__setattr__(self, "precision", _member(Precision, self.precision, "--precision"))
        if not (math.isfinite(self.throughput) and self.throughput >= 0):
            raise ValueError(f"throughput must be a finite number >= 0 (0: measured), got {self.throughput}")
        if not self.memory_gb >= 0:
            raise ValueError(f"--memory-gb must be >= 0 (0 detects it), got {self.memory_gb}")
        object.__setattr__(self, "mode", _member(Mode, self.mode, "--mode"))
        for name in ("max_steps", "max_inflight", "torch_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.compute_pace:
            DevicePace(self.compute_pace)  # its own check of the factor
            if self.torch_threads != 1 or self.device == Device.CUDA:
                raise ValueError(f"compute_pace ({self.compute_pace:g}) times the compute thread's own CPU time: it "
                                 "needs --torch-threads 1 and --device cpu")
        if self.keep_stream_min_bytes < 0:
            raise ValueError(f"keep_stream_min_bytes must be >= 0 (0: never keep a stream), got "
                             f"{self.keep_stream_min_bytes}")
        for name in ("sync_microbatches", "max_queue", "hop_retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("announce_every_s", "record_ttl_s", "dht_timeout_s", "rpc_timeout_s", "microbatch_timeout_s",
                     "ban_base_s", "ban_max_s", "drain_timeout_s", "state_load_timeout_s", "reachability_timeout_s",
                     "state_snapshot_max_age_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive (seconds), got {getattr(self, name)}")
        for name in ("eval_every_s", "rebalance_every_s", "join_jitter_s", "checkpoint_every_s", "rebalance_settle_s",
                     "rebalance_cooldown_s", "backup_every_s", "gossip_every_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (seconds; 0 disables), got {getattr(self, name)}")
        if self.record_ttl_s > MAX_RECORD_TTL_S:
            raise ValueError(f"record_ttl_s ({self.record_ttl_s}) must be at most {MAX_RECORD_TTL_S:.0f} s: other "
                             "peers refuse records that expire later")
        if self.record_ttl_s <= self.announce_every_s:
            raise ValueError(f"record_ttl_s ({self.record_ttl_s}) must exceed announce_every_s "
                             f"({self.announce_every_s}) or the record expires between announcements")
        if not 0.0 < self.rebalance_quality <= 1.0:
            raise ValueError(f"rebalance_quality must be in (0, 1], got {self.rebalance_quality}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be a TCP port (0-65535), got {self.metrics_port}")
        if self.sync_optimizer not in tuple(o.value for o in SyncOptimizer) or self.sync_lr < 0:
            raise ValueError(f"sync_optimizer must be 'adamw' or 'nadam' and sync_lr >= 0 (0: the run's lr), got "
                             f"{self.sync_optimizer!r}, {self.sync_lr}")
        object.__setattr__(self, "sync_optimizer", SyncOptimizer(self.sync_optimizer))
        if not 0.0 <= self.spot_check_fraction <= 1.0 or not -1.0 <= self.spot_check_min_cosine < 1.0:
            raise ValueError("spot_check_fraction must be in [0, 1] and spot_check_min_cosine in [-1, 1)")
        if not 0.0 <= self.recheck_fraction <= 1.0 or not -1.0 <= self.recheck_min_cosine < 1.0:
            raise ValueError("recheck_fraction must be in [0, 1] and recheck_min_cosine in [-1, 1)")
        if not 0.0 <= self.recheck_after_warmups < math.inf:
            raise ValueError(f"recheck_after_warmups must be finite and >= 0, got {self.recheck_after_warmups}")
        if self.ban_max_s < self.ban_base_s:
            raise ValueError("ban_max_s must be >= ban_base_s")

    def inflight_for(self, n_stages: int) -> int:
        """Micro-batches stage 0 keeps in flight: enough to fill the pipeline unless set explicitly."""
        return self.max_inflight or n_stages + 1
