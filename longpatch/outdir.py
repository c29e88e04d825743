"""Output directories (--out, --save): whether a path can be one, checked before any work, and which
command wrote it, so that one command never overwrites or mixes into another command's files.

A command that writes an --out directory marks it with MARKER (a one-line file naming the command,
e.g. ``eval ppl``) when it first writes there: ``check_out`` (before the work) refuses a directory
another command marked, ``claim_out`` (when the writing starts) creates and marks it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import ConfigError
from .options import check_path

MARKER = ".longpatch-command"


def check_creatable(path: "str | os.PathLike", flag: str, allowed: str) -> Path:
    """`path` as a directory `flag` will write: an existing directory, or a path whose nearest existing
    ancestor is a directory. Whether we can write there is probed with a temporary directory, removed at
    once: permissions alone miss read-only and virtual file systems (/proc) and root's rights."""
    out = Path(check_path(flag, os.fspath(path)))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag}: {out} exists and is not a directory; allowed: {allowed}")
    ancestor = out
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{flag}: cannot create {out}: {ancestor} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".longpatch-probe-", dir=ancestor))
    except OSError as e:
        what = "write in" if ancestor == out else "create"
        raise ConfigError(f"{flag}: cannot {what} {out}: {ancestor} is not writable ({e.strerror or e})") from None
    return out


def written_by(path: "str | os.PathLike") -> str | None:
    """The command that marked the directory `path`, or None (not marked, or no such directory)."""
    try:
        return (Path(path) / MARKER).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def check_out(path: "str | os.PathLike", command: str, flag: str = "--out") -> Path:
    """Refuse, before any work, an output directory `command` (e.g. 'eval ppl') cannot use: a file, a
    path that cannot be created, a directory another command wrote, or a non-empty directory no command
    marked (the user's own files, which our results.json or records would overwrite). Creates nothing."""
    allowed = f"a new or empty directory, or one `longpatch {command}` wrote"
    out = check_creatable(path, flag, allowed)
    owner = written_by(out)
    if owner is not None and owner != command:
        raise ConfigError(f"{flag}: {out} holds the output of `longpatch {owner}`, which `longpatch {command}` "
                          f"would overwrite or mix with; allowed: {allowed}")
    if owner is None and out.is_dir() and next(out.iterdir(), None) is not None:
        raise ConfigError(f"{flag}: {out} is a non-empty directory that longpatch did not write (no {MARKER}); "
                          f"its files could be overwritten; allowed: {allowed}")
    return out


def claim_out(path: "str | os.PathLike", command: str) -> Path:
    """Create the output directory (and its parents) and mark it as `command`'s, when writing starts."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if written_by(out) != command:
        tmp = out / f"{MARKER}.tmp{os.getpid()}"
        tmp.write_text(command + "\n")
        os.replace(tmp, out / MARKER)
    return out


def write_json(path: "str | os.PathLike", data: dict) -> None:
    """The one JSON writer of every result file: atomic (a temporary sibling renamed into place, so a
    reader never sees half a file) and strict JSON: a non-finite float (an error column of a method
    that overflowed, a skipped timing) is written as null, since NaN and Infinity are not JSON."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(data), indent=1, sort_keys=False, allow_nan=False, default=_not_json) + "\n")
    os.replace(tmp, path)


def write_csv(path: "str | os.PathLike", columns: list[str], rows) -> None:
    """Rows (dicts) as CSV with the given columns (None as empty; a dict or list as JSON), written atomically
    like write_json."""
    import csv
    import json

    def cell(x):
        if x is None:
            return ""
        return json.dumps(_finite(x), allow_nan=False) if isinstance(x, (dict, list, tuple)) else x

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow([cell(row.get(k)) for k in columns])
    os.replace(tmp, path)


def _finite(x):
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _not_json(x):
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
