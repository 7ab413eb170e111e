"""`generate` prints a growing token sequence as text with the run's own tokenizer (bytes or BPE), holding back a
character whose bytes are split across tokens until it is complete."""

from __future__ import annotations

from peer.cli.generate import _TextOut
from trainer.tokenizer import ByteTokenizer, FileTokenizer, train_bpe


def _printed(capsys, tok, ids):
    out = _TextOut(tok)
    pieces = []
    for i in ids:
        out.add([i])
        pieces.append(capsys.readouterr().out)
    out.add([], final=True)
    pieces.append(capsys.readouterr().out)
    return pieces


def test_bytes_hold_back_a_split_character(capsys):
    ids = list("aé€".encode())
    pieces = _printed(capsys, ByteTokenizer(), ids)
    assert "".join(pieces) == "aé€"
    assert pieces[:6] == ["a", "", "é", "", "", "€"]  # nothing printed until a character's last byte


def test_a_bpe_run_prints_its_own_tokens_decoded(tmp_path, capsys):
    texts = ["def main():\n    return 1\n", "déjà vu, naïve café\n"] * 50
    tok = FileTokenizer(train_bpe(texts, vocab_size=300, out=tmp_path / "tokenizer.json"))
    prompt = "def café():"
    ids = tok.encode_batch([prompt])[0]
    assert len(ids) < len(prompt.encode())  # merged tokens, not bytes
    assert "".join(_printed(capsys, tok, ids)) == prompt
