"""Issue 39: a dependency outside the range longpatch declares is one line naming the package, the version found
and the range, at import; for the CLI, that line and exit 2 without a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

from longpatch import dependencies


def _fake(monkeypatch, declared, versions):
    monkeypatch.setattr(metadata, "requires", lambda dist: declared)

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)


def test_out_of_range_and_missing(monkeypatch):
    """A missing package is left to its own ModuleNotFoundError where it is imported (see problems())."""
    _fake(monkeypatch, ["typer<1,>=0.16", "torch>=2.11", "rich>=13", "pytest>=8; extra == \"dev\""],
          {"typer": "0.12.5", "torch": "2.13.0+cpu"})
    found = dependencies.problems()
    assert found == ["typer 0.12.5 is installed; longpatch needs typer<1,>=0.16 (pip install 'typer<1,>=0.16')"]
    with pytest.raises(dependencies.DependencyError) as e:
        dependencies.check()
    assert "\n" not in str(e.value) and "typer 0.12.5" in str(e.value)


def test_too_new_and_all_fitting(monkeypatch):
    _fake(monkeypatch, ["transformers<6,>=5.0"], {"transformers": "6.0.0"})
    assert dependencies.problems() == ["transformers 6.0.0 is installed; longpatch needs transformers<6,>=5.0 "
                                       "(pip install 'transformers<6,>=5.0')"]
    _fake(monkeypatch, ["transformers<6,>=5.0"], {"transformers": "5.17.0"})
    assert dependencies.problems() == []


def test_this_environment_fits():
    """The environment the tests run in is one of the tested ones, so every declared range holds."""
    assert dependencies.problems() == []


def test_cli_reports_one_line_and_exit_2(tmp_path):
    """A distribution's metadata earlier on the path than the real one: the version longpatch sees is too old
    (the module itself is the real one, so only the check can fail)."""
    fake = tmp_path / "rich-12.0.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: rich\nVersion: 12.0.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "longpatch", "list"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "longpatch: rich 12.0.0 is installed; longpatch needs rich>=13 (pip install 'rich>=13')"]
    assert r.stdout == ""
    # From Python it is an ImportError (a subclass) with the same line.
    r = subprocess.run([sys.executable, "-c", "import longpatch"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 1 and "DependencyError: longpatch: rich 12.0.0 is installed" in r.stderr
