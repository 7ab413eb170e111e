"""The console script: every subcommand is listed and documented, and bad input is one line, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from peer.cli import SUBCOMMANDS, build_parser, main


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_help_with_examples(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "asyncmesh-peer " + name in out  # the epilog shows how to call it


def test_a_bad_run_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "run.toml"
    bad.write_text("[optim]\nlr = -1\n")
    assert main(["swarm", "--run", str(bad), "--no-tui", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "optim.lr must be positive" in err
    assert "Traceback" not in err


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "peer.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "swarm" in out.stdout


def test_an_internal_error_is_a_bug_and_keeps_its_traceback(monkeypatch, capsys):
    """Only UserError is turned into one line; a ValueError from inside (here the averaging math) propagates."""
    from peer.cli import status
    from trainer.averaging import AveragingError

    def broken(args):
        raise AveragingError("partition shapes differ")

    monkeypatch.setattr(status, "run", broken)
    with pytest.raises(AveragingError):
        main(["status", "--port", "9"])


def test_a_user_error_exits_with_its_own_code(monkeypatch, capsys):
    from peer.cli import status
    from peer.errors import DaemonError

    def refuse(args):
        raise DaemonError("the identity key is readable by others; chmod 600 it")

    monkeypatch.setattr(status, "run", refuse)
    assert main(["status", "--port", "9"]) == 1
    assert capsys.readouterr().err.strip() == ("asyncmesh-peer status: error: the identity key is readable by others; "
                                               "chmod 600 it")
