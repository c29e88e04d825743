"""Needle-in-a-haystack / passkey retrieval: templates, prompts, judging and the report.

Protocol (docs/evaluation.md, "Needle in a haystack"). For a context length L (tokens of the whole
prompt, counted with the model's tokenizer), a needle depth d in [0, 1] and a trial t:
- the filler is L tokens of text from a filler source (different trials start at different
  places), cut so the prompt ends at a line boundary before the question;
- the needle (one line, e.g. `PASSKEY = 71432`) is inserted at the line boundary nearest to the
  fraction d of the filler's characters; the question (e.g. `assert PASSKEY ==`) ends the prompt;
- the prompt is tokenized as one text, then trimmed or extended at its start (filler only) to
  exactly L tokens;
- the model continues it greedily (`model.generate`, so a patched model runs both its prefill and
  its decode path) for as many tokens as the answer needs plus two;
- the trial is correct when the generated text, stripped of surrounding whitespace, starts with
  the expected answer (also stripped).
Keys are random digits drawn from a generator seeded by (seed, template, length, depth), distinct
across the trials of a cell; the same prompts are given to every configuration, so methods are
compared on identical inputs.

Questions end at "==" / "is", not at a trailing space: with byte-level BPE " 71432" is one
space-prefixed token and a question ending in " " would ask for a token sequence no text contains.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ConfigError
from ...options import missing_path

TEMPLATE_KEYS = ("name", "needle", "question", "answer", "digits", "fields", "filler")


@dataclass(frozen=True)
class Template:
    """A needle template. `needle`, `question` and `answer` are format strings over {key} and the
    names in `fields` (fixed strings, e.g. the variable name of the code template)."""
    name: str
    needle: str
    question: str
    answer: str = "{key}"
    digits: int = 5
    fields: dict = field(default_factory=dict)
    filler: str | None = None  # a filler source for this template (None: the run's --filler)

    def __post_init__(self):
        for key in ("needle", "question", "answer"):
            text = getattr(self, key)
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"needle template {self.name!r}: {key} must be a non-empty string")
            if "\n" in text.strip("\n") and key == "needle":
                raise ConfigError(f"needle template {self.name!r}: needle must be one line, got {text!r}")
            try:
                text.format(key="0", **self.fields)
            except (KeyError, IndexError) as e:
                raise ConfigError(f"needle template {self.name!r}: {key} {text!r} uses an unknown field {e}; "
                                  f"allowed: {{key}} and {sorted(self.fields)}") from None
            except ValueError as e:  # unbalanced braces and the like
                raise ConfigError(f"needle template {self.name!r}: {key} {text!r} is not a valid format string "
                                  f"({e}); write a literal brace as {{{{ or }}}}") from None
        if "{key}" not in self.needle or "{key}" not in self.answer:
            raise ConfigError(f"needle template {self.name!r}: needle and answer must contain {{key}}")
        if not isinstance(self.digits, int) or isinstance(self.digits, bool) or not 1 <= self.digits <= 18:
            raise ConfigError(f"needle template {self.name!r}: digits = {self.digits!r}; allowed: an int 1..18")

    def render(self, key: str) -> tuple[str, str, str]:
        """(needle line, question, expected answer) for one key."""
        f = dict(self.fields, key=key)
        return self.needle.format(**f), self.question.format(**f), self.answer.format(**f)


BUILTIN_TEMPLATES: dict[str, Template] = {
    "passkey": Template("passkey", needle="The pass key is {key}. Remember it. {key} is the pass key.",
                        question="What is the pass key? The pass key is"),
    "code": Template("code", needle="{var} = {key}", question="assert {var} ==", fields={"var": "PASSKEY"}),
}
DEFAULT_TEMPLATE = "passkey"  # of `eval needle` and `longpatch demo` alike


def load_template(spec: str) -> Template:
    """A built-in template name, or a YAML file with the keys of TEMPLATE_KEYS."""
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--template: {spec!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                          "nor a YAML file")
    import yaml

    from ...yamlio import load_yaml

    try:
        data = load_yaml(path.read_text(encoding="utf-8"), f"--template {spec}")
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--template {spec}: not a readable YAML file ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--template {spec}: expected a mapping with keys {', '.join(TEMPLATE_KEYS)}")
    unknown = sorted(set(data) - set(TEMPLATE_KEYS))
    if unknown:
        raise ConfigError(f"--template {spec}: unknown key(s) {unknown}; allowed: {', '.join(TEMPLATE_KEYS)}")
    missing = [k for k in ("needle", "question") if k not in data]
    if missing:
        raise ConfigError(f"--template {spec}: missing key(s) {missing}")
    fields_ = data.get("fields") or {}
    if not isinstance(fields_, dict) or not all(isinstance(v, str) for v in fields_.values()):
        raise ConfigError(f"--template {spec}: fields must map names to strings")
    return Template(name=str(data.get("name") or path.stem), needle=data["needle"], question=data["question"],
                    answer=data.get("answer", "{key}"), digits=data.get("digits", 5), fields=fields_,
                    filler=data.get("filler"))


# ---- grid ------------------------------------------------------------------------------------------

def parse_depths(spec: str) -> list[float]:
    """'0:1:0.1' -> [0.0, 0.1, ..., 1.0] (end included); '0.05,0.5,0.95' -> those values."""
    from ...options import parse_floats

    return parse_floats("--depths", spec, 0.0, 1.0, "start:end:step (end included) or a list d1,d2,... of "
                                                    "fractions in [0, 1]")


def cell_keys(template: Template, length: int, depth: float, trials: int, seed: int) -> list[str]:
    """The trials' keys for one (length, depth) cell: seeded, distinct, `template.digits` digits."""
    h = hashlib.sha256(f"{seed}|{template.name}|{length}|{depth:.6f}".encode()).hexdigest()
    rng = random.Random(int(h[:16], 16))
    lo, hi = 10 ** (template.digits - 1), 10 ** template.digits
    if trials > hi - lo:
        raise ConfigError(f"--trials {trials}: more than the {hi - lo} distinct {template.digits}-digit keys")
    return [str(k) for k in rng.sample(range(lo, hi), trials)]


# ---- filler ----------------------------------------------------------------------------------------

class Filler:
    """A long filler text (documents joined by blank lines) and its token ids, to cut haystacks from."""

    def __init__(self, texts: list[str], tokenizer):
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise ConfigError("needle filler: the source has no text")
        self.text = "\n\n".join(t.rstrip("\n") for t in texts) + "\n"
        self.tokenizer = tokenizer
        enc = tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
        self.ids: list[int] = enc["input_ids"]
        self.offsets: list[tuple[int, int]] = enc["offset_mapping"]

    def __len__(self) -> int:
        return len(self.ids)


def filler_texts(source: str) -> list[str]:
    """Texts of a filler source: 'demo' (the demo model's held-out code), a .txt file, a .jsonl file
    (field 'context', else 'text', per line), or 'longbench:<subsets>[@<data>]' (LongBench contexts)."""
    if source == "demo":
        from ...assets import eval_documents
        return eval_documents()
    if source.startswith("longbench:"):
        from ..longbench.data import load_longbench
        subsets, _, data = source[len("longbench:"):].partition("@")
        lb = load_longbench(data or None, subsets or "all")
        return [r.context for records in lb.records.values() for r in records]
    path = Path(source)
    if not path.is_file():
        raise missing_path("--filler", source, "demo, a .txt or .jsonl file, or longbench:<subsets>[@<data>]")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--filler {source}: not UTF-8 text") from None
    if path.suffix != ".jsonl":
        return [raw]
    texts = []
    for i, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--filler {source}:{i}: not JSON ({e.msg})") from None
        text = rec.get("context", rec.get("text")) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"--filler {source}:{i}: a record needs a string field 'context' or 'text'")
        texts.append(text)
    return texts


# ---- prompts ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    expected: str
    needle_token: int  # index of the needle's first token in ids


def build_prompt(filler: Filler, template: Template, key: str, length: int, depth: float,
                 start_seed: int) -> Prompt:
    """The prompt of one trial: exactly `length` tokens, the needle at `depth` of the filler.

    The haystack is the filler's text from a seeded place, ending at a line boundary; the needle
    goes in at the line boundary nearest to the wanted token position, and the whole prompt is
    tokenized as one text, then made exactly `length` tokens by its first few filler tokens."""
    tok = filler.tokenizer
    needle, question, expected = template.render(key)
    bos = _bos(tok)
    fixed = len(bos) + len(tok(needle + "\n", add_special_tokens=False)["input_ids"]) \
        + len(tok(question, add_special_tokens=False)["input_ids"])
    budget = length - fixed  # filler tokens
    if budget < 16:
        raise ConfigError(f"--lengths {length}: too short for the needle and question ({fixed} tokens)")
    if len(filler) < budget + 256:
        raise ConfigError(f"--lengths {length}: the filler has only {len(filler)} tokens; give a longer --filler")
    first = random.Random(start_seed).randrange(32, len(filler) - budget - 128)
    # the haystack ends at the last line boundary of a window of budget + 64 tokens
    end = filler.text.rfind("\n", 0, filler.offsets[first + budget + 64][0]) + 1
    last = next(i for i in range(first + budget + 64, 0, -1) if filler.offsets[i - 1][1] <= end)
    start = last - budget  # first filler token kept
    s_char = filler.offsets[start][0]
    # line starts after the 4th kept token (room to trim a token or two in front of the needle)
    lo = filler.offsets[start + 4][0]
    target = filler.offsets[min(start + round(depth * budget), last - 1)][0] if depth < 1 else end
    cut, pos = end, filler.text.rfind("\n", lo, target + 1)
    after = filler.text.find("\n", max(target, lo), end)
    candidates = [c + 1 for c in (pos, after) if c >= lo] + [end]
    cut = min(candidates, key=lambda c: abs(c - target))
    text = filler.text[s_char:cut] + needle + "\n" + filler.text[cut:end] + question
    ids = tok(text, add_special_tokens=False)["input_ids"]
    needle_at = len(tok(filler.text[s_char:cut], add_special_tokens=False)["input_ids"]) if cut > s_char else 0
    diff = length - len(bos) - len(ids)
    if diff > 0:  # tokenized shorter than counted: take the filler tokens just before
        ids = filler.ids[start - diff:start] + ids
    elif diff < 0:
        ids = ids[-diff:]
    needle_at += diff
    if needle_at < 0:
        raise ConfigError(f"--depths {depth}: the needle does not fit at length {length}")
    return Prompt(bos + ids, expected, needle_at + len(bos))


def _bos(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a text (e.g. Llama's <s>), if any."""
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    n = len(ids) - len(plain)
    return list(ids[:n]) if n > 0 and ids[n:] == plain else []


def judge(generated: str, expected: str) -> bool:
    """Correct when the generated text, stripped, starts with the expected answer, stripped."""
    return generated.strip().startswith(expected.strip())


def answer_tokens(tokenizer, expected: str) -> int:
    """How many tokens to generate: the answer's own (as a space-prefixed continuation) plus two."""
    return len(tokenizer(" " + expected.strip(), add_special_tokens=False)["input_ids"]) + 2


# ---- report ----------------------------------------------------------------------------------------

def summarize_records(records: list[dict]) -> list[dict]:
    """Accuracy per (config, layers, length), in first-seen order of (config, layers); ``prompts``: how many
    prompts the accuracy is over (depths x trials)."""
    groups: dict[tuple, list[bool]] = {}
    for r in records:
        groups.setdefault((r["config"], r["method"], r["layers"], r["length"]), []).append(bool(r["correct"]))
    return [{"config": c, "method": m, "layers": n, "length": length, "prompts": len(v),
             "accuracy": sum(v) / len(v)}
            for (c, m, n, length), v in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3]))]


def accuracy_grid(records: list[dict], config: str, layers: int) -> tuple[list[int], list[float], list[list]]:
    """(lengths, depths, accuracy[depth][length] or None) of one (config, layers)."""
    rs = [r for r in records if r["config"] == config and r["layers"] == layers]
    lengths = sorted({r["length"] for r in rs})
    depths = sorted({r["depth"] for r in rs})
    grid = []
    for d in depths:
        row = []
        for n in lengths:
            cell = [r["correct"] for r in rs if r["depth"] == d and r["length"] == n]
            row.append(sum(cell) / len(cell) if cell else None)
        grid.append(row)
    return lengths, depths, grid


def heatmap(records: list[dict], config: str, layers: int, path: Path, title: str | None = None) -> None:
    """The standard NIAH picture: context length (x) by needle depth (y), accuracy as colour. However few
    the cells, the figure keeps room for its title, wrapped to the figure's width."""
    from ...plotting import annotated_heatmap

    lengths, depths, grid = accuracy_grid(records, config, layers)
    data = [[math.nan if v is None else v for v in row] for row in grid]
    annotated_heatmap(data, [length_label(n) for n in lengths], [f"{d:.0%}" for d in depths], path,
                      title or f"{config}, {layers} layers replaced", vmax=1, colorbar="accuracy", fmt=".2f",
                      xlabel="context length (tokens)", ylabel="needle depth", width=max(4.5, 1.2 + 1.1 * len(lengths)),
                      row_height=0.38, min_height=2.4)


def length_label(n: int) -> str:
    """4096 -> '4k'; lengths that are not a multiple of 1024 as they are."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
