"""The grammar of list-valued options, one parser for every command and every Python entry point.

A list is comma-separated items; an int list may hold ranges start:end[:step] with the END INCLUDED
(so 0:28:4 is the HyperAttention paper's Figure 3 axis); a float list may hold start:end:step. An
empty item ('a,,b', '1,', ',') is an error everywhere: a stray comma never silently means something.
A Python caller may pass a list or tuple instead of the text; its items are checked the same way.
"""
from __future__ import annotations

from typing import Sequence

from .errors import ConfigError

RANGE_HELP = "start:end or start:end:step, end included"
# The most values one list option may expand to: a sweep or grid is a handful of points, never millions.
# A range is counted before it is expanded, so '1:100000000000' is an error, not a MemoryError or an hour.
MAX_VALUES = 10_000
# Paths and names of files, models and directories (--model, --config, --out, ...): the OS limits, checked
# up front so that an over-long one is a one-line error rather than an OSError from deep inside.
MAX_PATH, MAX_NAME = 4096, 255
# The longest sequence any length option takes (--prefill, --seq-lens, --lengths, ...): 2^30 tokens is past every
# model's context; a larger count is a one-line error rather than an allocator's or an int64 overflow's traceback.
MAX_TOKENS = 2 ** 30


def split_items(flag: str, spec: "str | Sequence", allowed: str) -> list[str]:
    """'a, b,c' (or a sequence) -> ['a', 'b', 'c']; an empty list or an empty item is an error naming `flag`."""
    items = [str(x).strip() for x in spec] if isinstance(spec, (list, tuple)) else str(spec).split(",")
    items = [x.strip() for x in items]
    if not any(items):
        raise ConfigError(f"{flag}: got {_show(spec)} (empty); allowed: {allowed}")
    if not all(items):
        raise ConfigError(f"{flag}: got {_show(spec)} with an empty item (a stray comma); allowed: {allowed}")
    return items


def parse_names(flag: str, spec: "str | Sequence", allowed: str = "comma-separated names") -> list[str]:
    """Comma-separated names, in order, each once."""
    return _dedupe(split_items(flag, spec, allowed))


def is_uint(text: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts '²' or '٣', which int() refuses or reads otherwise."""
    return text.isascii() and text.isdigit()


def parse_ints(flag: str, spec: "str | int | Sequence", low: int = 0, words: Sequence[str] = (),
               allowed: str | None = None, high: int | None = None, repeats: bool = True) -> list:
    """Ints in [low, high] and ranges (end included), plus the given words (e.g. 'all') -> the flat list, in the
    order given, each once (repeats=False: a value given twice is an error). Each range is checked against
    the bounds and MAX_VALUES before it is expanded."""
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    allowed = allowed or (f"comma-separated ints {bounds} or ranges ({RANGE_HELP})"
                          + (f", or {', '.join(repr(w) for w in words)}" if words else ""))
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = [spec]
    out: list = []
    for part in split_items(flag, spec, allowed):
        if part in words:
            out.append(part)
        elif ":" in part:
            bits = [b.strip() for b in part.split(":")]
            if len(bits) not in (2, 3) or not all(map(is_uint, bits)):
                raise ConfigError(f"{flag}: bad range {_clip(part)!r}; allowed: {RANGE_HELP} (ints {bounds})")
            start, end, step = int(bits[0]), int(bits[1]), int(bits[2]) if len(bits) == 3 else 1
            if step < 1 or end < start or start < low or (high is not None and end > high):
                raise ConfigError(f"{flag}: bad range {_clip(part)!r}; need {low} <= start <= end"
                                  f"{'' if high is None else f' <= {high}'} and step >= 1 (end included)")
            _count(flag, part, len(out) + (end - start) // step + 1)
            out.extend(range(start, end + 1, step))
        elif is_uint(part) and low <= int(part) and (high is None or int(part) <= high):
            out.append(int(part))
        else:
            raise ConfigError(f"{flag}: got {_show(spec)}; allowed: {allowed}")
    unique = _dedupe(out)
    if not repeats and len(unique) < len(out):
        seen: set = set()
        twice = next(x for x in out if x in seen or seen.add(x))
        raise ConfigError(f"{flag}: got {_show(spec)}, which lists {twice} more than once; allowed: {allowed}, "
                          "each once")
    return unique


def parse_floats(flag: str, spec: "str | Sequence", low: float, high: float, allowed: str) -> list[float]:
    """Finite numbers in [low, high] and ranges start:end:step (end included when a step lands on it, never
    a value past it) -> sorted distinct values (rounded to 6 places, so 0:1:0.1 gives 0.3, not
    0.30000000000000004)."""
    values: list[float] = []
    for part in split_items(flag, spec, allowed):
        try:
            if ":" in part:
                start, end, step = _float_range(part)
            else:
                values.append(_finite(part))
                continue
        except ValueError:
            raise ConfigError(f"{flag}: got {_show(spec)}; allowed: {allowed}") from None
        if start < low or end > high:
            raise ConfigError(f"{flag}: got {_show(spec)}; every value must lie in [{low}, {high}]")
        # The last step that does not pass the end; the slack absorbs float error (0.1 + 3 * 0.3 is not
        # exactly 1.0, and (1 - 0) / 0.1 is 9.999999999999998), and min() keeps a rounded value inside.
        n = int((end - start) / step + 1e-9)
        _count(flag, part, len(values) + n + 1)
        values += [min(round(start + i * step, 6), end) for i in range(n + 1)]
    values = sorted({round(v, 6) for v in values})
    if values[0] < low or values[-1] > high:
        raise ConfigError(f"{flag}: got {_show(spec)}; every value must lie in [{low}, {high}]")
    return values


def _float_range(part: str) -> tuple[float, float, float]:
    bits = [_finite(b) for b in part.split(":")]
    if len(bits) != 3 or bits[2] <= 0 or bits[1] < bits[0]:
        raise ValueError(part)
    return bits[0], bits[1], bits[2]


def _count(flag: str, part: str, n: int) -> None:
    if n > MAX_VALUES:
        raise ConfigError(f"{flag}: {_clip(part)!r} makes {n} values; allowed: at most {MAX_VALUES} values in all "
                          "(a larger step, or fewer ranges)")


def check_path(flag: str, text: str) -> str:
    """The text of a path-like option (--out, --save, --model, --config, --data, ...): not empty or blank
    (an empty --out would write into the current directory, a blank one make a directory named by
    spaces), and within the OS limits on a path and on each of its names."""
    text = str(text)
    if not text.strip():
        raise ConfigError(f"{flag}: got {text!r} (empty); allowed: a path or name")
    longest = max(len(name) for name in text.split("/"))
    if len(text) > MAX_PATH or longest > MAX_NAME:
        raise ConfigError(f"{flag}: got a path of {len(text)} characters ({_clip(text)!r}); allowed: at most "
                          f"{MAX_PATH} characters, {MAX_NAME} per name")
    return text


LAYERS_HELP = "N (the final N layers), 'all', or layer indices 8,9,12 / 8:12 (end included)"


def parse_layers(spec: "str | int | Sequence", flag: str = "--layers"):
    """--layers / a config's `layers`, in every command: which layers are replaced. 'N' -> N (the final N
    layers), 'all' -> 'all', '8,9,12' or '8:12' (end included) or '0,4:6' -> sorted layer indices. A single
    index is written as a one-item range, 8:8 ('8' is the final 8 layers)."""
    if isinstance(spec, str) and spec.strip() == "all":
        return "all"
    if isinstance(spec, str) and is_uint(spec.strip()):
        return int(spec.strip())
    items = parse_ints(flag, spec, words=("all",), allowed=LAYERS_HELP, repeats=False)
    if "all" in items:
        raise ConfigError(f"{flag}: got {_show(spec)}; 'all' cannot be combined with layer indices")
    return sorted(items)


COUNTS_HELP = "counts of final layers, one run each: 0,4,8 or 0:28:4 (end included), 'all' for every layer"


def parse_layer_counts(spec: "str | int | Sequence", flag: str = "--layer-counts") -> list:
    """--layer-counts: the sweep of the evaluations and benchmarks, counts of final layers (and 'all'), in
    the order given, each once: '0:28:4' -> [0, 4, ..., 28]."""
    return parse_ints(flag, spec, words=("all",), allowed=COUNTS_HELP)


def parse_set(pair: str) -> tuple[str, object]:
    """One --set KEY=VALUE -> (key, value). The value is YAML, so 128, true, null and [1, 2] have their
    types, and empty is null; malformed YAML is a one-line error naming the pair. The value is read as a
    config file is (yamlio.load_yaml: a key twice, or aliases that expand past a config's size, refused)."""
    import yaml

    from .yamlio import load_yaml

    key, sep, raw = str(pair).partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {_show(str(pair))}: expected key=value, e.g. --set block_size=128 or --set layers=4")
    if not raw:
        return key, None
    try:
        return key, load_yaml(raw, f"--set {_clip(key)}")
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or "cannot be parsed").split())
        raise ConfigError(f"--set {_show(str(pair))}: malformed YAML value {_show(raw)} ({problem}); allowed: a YAML "
                          "value, e.g. 128, true, null, 'text' or [1, 2]") from None


def missing_path(flag: str, text: str, allowed: str) -> ConfigError:
    """The error of a path option that names nothing usable: whether it does not exist or is the wrong kind."""
    import os

    state = "is not what this option reads" if os.path.exists(text) else "does not exist"
    return ConfigError(f"{flag}: {_clip(str(text))!r} {state}; allowed: {allowed}")


def _finite(text: str) -> float:
    x = float(text)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(text)
    return x


def _dedupe(items: list) -> list:
    return list(dict.fromkeys(items))  # in order, each once, in linear time


def _clip(text: str, n: int = 60) -> str:
    """A long value shown in a message by its head: a 5000-character value must not be a 5000-character line."""
    return text if len(text) <= n else text[:n] + "..."


def _show(spec) -> str:
    text = spec if isinstance(spec, str) else ",".join(map(str, spec)) if isinstance(spec, (list, tuple)) else spec
    return repr(_clip(text) if isinstance(text, str) else text)
