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
