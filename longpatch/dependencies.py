"""The installed dependencies against the ranges longpatch declares, checked when the package is imported.

A dependency outside its range fails deep inside itself (an old typer raises a TypeError from click's
internals when the CLI starts; an old transformers lacks AttentionInterface): this check names the
package, the version found and the range needed in one line instead. The ranges are read from the
installed package's own metadata (pyproject.toml's `dependencies`), so there is one list of them; a
source tree that is not installed has no metadata and is not checked.
"""
from __future__ import annotations

from importlib import metadata


class DependencyError(ImportError):
    """An installed dependency is outside the range longpatch declares (one-line message)."""


def problems(dist: str = "longpatch") -> list[str]:
    """One line per declared (non-optional) dependency installed at a version outside its range; [] when all
    fit or when `dist` is not installed (a bare source tree)."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with transformers; without it there is nothing to check with
        return []
    try:
        declared = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for text in declared:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (triton, cuda, dev, ...): optional, checked where it is used
        wanted = f"{req.name}{req.specifier}"
        try:
            found = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            # Not an error here: a missing package fails where it is imported, with Python's own clear
            # ModuleNotFoundError, and only on the paths that need it (an offline GPU box without
            # accelerate still runs the ops and benchmarks).
            continue
        try:
            # A local build tag (torch 2.13.0+cpu) is the same release for the range's purpose.
            ok = req.specifier.contains(Version(found).public, prereleases=True)
        except InvalidVersion:
            continue
        if not ok:
            out.append(f"{req.name} {found} is installed; longpatch needs {wanted} (pip install '{wanted}')")
    return out


def check(dist: str = "longpatch") -> None:
    """Raise DependencyError with one line naming every dependency installed outside its range."""
    found = problems(dist)
    if found:
        raise DependencyError("longpatch: " + "; ".join(found))


def cli_invocation() -> bool:
    """Whether this process is the `longpatch` command (the console script or `python -m longpatch`)."""
    import os
    import sys

    argv = getattr(sys, "orig_argv", sys.argv)
    if os.path.basename(sys.argv[0]) == "longpatch":
        return True
    return any(a == "-m" and b == "longpatch" for a, b in zip(argv, argv[1:]))
