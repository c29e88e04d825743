"""Issue 39: every command has the same option names on every typer the ranges admit (typer 0.27 renamed the
options declared by a metavar alone: `--depths` became `--DEPTHS`), `--help` lists them, and the docs agree."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script
from typer.testing import CliRunner

from longpatch import cli

ROOT = Path(__file__).resolve().parents[1]
options = load_script("cli_options")
SNAPSHOT = json.loads((ROOT / "tests" / "fixtures" / "cli_options.json").read_text())


def test_option_names_match_the_snapshot():
    assert options.option_names() == SNAPSHOT, (
        "a command's options changed: if on purpose, run `python scripts/cli_options.py > "
        "tests/fixtures/cli_options.json && python scripts/cli_options.py --docs`")


@pytest.mark.parametrize("command", sorted(SNAPSHOT))
def test_help_lists_every_option(command):
    r = CliRunner().invoke(cli.app, [*command.split(), "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    listed = {w.strip(",[]") for line in r.output.splitlines() for w in line.replace("/", " ").split()
              if w.startswith("--")}
    assert set(SNAPSHOT[command]) <= listed, sorted(set(SNAPSHOT[command]) - listed)


def test_docs_table_agrees():
    text = (ROOT / "docs" / "configs.md").read_text()
    assert options.docs_block(text) == options.docs_table(SNAPSHOT)


def test_every_option_spells_its_flag():
    """The declarations, not just today's typer: every typer.Option in cli.py names its flag ("--x") right
    after the default; a flag typer derives itself (from the parameter name or, in typer 0.27, from the
    metavar) is what broke."""
    import ast

    tree = ast.parse((ROOT / "longpatch" / "cli.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "Option" and getattr(n.func.value, "id", None) == "typer"]
    assert len(calls) > 50
    for c in calls:
        flag = c.args[1] if len(c.args) > 1 else None
        assert isinstance(flag, ast.Constant) and str(flag.value).startswith("--"), f"cli.py line {c.lineno}"
