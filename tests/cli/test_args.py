"""``omni-trio``'s grammar: every command's ``--help``, ``--version``, usage errors (exit 2)."""

from __future__ import annotations

import pytest

import omni_trio
from omni_trio.cli.args import build_parser
from omni_trio.cli.main import main


@pytest.mark.parametrize("command", ["demo", "run", "serve", "validate", "bench"])
def test_help_of_every_command(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"omni-trio {command}" in out and "--debug" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"omni-trio {omni_trio.__version__}"


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert main(["run", "x.yaml"]) == 2  # --prompt is required
    assert "--prompt" in capsys.readouterr().err
