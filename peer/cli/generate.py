"""`asyncmesh-peer generate`: sample text from an exported model, or through a live swarm's pipeline.

With ``--model`` it samples a model written by ``asyncmesh-peer export``: a safetensors export with this package's
own model code, or a Hugging Face folder (``--format hf``, or any causal LM folder) through transformers, encoding the
prompt and decoding the sample with the folder's own tokenizer. With ``--initial-peers`` it joins the
swarm's DHT as a client (it serves and stores nothing, like ``monitor``), reads the run's peer records and, for every
new token, sends the context through stage 0, 1, ..., K-1 with the forward-only ``infer`` RPC and samples from the
last stage's logits (``peer.pipeline.remote``); no model is downloaded and nothing is trained. Sampling is the same
function either way (``trainer.export.next_token``), so equal logits and an equal ``--seed`` give an equal sample.

Text is encoded with the model's tokenizer: a Hugging Face folder's own, the run's ``data.tokenizer`` through a live
swarm, UTF-8 bytes for byte-level runs (invalid sequences shown as U+FFFD). Models trained on pre-tokenized ``.bin``
shards have no tokenizer in a safetensors export and are refused with a message; export them with
``--format hf --tokenizer FILE`` instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from peer.errors import UserError, user_input

if TYPE_CHECKING:
    import torch

    from trainer.config import RunConfig
    from trainer.tokenizer import Tokenizer

HELP = "Sample text from an exported model, or through a live swarm's pipeline (forward only)."
EPILOG = """examples:
  asyncmesh-peer generate --model model --prompt 'def main('
  asyncmesh-peer generate --model model --prompt 'import ' --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 1
  through a running swarm, without exporting (every stage computes each token's forward):
    asyncmesh-peer generate --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... --run myrun.toml \\
        --prompt 'def main(' --max-new-tokens 50
exit codes: 0 printed; 2 bad input (no model folder, a model or run without a byte tokenizer, bad sampling settings,
  an unreachable --initial-peers, a swarm of another run, a closed run); 3 the swarm could not serve (a stage has no
  training peer, or none answered within --timeout; what was generated so far is printed): try again later"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="DIR",
                        help="folder written by `asyncmesh-peer export --out` (either --format)")
    source.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                        help="generate through the live swarm these peers belong to (an open run)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens (bytes) to sample")
    p.add_argument("--temperature", type=float, default=1.0, help="0 picks the most likely token (default 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: random)")
    p.add_argument("--device", default="cpu", help="--model: cpu (default) or cuda")
    live = p.add_argument_group("through a live swarm (--initial-peers)")
    live.add_argument("--run", default=None, metavar="FILE", help="the run file the peers train (default: embedded)")
    live.add_argument("--codec", default=None,
                      help="how the stages send activations and logits back: the run's activation codec (default), "
                           "fp16 or none (fp32)")
    live.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to find every stage's peers, and for each token through every stage (default 30)")


def run(args: argparse.Namespace) -> int:
    import torch

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0")
    if not args.prompt:
        raise UserError("--prompt must not be empty")
    gen = torch.Generator(device=args.device if args.model else "cpu")
    gen.manual_seed(args.seed if args.seed is not None else torch.seed())
    if args.initial_peers:
        return _live(args, gen)
    prompt = list(args.prompt.encode("utf-8"))

    from trainer.export import CONFIG, WEIGHTS, load_model, sample
    from trainer.hf import is_hf_folder

    folder = args.model
    if is_hf_folder(folder):
        return _generate_hf(args, gen)
    with user_input(f"--model {folder} (expected {WEIGHTS} and {CONFIG} from `asyncmesh-peer export`)"):
        model, config = load_model(folder, device=args.device)
    if config.get("tokenizer") != "bytes":
        raise UserError(f"--model {folder}: its tokens are not bytes ({config.get('tokenizer')}); export it with "
                        "its tokenizer (`asyncmesh-peer export --format hf --tokenizer FILE`) and generate from that")
    out = sample(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    sys.stdout.write(bytes(out).decode("utf-8", errors="replace") + "\n")
    return 0


def _generate_hf(args: argparse.Namespace, gen: torch.Generator) -> int:
    """Sample a Hugging Face folder through transformers, with its own tokenizer."""
    from trainer.export import sample
    from trainer.hf import load_hf, quiet
    from trainer.tokenizer import MissingExtra

    try:
        quiet()
        with user_input(f"--model {args.model}"):
            model, tok, block_size = load_hf(args.model, device=args.device)
    except MissingExtra as e:
        raise UserError(str(e)) from None
    prompt = tok(args.prompt, add_special_tokens=False)["input_ids"]
    if not prompt:
        raise UserError(f"--prompt {args.prompt!r} encodes to no token with the tokenizer of {args.model}")
    out = sample(lambda idx: model(idx).logits, prompt, args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, generator=gen, block_size=block_size, device=args.device)
    sys.stdout.write(tok.decode(out) + "\n")
    return 0


def _live(args: argparse.Namespace, gen: torch.Generator) -> int:
    """Generate through the swarm at ``--initial-peers``, printing the text as it comes."""
    import uvloop

    from peer.cli.checks import check_multiaddrs
    from trainer.config import RunConfig
    from trainer.tokenizer import MissingExtra, load_tokenizer

    with user_input(f"--run {args.run}" if args.run else ""):
        run_cfg = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    if run_cfg.data.bin_vocab_size != 0:
        raise UserError(f"run {run_cfg.name!r} reads pre-tokenized .bin shards and names no tokenizer, so a text "
                        "prompt cannot be encoded for it: export the model with `asyncmesh-peer export --format hf "
                        "--tokenizer FILE` and generate from that folder with --model")
    try:
        with user_input(f"--run {args.run}: data.tokenizer {run_cfg.data.tokenizer}"):
            tok = load_tokenizer(run_cfg.data)
    except MissingExtra as e:
        raise UserError(str(e)) from None
    prompt = tok.encode_batch([args.prompt])[0]
    if not prompt:
        raise UserError(f"--prompt {args.prompt!r} encodes to no token with the run's tokenizer")
    if run_cfg.access.mode == "closed":
        raise UserError(f"run {run_cfg.name!r} is closed: its peers serve only admitted peers; export the model from "
                        "their checkpoints (asyncmesh-peer export --checkpoint-dir) and generate with --model")
    check_multiaddrs("--initial-peers", args.initial_peers, need_peer_id=True)
    from peer.pipeline.infer import infer_codecs

    if args.codec is not None and args.codec not in infer_codecs(run_cfg):
        raise UserError(f"--codec {args.codec}: the peers reply in one of {', '.join(infer_codecs(run_cfg))}")
    if args.timeout <= 0:
        raise UserError(f"--timeout must be positive (seconds), got {args.timeout}")
    return uvloop.run(_generate(args, run_cfg, tok, prompt, gen))


class _TextOut:
    """Writes a growing token sequence as text: each call prints what the new tokens added, holding back a
    trailing incomplete character (U+FFFD) until the tokens that complete it arrive."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.shown = tok, list[int](), 0

    def add(self, ids: list[int], *, final: bool = False) -> None:
        self.ids += ids
        text = self.tok.decode(self.ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        if end > self.shown:
            sys.stdout.write(text[self.shown : end])
            sys.stdout.flush()
            self.shown = end


async def _generate(args: argparse.Namespace, run_cfg: RunConfig, tok: Tokenizer, prompt: list[int],
                    gen: torch.Generator) -> int:
    import asyncio

    from hivemind import DHT

    from peer.handlers.sizes import infer_message_bytes
    from peer.ids import short_id
    from peer.membership.admission import organiser_key
    from peer.membership.records import fetch_swarm, record_validator
    from peer.membership.vouches import ask_vouches, peer_ids_of
    from peer.pipeline.remote import RemotePipeline, rpc_call
    from trainer.export import next_token

    try:
        dht = await asyncio.to_thread(DHT, initial_peers=list(args.initial_peers), client_mode=True, start=True,
                                      record_validators=[record_validator(run_cfg.run_id, organiser_key(run_cfg))])
    except Exception as e:  # a bad multiaddr or an unreachable bootstrap peer
        raise UserError(f"could not join the DHT through {' '.join(args.initial_peers)}: {e}. Check the "
                        "multiaddrs (copy them from a running peer's log) and that the peer is reachable") from e
    out = _TextOut(tok)
    written = False
    try:
        p2p = await dht.replicate_p2p()
        sizes = infer_message_bytes(run_cfg)
        pipe = RemotePipeline(run=run_cfg, call=rpc_call(p2p, max(*sizes.values(), 2**20)), codec=args.codec,
                              read_swarm=lambda: fetch_swarm(dht, run_cfg.run_id, timeout=min(10.0, args.timeout)),
                              timeout_s=args.timeout, where=args.initial_peers[0])
        await pipe.refresh()
        anchors = peer_ids_of(list(args.initial_peers))
        if not pipe.records:  # nobody of this run: perhaps the swarm trains another run (a wrong --run)
            await pipe.probe_run(anchors)
        await pipe.wait_for_stages(args.timeout)
        vouched = await ask_vouches(anchors, run_cfg.run_id, lambda pid, name, msg: pipe.call(
            pid, name, msg, min(10.0, args.timeout)), lambda name, n: None)
        for stage, excluded in (await pipe.witness_stages(vouched)).items():
            if excluded:
                print(f"asyncmesh-peer generate: stage {stage}: not using {', '.join(map(short_id, excluded))}: "
                      "no peer the initial peers vouch for, or the stage's other replicas, vouches for its "
                      "state", file=sys.stderr)
        ids, t0 = list(prompt), time.monotonic()
        out.add(prompt)
        written = True
        for _ in range(args.max_new_tokens):
            logits = await pipe.next_logits(ids)
            token = int(next_token(logits, temperature=args.temperature, top_k=args.top_k, generator=gen))
            ids.append(token)
            out.add([token])
        out.add([], final=True)
        sys.stdout.write("\n")
        n = len(ids) - len(prompt)
        if n:
            took = time.monotonic() - t0
            used = ", ".join(f"stage {s} step {h.version} ({short_id(h.peer_id)})" for s, h in enumerate(pipe.hops))
            print(f"asyncmesh-peer generate: {n} tokens in {took:.1f} s ({1000 * took / n:.0f} ms per token) "
                  f"through {run_cfg.n_stages} stages; last token: {used}", file=sys.stderr)
        return 0
    except UserError:
        if written:  # what was generated so far stays on stdout
            out.add([], final=True)
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    finally:
        await asyncio.to_thread(dht.shutdown)
