"""Errors longpatch raises on purpose: each carries a one-line message meant for the user."""


class LongpatchError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""


class ConfigError(LongpatchError, ValueError):
    """A configuration key has a bad value: the message names the key, the value and what is allowed."""


class UnsupportedModelError(LongpatchError, TypeError):
    """No registered family knows how to patch this model."""
