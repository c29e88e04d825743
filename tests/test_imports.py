"""Every relative import in the package resolves, also those inside functions that only a GPU runs (a lazy
``from ...kernels.decode import paged_decode`` went one level too far and failed on the first CUDA call only)."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import longpatch

ROOT = Path(longpatch.__file__).resolve().parent
KERNELS = ROOT.parent / "kernels"  # installed as longpatch.kernels


def _modules():
    for base, package in ((ROOT, "longpatch"), (KERNELS, "longpatch.kernels")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
            yield path, name, pkg


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_relative_imports_resolve():
    bad = []
    for path, _, pkg in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
            try:
                target = importlib.util.resolve_name("." * node.level + (node.module or ""), pkg)
            except ImportError as e:
                bad.append(f"{where}: {e}")
                continue
            spec = importlib.util.find_spec(target)
            if spec is None:
                bad.append(f"{where}: no module {target}")
                continue
            origin = Path(spec.origin) if spec.origin else None
            if origin is None or origin.suffix != ".py":
                continue
            defined = _top_level_names(origin)
            for alias in node.names:
                sub = importlib.util.find_spec(f"{target}.{alias.name}") if spec.submodule_search_locations else None
                if alias.name != "*" and alias.name not in defined and sub is None:
                    bad.append(f"{where}: {target} has no {alias.name}")
    assert not bad, "\n".join(bad)
