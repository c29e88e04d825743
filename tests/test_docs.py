"""The docs stay true to the code: every link and image path in README.md, CHANGELOG.md and docs/*.md
resolves (files and #anchors), every `longpatch ...` command they show names a command and options the
CLI has (tests/fixtures/cli_options.json, itself pinned to the CLI by test_cli_options.py), and every
record under docs/img/ or config under configs/ that they cite exists, and every record under
docs/img/ is cited by something."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTIONS = json.loads((ROOT / "tests" / "fixtures" / "cli_options.json").read_text())
GROUPS = {name.split()[0] for name in OPTIONS if " " in name}  # bench, eval


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", path.read_text(), re.M)}


def links(text: str) -> list[str]:
    """Targets of markdown links and images, outside code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def commands(text: str) -> list[str]:
    """`longpatch ...` command lines: in code blocks (continuation lines joined, comments dropped) and in
    inline code that starts with the command."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip().removeprefix("$ ")
            if re.match(r"(python -m )?longpatch ", line):
                found.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if re.match(r"(python -m )?longpatch [a-z]", span):
            found.append(span)
    return found


def parse(line: str) -> tuple[str | None, list[str]]:
    """(command name as in cli_options.json, or None for a bare group; the --options it uses)."""
    words = line.removeprefix("python -m ").split()[1:]
    if words[0] in GROUPS:
        if len(words) < 2 or not re.match(r"[a-z]+$", words[1]):
            return None, []
        name, rest = f"{words[0]} {words[1]}", words[2:]
    else:
        name, rest = words[0], words[1:]
    return name, [re.match(r"--[a-z][a-z0-9-]*", w).group(0) for w in rest if re.match(r"--[a-z]", w)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    bad = []
    for target in links(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(target)
    assert not bad, f"{doc.name}: links that do not resolve: {bad}"


PASSES_ON = {"serve"}  # commands that hand every argument but their own to another program


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_use_the_clis_options(doc):
    bad = []
    for line in commands(doc.read_text()):
        name, used = parse(line)
        if name is None:
            continue
        if name not in OPTIONS:
            bad.append(f"{line[:80]!r}: no command {name!r}")
            continue
        if name in PASSES_ON:  # its other arguments are another program's (serve: vLLM's)
            used = [o for o in used if o in OPTIONS[name]]
        bad += [f"{line[:80]!r}: {name} has no {o}" for o in used if o not in OPTIONS[name] and o != "--help"]
    assert not bad, f"{doc.name}:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_records_and_configs_exist(doc):
    cited = re.findall(r"`((?:docs/img|configs)/[^`\s*<>{}]+)`", doc.read_text())
    missing = [c for c in cited if not (ROOT / c).exists()]
    assert not missing, f"{doc.name}: cites files that do not exist: {missing}"


def test_every_record_is_referenced():
    """A record under docs/img/ that no doc, script or test names (by path, by its name without the
    extension, or by its directory) is a leftover of a figure the docs no longer show."""
    texts = " ".join(d.read_text() for d in DOCS)
    texts += " ".join(p.read_text(errors="ignore") for p in [*(ROOT / "scripts").rglob("*.py"),
                                                              *(ROOT / "scripts").glob("*.sh"),
                                                              *(ROOT / "tests").glob("*.py")])
    img = ROOT / "docs"
    unused = []
    for f in sorted(p for p in (img / "img").rglob("*") if p.is_file()):
        rel = f.relative_to(img).as_posix()
        folder = f.parent.relative_to(img).as_posix()
        keys = [rel, rel.rsplit(".", 1)[0] + ".", f.name, f.stem + "."]
        if folder != "img":
            keys += [folder + "/", folder + "`", folder + ")"]
        if not any(k in texts for k in keys):
            unused.append(f"docs/{rel}")
    assert not unused, f"records no doc, script or test names (remove them, or cite them): {unused}"


# The docs are for users: no issue numbers, GPU leases or work stops (what changed and why goes to
# CHANGELOG.md).
HISTORY = re.compile(r"\bissues? ?#?\d+|\(#\d+\)|(?<![\w/])#\d{2}\b"
                     r"|\b(?:this|next|later|earlier|last) stop\b|\bleases?\b", re.I)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.name != "CHANGELOG.md"],
                         ids=lambda p: p.name)
def test_no_work_history_in_the_docs(doc):
    text = re.sub(r"\]\([^)]*\)", "]", doc.read_text())  # link targets (anchors of other pages) aside
    found = [m.group(0) for m in HISTORY.finditer(text)]
    assert not found, f"{doc.name}: work history in a user doc (move it to CHANGELOG.md): {found}"


def test_the_parsers_find_what_they_should():
    """The checks above cannot pass by finding nothing: the parsers on a planted page."""
    page = ("Run `longpatch eval ppl --model demo --seq-len 16384` or\n```bash\nlongpatch bench attention \\\n"
            "    --methods exact,moba --bogus 1  # a comment --also-not\n```\nand `longpatch bench` alone; "
            "[a](missing.md) [b](#nowhere)")
    assert [parse(c) for c in commands(page)] == [("bench attention", ["--methods", "--bogus"]),
                                                   ("eval ppl", ["--model", "--seq-len"]), (None, [])]
    assert links(page) == ["missing.md", "#nowhere"]
    heading = "Text that copies from far back: layer 1 stays exact"
    assert slug(heading) == "text-that-copies-from-far-back-layer-1-stays-exact"
    assert sum(len(commands(d.read_text())) for d in DOCS) > 50  # the real docs do show commands
    assert [m.group(0) for m in HISTORY.finditer("in issue 41 (#27), this stop, a lease; releases #include")] == [
        "issue 41", "(#27)", "this stop", "lease"]
