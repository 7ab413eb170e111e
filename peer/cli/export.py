"""`asyncmesh-peer export`: assemble the stages' latest states into one model (safetensors, or a Hugging Face folder).

Each peer checkpoints only the stage it serves (``<checkpoint-dir>/stage-N.pt``). ``export`` looks in every folder
given, takes for each stage the checkpoint with the highest step (replicas of a stage average towards one model; the
most advanced one is the freshest), renames the stages' layers to those of the whole model (``trainer.export``) and
writes ``model.safetensors`` and ``config.json`` to ``--out``; with ``--format hf`` a folder that transformers'
``AutoModelForCausalLM`` and ``AutoTokenizer`` load (``trainer.hf``), which ``--push-to-hub`` uploads. The folder is
written beside ``--out`` and renamed into place at the end, so an error never leaves it half-written. With
``--initial-peers`` instead, it joins the running swarm's DHT as a client (it serves and stores nothing), and fetches
every stage's state from its most advanced training peer through the same chunked, validated state transfer a joiner
uses, witnessed by the stage's other replicas like a joiner's (``peer.state.witness``: a state they do not all vouch
for is not exported; the stage's next peer is tried). Load the result with a few lines of plain PyTorch or with
transformers (docs/export.md), or sample it with ``asyncmesh-peer generate``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from peer.errors import UserError, user_input

if TYPE_CHECKING:
    import torch

    from trainer.config import RunConfig

Stages = dict[int, tuple[int, str, "dict[str, torch.Tensor]"]]
"""Each stage's weights to export: ``{stage: (its step, where they came from, its model state dict)}``."""

LIVE_DONORS = 3  # peers of a stage tried in turn by a live export

HELP = "Assemble the stages' latest states (checkpoints, or a live swarm) into one model (safetensors or HF)."
EPILOG = """examples:
  the checkpoints of a local swarm (each peer's folder), into model/:
    asyncmesh-peer export --run tests/runs/tiny.toml --checkpoint-dir swarm/peer*/ckpt --out model
  a volunteer's own folder plus folders copied from other stages' peers:
    asyncmesh-peer export --run myrun.toml --checkpoint-dir ~/.asyncmesh/ckpt stage1-ckpt --out model
  live, from a running swarm (every stage's most advanced training peer):
    asyncmesh-peer export --run myrun.toml --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... --out model
  as a Hugging Face folder (transformers loads it), uploaded to the Hub:
    asyncmesh-peer export --run myrun.toml --checkpoint-dir swarm/peer*/ckpt --format hf --out model-hf \\
        --push-to-hub me/my-model
then: asyncmesh-peer generate --model model --prompt 'def main('
exit codes: 0 written; 2 bad input (a folder, a missing stage, another run's checkpoints, no peer of a stage,
  transformers missing for --format hf)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, metavar="FILE", help="the run file the peers trained (default: embedded)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", nargs="+", metavar="DIR",
                        help="folders holding stage-N.pt checkpoints (the peers' --checkpoint-dir); every stage is "
                             "needed")
    source.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                        help="fetch every stage's state live from the swarm these peers belong to (an open run, or "
                             "a closed run whose peers serve state to strangers)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to join the DHT and fetch every stage (default 120)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the folder to write (new, or an earlier export, which is replaced)")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: model.safetensors + config.json for trainer.export.load_model (default); hf: a "
                        "Hugging Face folder (LlamaForCausalLM or GPT2LMHeadModel, and a tokenizer) for transformers")
    p.add_argument("--tokenizer", metavar="FILE", default=None,
                   help="--format hf: the tokenizer.json the run's data were tokenized with (copied into the folder; "
                        "default: the run's data.tokenizer; byte-level runs need none)")
    p.add_argument("--push-to-hub", metavar="REPO", default=None,
                   help="--format hf: upload the folder to this Hugging Face Hub repo (user/name; created if missing; "
                        "the token from `hf auth login` or HF_TOKEN)")
    p.add_argument("--private", action="store_true", help="--push-to-hub: create the repo private")


def run(args: argparse.Namespace) -> int:
    import torch

    from peer.state.checkpoint import checkpoint_path
    from trainer.config import RunConfig

    with user_input(f"--run {args.run}" if args.run else ""):
        run_cfg = RunConfig.from_toml(args.run) if args.run else RunConfig.default()
    _check_format(args, run_cfg)
    if args.initial_peers:
        return _write(args, run_cfg, _fetch_live(args, run_cfg))
    best: Stages = {}
    for folder in map(Path, args.checkpoint_dir):
        if not folder.is_dir():
            raise UserError(f"--checkpoint-dir {folder} is not a folder")
        for stage in range(run_cfg.n_stages):
            path = checkpoint_path(folder, stage)
            if not path.exists():
                continue
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # a damaged or foreign file: name it
                raise UserError(f"cannot read {path}: {type(e).__name__}: {e}") from None
            if not isinstance(payload, dict) or payload.get("run_id") != run_cfg.run_id:
                theirs = payload.get("run_id") if isinstance(payload, dict) else "?"
                raise UserError(f"{path} belongs to run {theirs}, not to run {run_cfg.run_id} ({run_cfg.name!r}); "
                                "pass the run file the peers trained with --run")
            step = int(payload.get("step", -1))
            if stage not in best or step > best[stage][0]:
                best[stage] = (step, str(path), payload["state"]["model"])
    missing = [s for s in range(run_cfg.n_stages) if s not in best]
    if missing:
        raise UserError(f"no checkpoint of stage(s) {missing} in {' '.join(args.checkpoint_dir)}; add the folder of a "
                        f"peer that served it (its --checkpoint-dir)")
    return _write(args, run_cfg, best, source="checkpoint")


def _write(args: argparse.Namespace, run_cfg: RunConfig, best: Stages, *,
           source: str = "peer") -> int:
    """Assemble the stages' weights ``{stage: (step, where from, model state)}`` and write the model."""
    from peer.state.checkpoint import CheckpointError
    from trainer.export import atomic_folder, gpt_state, save_model

    try:
        state = gpt_state(run_cfg, {s: m for s, (_, _, m) in best.items()})
    except (ValueError, CheckpointError) as e:
        raise UserError(str(e)) from None
    sources = {f"stage {s}": {source: where, "step": step} for s, (step, where, _) in sorted(best.items())}
    out = Path(args.out)
    with user_input(f"--out {args.out}"), atomic_folder(out) as tmp:
        if args.format == "hf":
            from trainer.hf import quiet, save_hf
            from trainer.tokenizer import MissingExtra

            try:
                quiet()
                save_hf(tmp, run_cfg, state, tokenizer_json=args.tokenizer, sources=sources)
            except MissingExtra as e:
                raise UserError(str(e)) from None
        else:
            save_model(tmp, run_cfg, state, sources)
    n = sum(t.numel() for t in state.values())
    steps = ", ".join(f"stage {s} step {step}" for s, (step, _, _) in sorted(best.items()))
    what = "a Hugging Face folder" if args.format == "hf" else "model.safetensors and config.json"
    print(f"wrote {what} to {out} ({n:,} parameters of run {run_cfg.name} ({run_cfg.run_id}); {steps})")
    if args.push_to_hub:
        from trainer.hf import push_to_hub

        try:
            url = push_to_hub(out, args.push_to_hub, private=args.private)
        except Exception as e:  # no token, no network, a repo of someone else: the folder stays, say so
            raise UserError(f"--push-to-hub {args.push_to_hub}: the upload failed ({type(e).__name__}: {e}); the "
                            f"folder {out} is complete: log in (`hf auth login` or HF_TOKEN) and try again, or "
                            "upload it by hand") from None
        print(f"pushed {out} to https://huggingface.co/{args.push_to_hub} ({url})")
    return 0


def _check_format(args: argparse.Namespace, run_cfg: RunConfig) -> None:
    """Refuse flag combinations and a missing [hf] extra before any state is read or fetched."""
    if args.format != "hf":
        if args.tokenizer or args.push_to_hub or args.private:
            raise UserError("--tokenizer, --push-to-hub and --private go with --format hf")
        return
    import importlib.util

    from trainer.hf import is_byte_level, run_tokenizer
    from trainer.tokenizer import HF_EXTRA

    if args.tokenizer is None:
        args.tokenizer = run_tokenizer(run_cfg)  # the run's own data.tokenizer, when it names one

    missing = [m for m in ("transformers", "tokenizers") + (("huggingface_hub",) if args.push_to_hub else ())
               if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"--format hf needs {', '.join(missing)}, which is not installed: {HF_EXTRA}")
    if args.tokenizer is None and not is_byte_level(run_cfg):
        raise UserError(f"run {run_cfg.name!r} is not byte-level (vocabulary {run_cfg.model.vocab_size}): pass the "
                        "tokenizer.json its data were tokenized with (--tokenizer FILE)")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise UserError(f"--tokenizer {args.tokenizer} is not a file")


def _fetch_live(args: argparse.Namespace, run_cfg: RunConfig) -> Stages:
    """Every stage's state from its most advanced training peers (tried in turn), as a DHT client."""
    import asyncio

    import uvloop

    from peer.cli.checks import check_multiaddrs

    check_multiaddrs("--initial-peers", args.initial_peers, need_peer_id=True)
    if args.timeout <= 0:
        raise UserError(f"--timeout must be positive (seconds), got {args.timeout}")

    async def fetch() -> Stages:
        from hivemind import DHT

        from peer.membership.admission import organiser_key
        from peer.membership.records import fetch_swarm, record_validator
        from peer.membership.vouches import ask_vouches, peer_ids_of
        from peer.ops.metrics import PeerMetrics
        from peer.pipeline.remote import rpc_call
        from peer.state.sync import StateSyncConfig, choose_donors, load_state_from_peers, vouched_first
        from peer.state.witness import witness_vetter

        try:
            dht = await asyncio.to_thread(DHT, initial_peers=list(args.initial_peers), client_mode=True, start=True,
                                          record_validators=[record_validator(run_cfg.run_id,
                                                                              organiser_key(run_cfg))])
        except Exception as e:  # a bad multiaddr or an unreachable bootstrap peer
            raise UserError(f"could not join the DHT through {' '.join(args.initial_peers)}: {e}. Check the "
                            "multiaddrs (copy them from a running peer's log) and that the peer is reachable") from e
        try:
            p2p = await dht.replicate_p2p()
            records = await fetch_swarm(dht, run_cfg.run_id, timeout=10.0)
            call = rpc_call(p2p, 2**20)  # the witnesses: the initial peers' vouches first (peer.membership.vouches)
            vouched = await ask_vouches(peer_ids_of(list(args.initial_peers)), run_cfg.run_id,
                                        lambda pid, name, msg: call(pid, name, msg, 10.0), lambda name, n: None)
            best: Stages = {}
            for stage in range(run_cfg.n_stages):
                donors = vouched_first(choose_donors(records, stage, p2p.peer_id.to_base58()), vouched)
                if not donors:
                    raise UserError(f"no training peer of stage {stage} of run {run_cfg.run_id} found through "
                                    f"{args.initial_peers[0]}; check --run (the peers' run file) or export from "
                                    "their checkpoint folders")
                for donor in donors[:LIVE_DONORS]:  # vouched, then most advanced first; the next if refused
                    config = StateSyncConfig()
                    metrics = PeerMetrics("export", stage)
                    vet = witness_vetter(run=run_cfg, stage=stage, config=config, metrics=metrics, announced=donors,
                                         trusted=vouched, what="the state")
                    state = await load_state_from_peers(p2p=p2p, run=run_cfg, stage=stage, metrics=metrics,
                                                        donors=[donor], config=config, vet=vet)
                    if state is not None:
                        best[stage] = (int(state["local_step"]), donor, state["model"])
                        break
                else:
                    raise UserError(f"no peer of stage {stage} delivered its state (they may refuse strangers in a "
                                    "closed run, or be overloaded); try again, or export from their checkpoint "
                                    "folders")
            return best
        finally:
            await asyncio.to_thread(dht.shutdown)

    async def bounded() -> Stages:
        try:
            return await asyncio.wait_for(fetch(), args.timeout)
        except TimeoutError:
            raise UserError(f"the swarm's states did not arrive within --timeout {args.timeout:g} s") from None

    return uvloop.run(bounded())
