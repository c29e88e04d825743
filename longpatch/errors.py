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
        raise ConfigError(f"{name}: got {value!r}; allowed: {allowed}")
    return value
