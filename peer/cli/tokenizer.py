"""`asyncmesh-peer tokenizer`: train a byte-level BPE tokenizer (tokenizer.json) on a run's data.

The documents are read exactly as a swarm reads them (``trainer.stream``: a Hugging Face dataset ``hf:NAME``, or
local .txt/.jsonl/.parquet files, folders or globs), the held-out validation documents left out, up to
``--max-docs``. A run then names the file with ``data.tokenizer`` and sets ``model.vocab_size`` to at least its
vocabulary; the file's digest becomes part of the run id.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from peer.errors import UserError

HELP = "Train a byte-level BPE tokenizer (tokenizer.json) on a run's data."
EPILOG = """examples:
  local files (a .parquet, .jsonl or .txt file, a folder or a glob of them):
    asyncmesh-peer tokenizer --data corpus.parquet --vocab-size 4096 --out tokenizer.json
  a Hugging Face dataset (streamed; the first 20,000 documents):
    asyncmesh-peer tokenizer --data hf:roneneldan/TinyStories --max-docs 20000 --vocab-size 8192 --out tokenizer.json
then, in the run file:  [data] tokenizer = "tokenizer.json"   and   [model] vocab_size = <the printed size>
exit codes: 0 written; 2 bad input (missing data, a missing package, a vocabulary too small)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="SOURCE",
                   help="hf:NAME, or a .txt/.jsonl/.parquet file, folder or glob")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="tokens in the vocabulary (>= 257: every byte and the end-of-text token)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write tokenizer.json")
    p.add_argument("--text-field", default="text", help="the column holding the text (.jsonl, .parquet, hub)")
    p.add_argument("--hf-config", default="", help="hub datasets: the configuration name")
    p.add_argument("--split", default="train", help="hub datasets: the split (default train)")
    p.add_argument("--max-docs", type=int, default=0, metavar="N", help="train on at most N documents (0: all)")
    p.add_argument("--eot-token", default="<|endoftext|>", help="the end-of-text token (default <|endoftext|>)")


def run(args: argparse.Namespace) -> int:
    from trainer.config import DataConfig
    from trainer.data import DataError
    from trainer.sources import tokenizer_vocab_size
    from trainer.stream import VAL, doc_role, documents
    from trainer.tokenizer import MissingExtra, train_bpe

    if args.max_docs < 0:
        raise UserError(f"--max-docs must be >= 0, got {args.max_docs}")
    try:
        cfg = DataConfig(source=args.data, text_field=args.text_field, hf_config=args.hf_config, split=args.split)
        texts = (text for i, text in documents(cfg) if doc_role(i, cfg) != VAL)
        out = train_bpe(itertools.islice(texts, args.max_docs or None), vocab_size=args.vocab_size, out=args.out,
                        eot_token=args.eot_token)
    except (MissingExtra, DataError, ValueError) as e:
        raise UserError(str(e)) from None
    size = tokenizer_vocab_size(out)
    print(f"wrote {Path(out)} ({size} tokens); in the run file set [data] tokenizer = \"{out}\" and "
          f"[model] vocab_size = {size} (or more)")
    return 0
