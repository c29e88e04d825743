"""Output directories (--out, --save): whether a path can be one, checked before any work, and which
command wrote it, so that one command never overwrites or mixes into another command's files.

A command that writes an --out directory marks it with MARKER (a one-line file naming the command,
e.g. ``eval ppl``) when it first writes there: ``check_out`` (before the work) refuses a directory
another command marked, ``claim_out`` (when the writing starts) creates and marks it.

One run owns an --out at a time: ``hold_out`` (or the ``owns_out`` decorator) holds an exclusive flock on
LOCK in the directory for the run's lifetime, and a second run on the same directory refuses at once in
one line. Two runs resuming the same directory would otherwise both do every pending item and append
them twice. The OS releases a flock when its process ends, so a crashed or killed run leaves no stale
lock behind; the file itself is removed when the run ends normally.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import tempfile
from pathlib import Path

from .errors import ConfigError
from .options import check_path

try:
    import fcntl
except ImportError:  # Windows has no flock: runs there are not guarded against each other
    fcntl = None

MARKER = ".longpatch-command"
LOCK = ".longpatch-lock"  # held (flock) by the run writing the directory; not output: check_out ignores it
# Set for the processes a run starts itself (--num-processes workers, --sequence-parallel ranks): the
# directory it names is held for them by the run that started them, which they must not refuse.
HELD_ENV = "LONGPATCH_OUT_HELD"

log = logging.getLogger("longpatch")


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
    if owner is None and out.is_dir() and any(p.name != LOCK for p in out.iterdir()):
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


def held_key(path: "str | os.PathLike") -> str:
    """The value of HELD_ENV that hands `path` to a run's own processes (its absolute, resolved path)."""
    return str(Path(path).resolve())


@contextlib.contextmanager
def hold_out(path: "str | os.PathLike", command: str, flag: str = "--out"):
    """Own the output directory `path` for the block: create it and hold LOCK in it, or refuse (ConfigError,
    one line) when another run holds it. On leaving, the lock file goes, and so do the directories this
    call created if nothing else was written into them (a refused or failed run leaves nothing behind).
    Inside a process the run started itself (HELD_ENV names `path`), the starting run holds it already."""
    out = Path(path)
    if fcntl is None or os.environ.get(HELD_ENV) == held_key(out):
        yield out
        return
    made = []  # the directories mkdir creates, deepest first
    d = out
    while not d.exists() and d != d.parent:
        made.append(d)
        d = d.parent
    fd = _lock(out, command, flag)
    try:
        yield out
    finally:
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):  # (a failed run's clean-up may have removed it all)
                os.unlink(out / LOCK)  # before the unlock: a run that opened this file then sees it is stale
            os.close(fd)
        for d in made:
            try:
                os.rmdir(d)  # only if empty: nothing was written there
            except FileNotFoundError:
                continue
            except OSError:
                break


def _lock(out: Path, command: str, flag: str) -> int | None:
    """An open descriptor of out/LOCK holding its exclusive flock (None where the file system has no
    flock: a warning, and the run goes on unguarded)."""
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the directory was removed by a run finishing there: create it again
            continue
        except OSError as e:
            raise ConfigError(f"{flag}: cannot create {out / LOCK}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip()
            os.close(fd)
            raise ConfigError(f"{flag}: {out} is in use by another longpatch run{f' ({holder})' if holder else ''}, "
                              f"which writes there; wait for it to finish (then the same command resumes), or "
                              f"pass another {flag}") from None
        except OSError as e:
            log.warning("longpatch: %s: cannot lock %s (%s); another run on the same directory is not refused",
                        flag, out, e.strerror or e)
            os.close(fd)
            return None
        try:  # its last holder may have removed the file as it finished, after we opened it: lock the one there now
            same = os.path.samestat(os.fstat(fd), os.stat(out / LOCK))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}: longpatch {command}\n".encode())  # for the refusal of another run
    return fd


def owns_out(param: str, command: str, expand: bool = False):
    """Decorator of a command's function whose argument `param` is its --out directory: the directory is
    checked (check_out) and held (hold_out) for the call. expand: the function expands ~ in it."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            out = bound.arguments[param]
            out = check_out(Path(out).expanduser() if expand else out, command)
            with hold_out(out, command):
                return fn(*args, **kwargs)
        return call
    return wrap


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
