"""`asyncmesh-peer admit`: the organiser's tool for closed runs.

``--new-key FILE`` creates the organiser's key and prints the ``[access]`` section to put in the run file. With
``--key FILE --peer-id ID`` it issues a credential admitting that one peer to the run until it expires; the peer
joins with ``--credential FILE``. A credential names the peer id it admits, so it is useless to anyone else, and
expires, so a peer's access lapses unless the organiser renews it.
"""

from __future__ import annotations

import argparse
import base64
import os
from pathlib import Path

from peer.errors import UserError, user_input

HELP = "Closed runs: create the organiser's key, or issue an expiring credential admitting one peer id."
EPILOG = """examples:
  asyncmesh-peer admit --new-key organiser.key           # prints the [access] section for the run file
  asyncmesh-peer admit --key organiser.key --run run.toml --peer-id QmPeer... --days 7 --out peer.credential
  asyncmesh-peer join --run run.toml --credential peer.credential --initial-peers MADDR
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-key", default=None, metavar="FILE", help="create an organiser key (never overwrites)")
    p.add_argument("--key", default=None, metavar="FILE", help="the organiser key that signs the credential")
    p.add_argument("--run", default=None, metavar="FILE", help="the closed run's TOML (default: the embedded run)")
    p.add_argument("--peer-id", default=None, metavar="ID", help="the peer id to admit (its log prints it)")
    p.add_argument("--days", type=float, default=7.0, help="validity in days (default 7)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the credential here (default: print it)")


def run(args: argparse.Namespace) -> int:
    from peer.membership.admission import issue, organiser_key
    from peer.membership.signing import Signer
    from trainer.config import RunConfig

    if args.new_key:
        path = Path(args.new_key)
        if path.exists():
            raise UserError(f"{path} exists; the organiser key must never be replaced silently (choose another path)")
        signer = Signer.generate()
        with user_input(f"--new-key {path}"):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "wb") as f:
                f.write(signer.private_protobuf())
        print("# add to the run file (every peer of the run must use the same file):")
        print("[access]")
        print('mode = "closed"')
        print(f'organiser_key = "{base64.b64encode(signer.public_key).decode()}"')
        return 0
    if not args.key or not args.peer_id:
        raise UserError("pass --new-key FILE to create an organiser key, or --key FILE --peer-id ID to admit a peer")
    if not args.days > 0:
        raise UserError(f"--days must be positive, got {args.days}")
    with user_input("--run"):
        run_config = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    key = organiser_key(run_config)
    if key is None:
        raise UserError(f"run {run_config.run_id} is open (no [access] mode = \"closed\"): it needs no credentials")
    with user_input(f"--key {args.key}"):
        signer = Signer.from_identity_file(Path(args.key))
    if signer.public_key != key:
        raise UserError(f"--key {args.key} is not this run's organiser key (the run file names another public key)")
    credential = issue(signer, run_id=run_config.run_id, peer_id=args.peer_id, valid_s=args.days * 86400)
    text = base64.b64encode(credential).decode()
    if args.out:
        with user_input(f"--out {args.out}"):
            Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0
