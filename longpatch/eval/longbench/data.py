"""LongBench v1 (Bai et al. 2023): the 21 subsets, their 6 categories, and a loader that reads the
data without the dataset's loading script (which does not run on `datasets` >= 4).

Sources, in the form `load_longbench(data=...)` takes them:
  None                      the hub dataset THUDM/LongBench, file data.zip, fetched with huggingface_hub
                            (cached, so only the first call needs the network)
  path/to/data.zip          a local copy of that zip (members data/<subset>.jsonl)
  path/to/dir               <subset>.jsonl files in the dir (or in dir/data), or a data.zip in it,
                            or parquet files below it
  path/to/file.parquet      a parquet copy (one file, or a directory of them: see _parquet_rows)
  path/to/<subset>.jsonl    one subset
  a registered name         see register_source (e.g. a bundled demo set)

Every record is validated (fields input, context, answers, length, dataset, language, all_classes,
_id); a bad line is reported as `file:line: what is wrong` and skipped, or raised when strict.

LongBench-E (`e=True`): the length-balanced test files `<subset>_e.jsonl` of the same archive.
`code_completion_tasks` turns code files into lcc-format tasks (the offline `eval longbench --data demo`).
"""
from __future__ import annotations

import json
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ...errors import ConfigError, LongpatchError

log = logging.getLogger("longpatch")

HUB_REPO = "THUDM/LongBench"
HUB_FILE = "data.zip"

CATEGORIES: dict[str, tuple[str, ...]] = {
    "single-doc-qa": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi-doc-qa": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few-shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}
SUBSETS: tuple[str, ...] = tuple(s for group in CATEGORIES.values() for s in group)
CATEGORY_OF: dict[str, str] = {s: c for c, group in CATEGORIES.items() for s in group}

# field -> (accepted types, how the requirement reads in an error message)
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "input": ((str,), "a string"),
    "context": ((str,), "a string"),
    "answers": ((list,), "a list of strings"),
    "length": ((int,), "an int >= 0"),
    "dataset": ((str,), "the subset name"),
    "language": ((str,), "a string"),
    "all_classes": ((list, type(None)), "null or a list of strings"),
    "_id": ((str,), "a non-empty string"),
}
FIELDS = tuple(_FIELDS)


class DataError(LongpatchError):
    """LongBench data missing, unreadable, or (with strict) malformed."""


@dataclass(frozen=True)
class Record:
    subset: str
    doc_id: str
    context: str
    input: str
    answers: tuple[str, ...]
    length: int
    language: str
    all_classes: tuple[str, ...] | None
    where: str  # "file:line" (or "file:row N" for parquet), for messages


@dataclass(frozen=True)
class Problem:
    """One record that failed validation."""

    file: str
    line: int
    message: str
    unit: str = "line"  # "row" for parquet

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file}:{self.unit} {self.line}"
        return f"{where}: {self.message}"

    def to_dict(self) -> dict:
        return {"file": self.file, self.unit: self.line, "message": self.message}


@dataclass
class LongBench:
    source: str  # what was read, for reports
    records: dict[str, list[Record]]  # subset -> records in file order (requested subsets only)
    categories: dict[str, str]  # subset -> category, for the requested subsets
    problems: list[Problem] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # requested subsets the source does not hold


# ---- named sources (e.g. an embedded demo set) ----------------------------------------------------

_SOURCES: dict[str, tuple[Callable[[], "str | Path"], dict[str, str] | None]] = {}


def register_source(name: str, locate: Callable[[], "str | Path"], subsets: dict[str, str] | None = None) -> None:
    """Make `data=name` mean the dir/zip/parquet that `locate()` returns.

    subsets: the source's own {subset: category} when it is not LongBench v1 (records in LongBench's
    format, categories among CATEGORIES); then 'all' and category names select among these.
    """
    bad = sorted(c for c in (subsets or {}).values() if c not in CATEGORIES)
    if bad:
        raise ConfigError(f"register_source {name!r}: unknown category {bad[0]!r}; allowed: {', '.join(CATEGORIES)}")
    _SOURCES[name] = (locate, dict(subsets) if subsets else None)


def source_name(label: str) -> str:
    """What titles call the data of a LongBench.source label: 'LongBench', or a named source with its own
    subsets (e.g. 'demo', the demo model's held-out code), which is not LongBench."""
    name = str(label).split(" (", 1)[0]
    return name if name in _SOURCES and _SOURCES[name][1] else "LongBench"


def subset_categories(data=None) -> dict[str, str]:
    """{subset: category} of what `data` holds: LongBench v1's 21 unless a named source says otherwise."""
    if isinstance(data, str) and data in _SOURCES and _SOURCES[data][1]:
        return dict(_SOURCES[data][1])
    return dict(CATEGORY_OF)


# ---- subsets ---------------------------------------------------------------------------------------

def _names(spec, flag: str = "--subsets") -> list[str]:
    from ...options import split_items

    return split_items(flag, spec, "'all', subset names or category names")


def resolve_subsets(spec: "str | Sequence[str]" = "all", data=None) -> list[str]:
    """'all', or comma-separated subset and category names -> subset names in canonical order."""
    known = subset_categories(data)
    names = _names(spec)
    if not names:
        raise ConfigError("subsets: empty; allowed: 'all', subset names or category names")
    chosen: set[str] = set()
    for n in names:
        if n == "all":
            chosen.update(known)
        elif n in known:
            chosen.add(n)
        elif n in CATEGORIES:
            chosen.update(s for s, c in known.items() if c == n)
        else:
            raise ConfigError(f"subsets: unknown name {n!r}; allowed: all, categories ({', '.join(CATEGORIES)}) "
                              f"or subsets ({', '.join(known)})")
    return [s for s in known if s in chosen]


# ---- validation ------------------------------------------------------------------------------------

class _Bad(Exception):
    pass


def validate_record(obj, subset: str, where: str, suffix: str = "") -> Record:
    """A raw record (parsed JSON object or parquet row) -> Record; raises _Bad(message)."""
    if not isinstance(obj, dict):
        raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise _Bad(f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    for name, (types, wanted) in _FIELDS.items():
        value = obj[name]
        ok = isinstance(value, types) and not isinstance(value, bool)
        if ok and name in ("answers", "all_classes") and value is not None:
            ok = all(isinstance(x, str) for x in value)
        if ok and name == "length":
            ok = value >= 0
        if ok and name == "_id":
            ok = bool(value)
        if not ok:
            raise _Bad(f"field {name!r}: got {_short(value)}; expected {wanted}")
    if obj["dataset"] not in (subset, subset + suffix):
        raise _Bad(f"field 'dataset' is {obj['dataset']!r} but this file holds subset {subset!r}")
    classes = obj["all_classes"]
    return Record(subset=subset, doc_id=obj["_id"], context=obj["context"], input=obj["input"],
                  answers=tuple(obj["answers"]), length=obj["length"], language=obj["language"],
                  all_classes=None if classes is None else tuple(classes), where=where)


def _short(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _jsonl_rows(lines: Iterable[bytes]) -> Iterator[tuple[int, object | _Bad]]:
    """(1-based line number, parsed object or _Bad) for every non-blank line."""
    for n, raw in enumerate(lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield n, _Bad(f"not UTF-8 ({e.reason} at byte {e.start})")
            continue
        if not text.strip():
            continue
        try:
            yield n, json.loads(text)
        except json.JSONDecodeError as e:
            yield n, _Bad(_json_problem(text, e))


def _json_problem(text: str, e: json.JSONDecodeError) -> str:
    """json's message, reworded for one line: some of its messages end in "at" (which gave "at at column"),
    and an error past the end of the line is reported by json on the next line, column 1."""
    line = text.rstrip("\r\n")
    msg = e.msg.removesuffix(" at")
    msg = msg[:1].lower() + msg[1:]
    if e.pos >= len(line):
        return f"invalid JSON at column {len(line) + 1}: {msg} (the line ends early)"
    return f"invalid JSON at column {e.pos + 1 - (line.rfind(chr(10), 0, e.pos) + 1)}: {msg}"


# ---- loading ---------------------------------------------------------------------------------------

def load_longbench(data: "str | Path | None" = None, subsets: "str | Sequence[str]" = "all",
                   strict: bool = False, e: bool = False, explicit: "Sequence[str] | None" = None) -> LongBench:
    """Read the requested LongBench subsets from `data` (see the module doc for the accepted forms).

    Malformed records are collected in `.problems` for the caller to report or, with strict=True,
    raise DataError naming file and line. Requested subsets the source lacks are listed in `.missing`;
    a subset named explicitly (not via 'all' or a category; `explicit` overrides which those are) that is
    missing is an error, as is finding none at all. e: read LongBench-E's `<subset>_e.jsonl` files
    instead (not from parquet).
    """
    suffix = "_e" if e else ""
    known = subset_categories(data)
    wanted = resolve_subsets(subsets, data)
    explicit = {n for n in _names(subsets) if n in known} if explicit is None else set(explicit)
    path, label = _locate(data)
    out = LongBench(source=label, records={s: [] for s in wanted}, categories={s: known[s] for s in wanted})
    present: set[str] = set()
    for subset, rows, unit in _open_source(path, wanted, known, suffix):
        present.add(subset)
        seen: dict[str, str] = {}
        for file, n, obj in rows:
            try:
                if isinstance(obj, _Bad):
                    raise obj
                rec = validate_record(obj, subset, f"{file}:{n}" if unit == "line" else f"{file}:row {n}", suffix)
                if rec.doc_id in seen:
                    raise _Bad(f"duplicate _id {rec.doc_id!r} (first at {seen[rec.doc_id]})")
            except _Bad as e:
                problem = Problem(file, n, str(e), unit)
                if strict:
                    raise DataError(f"LongBench data: {problem} (strict: malformed records are fatal)") from None
                out.problems.append(problem)
                continue
            seen[rec.doc_id] = rec.where
            out.records[subset].append(rec)
    out.missing = [s for s in wanted if s not in present]
    if len(out.missing) == len(wanted):
        raise DataError(f"LongBench data: {label} holds none of the requested subsets ({', '.join(wanted)}); "
                        f"expected files named <subset>{suffix}.jsonl (or parquet rows whose 'dataset' names a subset)")
    hard = [s for s in out.missing if s in explicit]
    if hard:
        raise DataError(f"LongBench data: {label} has no subset {', '.join(hard)}")
    return out


def _locate(data) -> tuple[Path, str]:
    """-> (local path, description for messages); downloads data.zip from the hub when data is None."""
    if data is None:
        return _hub_zip()
    if isinstance(data, str) and data in _SOURCES:
        path = Path(_SOURCES[data][0]())
        return path, f"{data} ({path})"
    path = Path(data).expanduser()
    if not path.exists():
        named = f"; named sources: {', '.join(sorted(_SOURCES))}" if _SOURCES else ""
        raise DataError(f"LongBench data: {str(data)!r} does not exist; allowed: a data.zip, a directory of "
                        f"<subset>.jsonl files, a parquet file or directory{named}")
    return path, str(path)


def _hub_zip() -> tuple[Path, str]:
    from huggingface_hub import constants, hf_hub_download

    from ...loading import hub_unreachable

    try:  # the cache first: it needs no network
        local = hf_hub_download(repo_id=HUB_REPO, filename=HUB_FILE, repo_type="dataset", local_files_only=True)
        return Path(local), f"hub {HUB_REPO}/{HUB_FILE} ({local})"
    except Exception as e:  # not cached, or the cache unreadable: each case ends in the same advice
        not_cached = _first_line(e)
    # asking an unreachable hub costs ~25 s of retries: fail at once when it cannot answer
    reason = hub_unreachable()
    if reason is None:
        try:
            local = hf_hub_download(repo_id=HUB_REPO, filename=HUB_FILE, repo_type="dataset")
            return Path(local), f"hub {HUB_REPO}/{HUB_FILE} ({local})"
        except Exception as e:  # offline, gated, proxy...
            reason = f"the download failed ({_first_line(e)})"
    raise DataError(
        f"LongBench data: nothing reachable. Tried the hub dataset {HUB_REPO} file {HUB_FILE} through "
        f"huggingface_hub (cache {constants.HF_HUB_CACHE}): not cached ({not_cached}), and {reason}. "
        f"Pass a local copy instead: data=PATH (--data PATH) naming data.zip, a directory of <subset>.jsonl "
        f"files, or a parquet copy")


def _first_line(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0].rstrip(".")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _open_source(path: Path, wanted: list[str], known: dict[str, str], suffix: str = ""):
    """Yield (subset, rows, unit) for each requested subset the source holds; rows are
    (file, 1-based line or row number, parsed object or _Bad)."""
    if path.is_file():
        ext = path.suffix.lower()
        if ext == ".zip":
            yield from _zip_members(path, wanted, suffix)
        elif ext == ".parquet":
            yield from _parquet_rows([path], path.parent, wanted, known)
        elif ext == ".jsonl":
            subset = path.stem.removesuffix(suffix) if suffix else path.stem
            if subset in wanted and path.stem == subset + suffix:
                yield subset, _jsonl_file(path), "line"
        else:
            raise DataError(f"LongBench data: {path} is neither a .zip, a .jsonl nor a .parquet file")
        return
    for root in (path, path / "data"):
        files = [(s, root / f"{s}{suffix}.jsonl") for s in wanted if (root / f"{s}{suffix}.jsonl").is_file()]
        if files:
            for s, f in files:
                yield s, _jsonl_file(f), "line"
            return
    if (path / HUB_FILE).is_file():
        yield from _zip_members(path / HUB_FILE, wanted, suffix)
        return
    parquet = sorted(path.rglob("*.parquet"))
    if parquet:
        yield from _parquet_rows(parquet, path, wanted, known)
        return
    raise DataError(f"LongBench data: {path} holds no <subset>{suffix}.jsonl (in it or in {path / 'data'}), "
                    f"no {HUB_FILE} and no *.parquet files; subsets looked for: {', '.join(wanted)}")


def _jsonl_file(path: Path):
    with open(path, "rb") as f:
        for n, obj in _jsonl_rows(f):
            yield str(path), n, obj


def _zip_members(path: Path, wanted: list[str], suffix: str = ""):
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"LongBench data: cannot open {path} as a zip: {e}") from None
    with zf:
        members = {}
        for name in zf.namelist():
            base = name.rsplit("/", 1)[-1]
            if name.startswith("__MACOSX") or base.startswith("._") or not base.endswith(".jsonl"):
                continue
            members.setdefault(base[: -len(".jsonl")], name)
        for subset in wanted:
            if subset + suffix in members:
                yield subset, _zip_rows(zf, path, members[subset + suffix]), "line"


def _zip_rows(zf: zipfile.ZipFile, path: Path, name: str):
    with zf.open(name) as f:
        for n, obj in _jsonl_rows(f):
            yield f"{path}!{name}", n, obj


def _parquet_rows(files: list[Path], root: Path, wanted: list[str], known: dict[str, str]):
    """Parquet copies come laid out in many ways; the subset of a file is the first path component
    (below root) or file-name stem that names a subset, else each row's own 'dataset' field."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("LongBench data: reading parquet needs pyarrow (pip install pyarrow)") from None
    by_subset: dict[str, list[tuple[str, int, object]]] = {}
    for f in files:
        rel = f.relative_to(root) if f.is_relative_to(root) else Path(f.name)
        named = next((p for p in (*rel.parent.parts, f.stem) if p in known), None)
        if named is not None and named not in wanted:
            continue
        try:
            rows = pq.read_table(f).to_pylist()
        except Exception as e:  # pyarrow raises several unrelated types for a bad file
            raise DataError(f"LongBench data: cannot read parquet {f}: {e}") from None
        for n, row in enumerate(rows, 1):
            subset = named or row.get("dataset")
            if subset in wanted:
                by_subset.setdefault(subset, []).append((str(f), n, row))
    for subset in wanted:
        if subset in by_subset:
            yield subset, iter(by_subset[subset]), "row"


def _demo_eval_dir():
    from ...assets import demo_eval_path
    return demo_eval_path()


# `--data demo`: the held-out evaluation set shipped with the demo model (one code subset).
register_source("demo", _demo_eval_dir, subsets={"demo_code": "code"})


# ---- code-completion tasks from code files (lcc format) --------------------------------------------

_COMMENT_MARKS = ("#", "`", "//")  # lines LongBench's code_sim skips in a prediction: never an answer


def code_completion_tasks(records: Sequence[Record], subset: str, at: float = 0.6) -> list[Record]:
    """One lcc-format task per code file: context = the file up to a line boundary, answer = its next
    non-empty line (trailing whitespace removed, indentation kept), input empty, `length` the
    context's word count as in LongBench. The cut is the first line boundary at or after the fraction
    `at` of the file's characters whose next non-empty line is code (no comment or fence marks, at
    least 4 characters); files without one give no task."""
    tasks = []
    for rec in records:
        lines = rec.context.splitlines(keepends=True)
        start, pos = 0, 0
        while start < len(lines) and pos < at * len(rec.context):  # the first line boundary past `at`
            pos += len(lines[start])
            start += 1
        for i in range(max(start, 1), len(lines)):
            j = next((k for k in range(i, len(lines)) if lines[k].strip()), None)
            if j is None:
                break
            answer = lines[j].rstrip()
            if len(answer.strip()) >= 4 and not any(m in answer for m in _COMMENT_MARKS):
                context = "".join(lines[:i])
                tasks.append(Record(subset=subset, doc_id=f"{rec.doc_id}:{i}", context=context, input="",
                                    answers=(answer,), length=len(context.split()), language="en",
                                    all_classes=None, where=rec.where))
                break
    return tasks


def report_problems(lb: LongBench) -> None:
    """Log the malformed records that were skipped and the requested subsets the data lacks."""
    for p in lb.problems[:20]:
        log.warning("longpatch: skipped malformed LongBench record: %s", p)
    if len(lb.problems) > 20:
        log.warning("longpatch: ... and %d more malformed records (all listed in plan.json and results.json)",
                    len(lb.problems) - 20)
    if lb.missing:
        log.warning("longpatch: %s has no data for subset(s) %s", lb.source, ", ".join(lb.missing))
