#!/usr/bin/env python3
"""A NAT lab in network namespaces: one public host and home networks behind a masquerading router.

Topology (every namespace named ``<prefix><pid>-<role>``, so a run never touches namespaces it did not create)::

    pub  PUBLIC.1 ──veth── PUBLIC.254  rtr  10.7k.0.1 ──veth── 10.7k.0.2  home k   (k = 0 .. homes-1)

``pub`` stands for the internet side (the organiser's peer). ``rtr`` is every home's router: it forwards between its
links, rewrites each home's outgoing connections to its own public address (iptables MASQUERADE) and drops new
connections from the internet side into a home (no port forwarding), and between homes. A peer in a home can dial
``pub``; nothing can dial the home's address. The public side uses ``PUBLIC`` (default 11.77.0, addresses that
exist only inside these namespaces): libp2p builds relayed addresses only from a relay's public addresses, so a lab
on private ranges cannot exercise the relay.

``NatLab`` is a context manager owning all it starts: leaving the ``with`` block, normally or on an exception,
terminates the commands started with ``popen``, kills anything left inside its namespaces and deletes them.
Needs root, ``ip`` and ``iptables``. ``python tools/natlab.py clean`` deletes namespaces of killed runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # run as a script: make the packages importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.ops.procs import terminate  # noqa: E402 - one place reaps child processes
from tools.wan import _setns  # noqa: E402 - one way into a network namespace

T = TypeVar("T")
PREFIX = "amn"
LINGER_S = 3.0  # after its commands exit, wait this long for their children (DHT process, p2pd) to leave


class NatLabError(RuntimeError):
    """The lab cannot be set up (the message says what is missing)."""


def check_available() -> str | None:
    """None when this machine can build the lab, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is missing (apt-get install iproute2 iptables)"
    return None


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


class NatLab:
    """``pub`` + ``rtr`` + ``homes`` home namespaces (see the module docstring). Idempotent ``close``."""

    def __init__(self, *, homes: int = 1, public: str = "11.77.0", stop_timeout_s: float = 10.0) -> None:
        if not 1 <= homes <= 9:
            raise ValueError(f"homes must be between 1 and 9, got {homes}")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", public):
            raise ValueError(f"public must be three octets, got {public!r}")
        self.homes, self.public, self.stop_timeout_s = homes, public, stop_timeout_s
        tag = f"{PREFIX}{os.getpid()}"
        self.pub, self.rtr = f"{tag}-pub", f"{tag}-rtr"
        self.home = [f"{tag}-h{k}" for k in range(homes)]
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []

    # ----- addresses -------------------------------------------------------------------------------------------------
    @property
    def pub_ip(self) -> str:
        return f"{self.public}.1"

    @property
    def router_ip(self) -> str:
        """The routers's public address: where every home peer's connections come from."""
        return f"{self.public}.254"

    def home_ip(self, k: int) -> str:
        return f"10.{70 + k}.0.2"

    # ----- life ------------------------------------------------------------------------------------------------------
    def __enter__(self) -> NatLab:
        reason = check_available()
        if reason:
            raise NatLabError(reason)
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _must(self, *cmd: str) -> None:
        res = _run(*cmd)
        if res.returncode != 0:
            raise NatLabError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")

    def _up(self) -> None:
        for name in [self.pub, self.rtr, *self.home]:
            self._must("ip", "netns", "add", name)
            self.created.append(name)
            self._must("ip", "-n", name, "link", "set", "lo", "up")
        tag = self.pub.rsplit("-", 1)[0][-8:]
        links = [(self.pub, f"{self.public}.1/24", f"{self.public}.254/24", None)]
        links += [(h, f"{self.home_ip(k)}/24", f"10.{70 + k}.0.1/24", f"10.{70 + k}.0.1")
                  for k, h in enumerate(self.home)]
        for i, (ns, addr, router_addr, gateway) in enumerate(links):
            inner, outer = f"v{tag}a{i}", f"v{tag}b{i}"  # created in the root namespace, moved out at once
            self._must("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            self._must("ip", "link", "set", inner, "netns", ns)
            self._must("ip", "link", "set", outer, "netns", self.rtr)
            self._must("ip", "-n", ns, "addr", "add", addr, "dev", inner)
            self._must("ip", "-n", ns, "link", "set", inner, "up")
            self._must("ip", "-n", self.rtr, "addr", "add", router_addr, "dev", outer)
            self._must("ip", "-n", self.rtr, "link", "set", outer, "up")
            if gateway is not None:
                self._must("ip", "-n", ns, "route", "add", "default", "via", gateway)
        wan = f"v{tag}b0"
        ipt = ["ip", "netns", "exec", self.rtr, "iptables"]
        self._must("ip", "netns", "exec", self.rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._must(*ipt, "-P", "FORWARD", "DROP")
        self._must(*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        for k in range(self.homes):
            lan = f"v{tag}b{k + 1}"
            self._must(*ipt, "-A", "FORWARD", "-i", lan, "-o", wan, "-j", "ACCEPT")  # homes dial out, nothing else
            self._must(*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", f"10.{70 + k}.0.0/24", "-o", wan,
                       "-j", "MASQUERADE")

    def close(self) -> None:
        """Terminate commands, kill what is left in our namespaces, delete them. Never raises for a lost part."""
        terminate(self.procs, self.stop_timeout_s)
        deadline = time.monotonic() + LINGER_S
        while self.created and self._pids_inside() and time.monotonic() < deadline:
            time.sleep(0.1)
        for _, pid in self._pids_inside():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for name in list(self.created):
            res = _run("ip", "netns", "delete", name)
            if res.returncode == 0 or "No such file" in res.stderr:
                self.created.remove(name)

    def _pids_inside(self) -> list[tuple[str, str]]:
        return [(n, pid) for n in self.created for pid in _run("ip", "netns", "pids", n).stdout.split()]

    # ----- use -------------------------------------------------------------------------------------------------------
    def popen(self, ns: str, cmd: list[str], **kw: Any) -> subprocess.Popen:
        """Start ``cmd`` inside namespace ``ns`` (its own session, so its group can be killed)."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kw)
        self.procs.append(proc)
        return proc

    def call_in(self, ns: str, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
        """Run ``fn()`` on a thread moved into namespace ``ns`` (sockets it opens stay there)."""
        out: dict[str, Any] = {}

        def target() -> None:
            try:
                _setns(ns)
                out["value"] = fn()
            except BaseException as e:  # handed to the caller
                out["error"] = e

        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"call in namespace {ns} did not finish within {timeout:.0f} s")
        if "error" in out:
            raise out["error"]
        return out["value"]

    def link_bytes(self) -> dict[str, int]:
        """Bytes through the router's link to each namespace (rx + tx), keyed by namespace: a home's link carries
        all its peer's traffic; the public link also carries every relayed byte twice (into the relay and out)."""
        tag = self.pub.rsplit("-", 1)[0][-8:]
        out = {}
        for k, ns in enumerate([self.pub, *self.home]):
            res = _run("ip", "-n", self.rtr, "-j", "-s", "link", "show", "dev", f"v{tag}b{k}")
            stats = json.loads(res.stdout)[0]["stats64"]
            out[ns] = int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])
        return out

def clean_leftovers() -> list[str]:
    """Delete namespaces ``<PREFIX><pid>-*`` whose creating process no longer runs; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(PREFIX + r"(\d+)-\w+", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            for pid in _run("ip", "netns", "pids", name).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if _run("ip", "netns", "delete", name).returncode == 0:
                removed.append(name)
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="NAT lab (network namespaces + iptables MASQUERADE): clean up.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("clean", help="delete namespaces left behind by killed runs")
    p.parse_args(argv)
    removed = clean_leftovers()
    print(f"deleted {len(removed)} leftover namespaces: {' '.join(removed) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
