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
               allowed: str | None = None) -> list:
    """Ints >= low and ranges (end included), plus the given words (e.g. 'all') -> the flat list, in the
    order given, each once."""
    allowed = allowed or (f"comma-separated ints >= {low} or ranges ({RANGE_HELP})"
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
                raise ConfigError(f"{flag}: bad range {part!r}; allowed: {RANGE_HELP} (ints >= {low})")
            start, end, step = int(bits[0]), int(bits[1]), int(bits[2]) if len(bits) == 3 else 1
            if step < 1 or end < start or start < low:
                raise ConfigError(f"{flag}: bad range {part!r}; need {low} <= start <= end and step >= 1 "
                                  "(end included)")
            out.extend(range(start, end + 1, step))
        elif is_uint(part) and int(part) >= low:
            out.append(int(part))
        else:
            raise ConfigError(f"{flag}: got {_show(spec)}; allowed: {allowed}")
    return _dedupe(out)


def parse_floats(flag: str, spec: "str | Sequence", low: float, high: float, allowed: str) -> list[float]:
    """Finite numbers in [low, high] and ranges start:end:step (end included) -> sorted distinct values
    (rounded to 6 places, so 0:1:0.1 gives 0.3, not 0.30000000000000004)."""
    values: list[float] = []
    for part in split_items(flag, spec, allowed):
        try:
            if ":" in part:
                bits = [_finite(b) for b in part.split(":")]
                if len(bits) != 3 or bits[2] <= 0 or bits[1] < bits[0]:
                    raise ValueError
                n = int(round((bits[1] - bits[0]) / bits[2]))
                values += [bits[0] + i * bits[2] for i in range(n + 1)]
            else:
                values.append(_finite(part))
        except ValueError:
            raise ConfigError(f"{flag}: got {_show(spec)}; allowed: {allowed}") from None
    values = sorted({round(v, 6) for v in values})
    if values[0] < low or values[-1] > high:
        raise ConfigError(f"{flag}: got {_show(spec)}; every value must lie in [{low}, {high}]")
    return values


LAYERS_HELP = "N (the final N layers), 'all', or layer indices 8,9,12 / 8:12 (end included)"


def parse_layers(spec: "str | int | Sequence", flag: str = "--layers"):
    """--layers / a config's `layers`, in every command: which layers are replaced. 'N' -> N (the final N
    layers), 'all' -> 'all', '8,9,12' or '8:12' (end included) or '0,4:6' -> sorted layer indices. A single
    index is written as a one-item range, 8:8 ('8' is the final 8 layers)."""
    if isinstance(spec, str) and spec.strip() == "all":
        return "all"
    if isinstance(spec, str) and is_uint(spec.strip()):
        return int(spec.strip())
    items = parse_ints(flag, spec, words=("all",), allowed=LAYERS_HELP)
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
    types, and empty is null; malformed YAML is a one-line error naming the pair."""
    import yaml

    key, sep, raw = str(pair).partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {pair!r}: expected key=value, e.g. --set block_size=128 or --set layers=4")
    if not raw:
        return key, None
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or "cannot be parsed").split())
        raise ConfigError(f"--set {pair!r}: malformed YAML value {raw!r} ({problem}); allowed: a YAML value, e.g. "
                          "128, true, null, 'text' or [1, 2]") from None


def _finite(text: str) -> float:
    x = float(text)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(text)
    return x


def _dedupe(items: list) -> list:
    out = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def _show(spec) -> str:
    return repr(spec if isinstance(spec, str) else ",".join(map(str, spec)) if isinstance(spec, (list, tuple))
                else spec)
