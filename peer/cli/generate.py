"""`asyncmesh-peer generate`: sample text from a model written by ``asyncmesh-peer export``.

The embedded runs read text as bytes (vocabulary 256), so the prompt is encoded as UTF-8 bytes and the sample decoded
the same way (invalid sequences shown as U+FFFD). Models trained on pre-tokenized ``.bin`` shards have no tokenizer
here and are refused with a message.
"""

from __future__ import annotations

import argparse
import sys

from peer.errors import UserError, user_input

HELP = "Sample text from an exported model (see `asyncmesh-peer export`)."
EPILOG = """examples:
  asyncmesh-peer generate --model model --prompt 'def main('
  asyncmesh-peer generate --model model --prompt 'import ' --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 1
exit codes: 0 printed; 2 bad input (no model folder, a model without a byte tokenizer, bad sampling settings)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="folder written by `asyncmesh-peer export --out`")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens (bytes) to sample")
    p.add_argument("--temperature", type=float, default=1.0, help="0 picks the most likely token (default 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: random)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def run(args: argparse.Namespace) -> int:
    import torch

    from trainer.export import CONFIG, WEIGHTS, load_model, sample

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0")
    if not args.prompt:
        raise UserError("--prompt must not be empty")
    folder = args.model
    with user_input(f"--model {folder} (expected {WEIGHTS} and {CONFIG} from `asyncmesh-peer export`)"):
        model, config = load_model(folder, device=args.device)
    if config.get("tokenizer") != "bytes":
        raise UserError(f"--model {folder}: its tokens are not bytes ({config.get('tokenizer')}); generate only "
                        "encodes text for byte-level models")
    gen = torch.Generator(device=args.device)
    gen.manual_seed(args.seed if args.seed is not None else torch.seed())
    prompt = list(args.prompt.encode("utf-8"))
    out = sample(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    sys.stdout.write(bytes(out).decode("utf-8", errors="replace") + "\n")
    return 0
