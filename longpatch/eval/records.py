"""Records of finished work, one JSON line each: how they are written (appended, flushed, fsync'ed), read
back for resuming and reporting, and how result files are replaced atomically."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from ..errors import LongpatchError

log = logging.getLogger("longpatch")

INTERRUPTED = "longpatch: interrupted; finished work is saved in %s: run the same command again to resume"


@contextlib.contextmanager
def interrupt_said(out: "str | Path"):
    """Work interrupted (Ctrl-C, SIGINT) inside says where its finished part is saved (INTERRUPTED), then
    stops as interrupted (the CLI exits 130)."""
    try:
        yield
    except KeyboardInterrupt:
        log.warning(INTERRUPTED, out)
        raise


def announce_resume(already: int, total: int, what: str, out: Path) -> None:
    print(f"longpatch: resuming: {already} of {already + total} {what} already in {out}", file=sys.stderr)


def records_file(out: Path, rank: int, world: int) -> Path:
    """One file per process: processes never append to the same file."""
    return out / ("records.jsonl" if world == 1 else f"records.rank{rank}.jsonl")


class RecordLog:
    """Append-only JSONL of finished work; each line is flushed and fsync'ed when written."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a+b")
        self._f.seek(0)
        data = self._f.read()
        if data and not data.endswith(b"\n"):  # killed mid-write: drop the incomplete last line
            keep = data.rfind(b"\n") + 1
            self._f.truncate(keep)
            log.warning("longpatch: %s: dropped an incomplete last line (an interrupted write); that item "
                        "is done again", path)

    def append(self, record: dict) -> None:
        self._f.write((json.dumps(record, sort_keys=True) + "\n").encode())
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_records(out: "str | Path") -> list[dict]:
    """Every record in out/records*.jsonl; unreadable lines (an interrupted write) are reported and ignored."""
    records = []
    for path in sorted(Path(out).glob("records*.jsonl")):
        bad = []
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError
                except ValueError:
                    bad.append(n)
                    continue
                records.append(rec)
        if bad:
            log.warning("longpatch: %s: ignored %d unreadable line(s) (%s), probably an interrupted write; "
                        "those items are done again", path, len(bad), ", ".join(map(str, bad[:5])))
    return records


@contextlib.contextmanager
def removed_on_failure(out: Path, keep_if_existed: bool):
    """A failed evaluation leaves no empty directory behind: remove `out` if this call created it and no
    document was finished into it (finished documents are kept: a re-run resumes from them)."""
    try:
        yield
    except BaseException:
        if not keep_if_existed and out.is_dir() and not any(f.stat().st_size for f in out.glob("records*.jsonl")):
            shutil.rmtree(out, ignore_errors=True)
        raise


PLAN_FILE = "plan.json"


def read_plan(out: Path) -> dict:
    """The plan.json an evaluation wrote into `out` before its work: what it evaluates, for the report."""
    try:
        return json.loads((Path(out) / PLAN_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LongpatchError(f"{Path(out) / PLAN_FILE}: cannot read the evaluation plan ({e}); run the evaluation "
                             "first") from None


def seconds_by_path(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """{side: {phase: {path: seconds}}} summed over the records' layer stats (model.longpatch.breakdown())."""
    by_path: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        for side, phases in r["attention"].items():
            for phase, paths in phases.items():
                for path, s in paths.items():
                    into = by_path.setdefault(side, {}).setdefault(phase, {})
                    into[path] = into.get(path, 0.0) + s["seconds"]
    return by_path
