"""`asyncmesh-peer`: the command line. It only parses arguments and hands them to one subcommand module.

Each subcommand lives in ``peer/cli/<name>.py`` and exposes ``HELP`` (one line), ``EPILOG`` (examples),
``add_arguments(parser)`` and ``run(args) -> int``. Heavy imports (torch, hivemind) stay inside ``run`` so that
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from peer.errors import UserError

SUBCOMMANDS = ("join", "swarm", "simulate", "monitor", "status", "admit", "export", "generate", "tokenizer",
               "memory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncmesh-peer",
        description="Train one language model together with strangers' GPUs: asynchronous pipeline stages, "
        "asynchronous sparse averaging between replicas, no barrier anywhere.",
        epilog="Start a local swarm on the embedded default run:  asyncmesh-peer swarm --peers 4\n"
        "Join an existing swarm:                            asyncmesh-peer join --stage auto --initial-peers MADDR",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"peer.cli.{name}")
        p = sub.add_parser(
            name, help=module.HELP, description=module.HELP, epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except UserError as e:  # bad input: say what and what to do, no traceback (anything else is a bug: traceback)
        print(f"asyncmesh-peer {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
