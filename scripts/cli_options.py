"""Every `longpatch` command and its option names, as the installed typer/click build them.

    python scripts/cli_options.py            # print them as JSON (tests/fixtures/cli_options.json)
    python scripts/cli_options.py --docs     # rewrite the generated table in docs/configs.md

tests/test_cli_options.py checks that the CLI, on whatever typer is installed, has exactly the options of
the snapshot, that each `--help` lists them, and that docs/configs.md's table agrees (typer 0.27
renamed options declared by their metavar alone).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "configs.md"
BEGIN, END = "<!-- cli-options:begin (scripts/cli_options.py --docs) -->", "<!-- cli-options:end -->"


def option_names() -> dict[str, list[str]]:
    """{'eval needle': ['--batch-size', ...], ...}: each command's flags (with the --no- forms), sorted."""
    import typer

    from longpatch.cli import app

    def walk(cmd, path):
        if hasattr(cmd, "commands"):  # a group (click's, or the copy newer typers vendor)
            for name, sub in sorted(cmd.commands.items()):
                yield from walk(sub, path + [name])
        else:
            yield " ".join(path), sorted(o for p in cmd.params for o in [*p.opts, *p.secondary_opts])

    return dict(walk(typer.main.get_command(app), []))


def docs_table(names: dict[str, list[str]]) -> str:
    rows = ["| command | options |", "| --- | --- |"]
    rows += [f"| `longpatch {cmd}` | {', '.join(f'`{o}`' for o in opts) or '-'} |" for cmd, opts in names.items()]
    return "\n".join([BEGIN, *rows, END])


def docs_block(text: str) -> str | None:
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    return m.group(0) if m else None


def main(argv: list[str]) -> None:
    names = option_names()
    if argv == ["--docs"]:
        text = DOCS.read_text()
        old = docs_block(text)
        if old is None:
            sys.exit(f"{DOCS}: no generated block ({BEGIN} ... {END}) to rewrite")
        DOCS.write_text(text.replace(old, docs_table(names)))
    elif not argv:
        print(json.dumps(names, indent=1))
    else:
        sys.exit("usage: python scripts/cli_options.py [--docs]")


if __name__ == "__main__":
    main(sys.argv[1:])
