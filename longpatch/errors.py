"""Errors longpatch raises on purpose: each carries a one-line message meant for the user."""


class LongpatchError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ConfigError(LongpatchError, ValueError):
    """A configuration key has a bad value: the message names the key, the value and what is allowed."""


class UnsupportedModelError(LongpatchError, TypeError):
    """No registered family knows how to patch this model."""


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """The one check of an int option or argument (bools are not ints): ConfigError naming `name` (an
    option, a config key, or an op and its argument: 'moba_attention: topk'), the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ConfigError(f"{name}: got {shown(value)}; allowed: {allowed}")
    return value


SHOWN = 80  # the most characters of a value an error message quotes
_END = object()  # an exhausted iterator in shown()


class _Text(str):
    """A piece of a repr to emit as it is (a bracket or a separator), not a value to repr."""


def _container(value):
    """The pieces of a list, tuple, set or dict's repr: brackets and separators as _Text, items as values."""
    if isinstance(value, dict):
        yield _Text("{")
        for i, (k, v) in enumerate(value.items()):
            yield from ((_Text(", "),) if i else ())
            yield k
            yield _Text(": ")
            yield v
        yield _Text("}")
        return
    if isinstance(value, (set, frozenset)) and not value:
        yield _Text(f"{type(value).__name__}()")
        return
    opening, closing = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
    yield _Text(opening)
    for i, item in enumerate(value):
        yield from ((_Text(", "),) if i else ())
        yield item
    if isinstance(value, tuple) and len(value) == 1:
        yield _Text(",")
    yield _Text(closing)


def shown(value, limit: int = SHOWN) -> str:
    """repr(value) as an error message quotes it: at most about `limit` characters, then '...'.

    Built piece by piece (an explicit stack, no recursion) and stopped once `limit` characters are out,
    so a value of a billion items, a deep nesting, a structure that shares itself (YAML aliases) or one
    that contains itself costs `limit` characters of work, never its full repr."""
    out: list[str] = []
    size = 0
    stack = [iter([value])]
    while stack and size <= limit:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        if isinstance(item, _Text):
            piece = str(item)
        elif isinstance(item, (list, tuple, dict, set, frozenset)):
            stack.append(_container(item))
            continue
        elif isinstance(item, str):
            piece = repr(item[:limit + 1])  # the head only: a long string is cut below anyway
        elif isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > 256:
            # past ~4300 digits str(int) raises; past 77 the digits say nothing a count does not
            piece = f"<an int of about {int(item.bit_length() * 0.30103) + 1} digits>"
        else:
            piece = repr(item)
        out.append(piece)
        size += len(piece)
    text = "".join(out)
    return text if size <= limit else text[:limit] + "..."

