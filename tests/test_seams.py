"""The seams between the layers: sequence parallelism reaches a model only through the
public family API (longpatch.families) and a method only through the registry and what the method
declares (longpatch.methods); here its modules are read as source, and each method's declaration
``Method.couples_heads`` is held to what the method computes."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

import longpatch
from longpatch.families import Family, available_families
from longpatch.methods import Method, available_methods
from longpatch.parallel import head_plan

PARALLEL = Path(longpatch.__file__).parent / "parallel"
SOURCES = sorted(PARALLEL.glob("*.py"))
# registries whose packages parallel/ may import from, but none of their modules by name
REGISTRIES = ("longpatch.families", "longpatch.methods")


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every import in one module of longpatch.parallel."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(_absolute(node, "longpatch.parallel"), a.name, node.lineno) for a in node.names]
    return out


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_parallel_imports_no_private_name_and_no_family_or_method_module(path):
    bad = []
    for module, name, line in _imports(path):
        if not module.startswith("longpatch"):
            continue
        where = f"{path.name}:{line}: {module}" + (f".{name}" if name else "")
        if _private(module) or (name is not None and _private(name)):
            bad.append(f"{where} (a private name)")
        if module.startswith("longpatch.eval"):
            bad.append(f"{where} (parallel/ sits below eval/)")
        for reg in REGISTRIES:
            if module.startswith(reg + ".") or (module == reg and name is not None
                                                and importlib.util.find_spec(f"{reg}.{name}") is not None):
                bad.append(f"{where} (a family or method module by name; use the registry)")
        if name is not None and not module.startswith("longpatch.parallel"):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, (Method, *{type(f) for f in available_families().values()})):
                bad.append(f"{where} (a family or method itself; look it up from the model or the registry)")
    assert not bad, "\n".join(bad)


def _defaults(tree: ast.AST) -> set[int]:
    """ids of the nodes that are a function's parameter defaults."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            ids |= {id(d) for d in node.args.defaults + node.args.kw_defaults if d is not None}
    return ids


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_parallel_names_no_family_or_method(path):
    """No string equal to a family's or method's name (no branch on which one it is), and no private
    attribute read through a module. A parameter default is the caller's choice: ulysses_attention's
    method="exact" stays the op's default."""
    names = set(available_families()) | set(available_methods())
    tree = ast.parse(path.read_text())
    defaults = _defaults(tree)
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                and id(node) not in defaults:
            bad.append(f"{path.name}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and _private(node.attr):
            bad.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_every_family_offers_what_sequence_parallelism_needs():
    for fam in available_families().values():
        for name in ("attention_heads", "wrap_attention", "unwrap_attention", "num_layers"):
            assert callable(getattr(fam, name, None)), f"{fam.name}: no {name}"
    assert Family.wrap_attention.__doc__  # the protocol documents the contract


# --------------------------------------------------------------------------- couples_heads

# Every method longpatch registers (test helpers register their own probes: not part of this).
METHODS = sorted(name for name, m in available_methods().items() if m.prefill.__module__.startswith("longpatch."))
N, D, HQ = 160, 16, 4
# small blocks so that each method approximates at N tokens (else every variant is exact attention)
SMALL = {
    "hyper": dict(min_seq_len=32, block_size=16, sample_size=16, seed=3),
    "moba": dict(chunk_size=16, topk=4),
    "nsa": dict(compress_block=16, compress_stride=8, select_block=16, num_selected=6, window=16),
    "sparse": dict(window=16, global_tokens=4, random_blocks=2, block=16, seed=5),
    "performer": dict(num_features=16, seed=7),
}


def _variants(method: Method) -> list[dict]:
    """The small params, and each of them with one bool flipped or one choice changed (a new method's
    switches are covered without a line here); variants the method refuses are left out."""
    base = method.resolve_params(SMALL.get(method.name, {}))
    out = [base]
    for name, p in method.params.items():
        choices = getattr(p.check, "choices", None)
        if p.types == (bool,):
            choices = (True, False)
        for c in choices or ():
            if c != base[name]:
                try:
                    out.append(method.resolve_params({**base, name: c}))
                except longpatch.ConfigError:
                    pass
    return out


def _cases():
    return [pytest.param(name, p, id=f"{name}-{i}") for name in METHODS
            for i, p in enumerate(_variants(available_methods()[name]))]


@pytest.mark.parametrize("name,params", _cases())
def test_couples_heads_declaration_matches_the_method(name, params):
    """One KV group of HQ query heads: a method that does not declare couples_heads gives each query head
    the same output when half of the group is computed alone (what ulysses does with a group that spans
    ranks), and one that declares it does not, so the whole group is needed on one rank."""
    method = available_methods()[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, N, D, generator=g)
    k, v = torch.randn(1, 1, N, D, generator=g), torch.randn(1, 1, N, D, generator=g)
    bound = method.bind(params, D)
    whole = bound(q, k, v, causal=True)[:, :HQ // 2]
    half = bound(q[:, :HQ // 2], k, v, causal=True)
    err = float((whole - half).abs().max())
    declared = method.couples(params)
    if declared:
        assert err > 1e-3, f"{name} {params}: declares couples_heads, yet its heads are independent"
    else:
        assert err < 1e-5, f"{name} {params}: the heads of a KV group depend on each other ({err}); " \
                           "declare Method.couples_heads"
    # what ulysses does with it: a rank gets the whole group exactly when the method couples its heads
    plan = head_plan(HQ, 1, 2, whole_groups=declared)
    assert plan[1][0] == (list(range(HQ)) if declared else [2, 3])


def test_couples_reads_given_or_resolved_params():
    moba = available_methods()["moba"]
    assert not moba.couples({}) and moba.couples({"shared_selection": True})
    assert moba.couples({"selection": "estimate"}) and moba.couples(moba.resolve_params({"selection": "estimate"}))
    assert available_methods()["nsa"].couples({}) and not available_methods()["exact"].couples({})


# ---- the whole package: imports run one way ---------------------------------------------------------

ROOT = Path(longpatch.__file__).parent


def _package_imports() -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported longpatch module, name)} of every import in the package, in functions too."""
    out: dict[str, set[tuple[str, str]]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        init = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if init else parts)
        package = module if init else module.rsplit(".", 1)[0]
        found = out.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("longpatch")):
                found.update((_absolute(node, package), a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                found.update((a.name, "") for a in node.names if a.name.startswith("longpatch"))
    return out


def test_no_module_imports_another_modules_private_name():
    imports = _package_imports()
    bad = [f"{m} imports {name} from {target}" for m, found in imports.items() for target, name in found
           if name.startswith("_") and not name.startswith("__") and target != m
           and f"{target}.{name}" not in imports]  # `from . import _module` is a module, not a name
    assert not bad, bad


def test_no_import_cycle_in_the_package():
    imports = _package_imports()
    graph = {m: {f"{t}.{n}" if f"{t}.{n}" in imports else t for t, n in found} - {m} for m, found in imports.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            # a package's __init__ importing its own submodules is how packages are built, not a cycle
            if state.get(t) == 1 and not m.startswith(t + "."):
                raise AssertionError(" -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}")
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
