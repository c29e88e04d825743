"""scripts/heldout_report.py (pooled figures and their intervals), heldout_corpora.py's --exclude (#41) and its
copies corpus (a library's passage copied from far back: built, deterministic, no stdlib text)."""
import json
import math
from pathlib import Path

import pytest
from helpers import load_script


def _ppl_run(path, docs: dict[str, tuple[float, float]], tokens: int = 100):
    """An `eval ppl` output directory: exact and one config, per document (exact nll_sum, config nll_sum)."""
    path.mkdir()
    configs = [{"config_id": "e0", "config": "exact", "layers": 0}, {"config_id": "c1", "config": "cfg", "layers": 4}]
    recs = [{"config_id": cid, "layers": layers, "digest": d, "nll_sum": nll, "scored_tokens": tokens}
            for d, pair in docs.items() for (cid, layers), nll in zip((("e0", 0), ("c1", 4)), pair)]
    (path / "results.json").write_text(json.dumps({"configs": configs}))
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_wilson_interval_stays_in_range_and_covers_the_proportion():
    mod = load_script("heldout_report")
    lo, hi = mod.wilson(20, 20)
    assert hi == 1.0 and 0.8 < lo < 0.85  # all kept: not the empty interval [1, 1]
    lo, hi = mod.wilson(31, 33)
    assert lo < 31 / 33 < hi and lo < 0.95 < hi  # 94% does not tell "under 95%" apart from it
    assert mod.wilson(0, 0) is None


def test_perplexity_pools_runs_document_by_document_with_a_paired_interval(tmp_path):
    mod = load_script("heldout_report")
    # config's nll 5 above exact's on every document of 100 tokens: ratio exp(0.05) whatever the document
    _ppl_run(tmp_path / "a", {"d1": (300.0, 305.0), "d2": (400.0, 405.0)})
    _ppl_run(tmp_path / "b", {"d1": (350.0, 355.0)})  # same digest, another run: a document of its own
    got = mod.perplexity([tmp_path / "a", tmp_path / "b"])
    assert got["cfg"]["docs"] == 3 and got["exact"]["docs"] == 3
    assert got["cfg"]["ppl"] == pytest.approx(math.exp(1065 / 300))
    assert got["cfg"]["vs_exact"] == pytest.approx(math.exp(0.05) - 1)
    lo, hi = got["cfg"]["vs_exact_95"]
    assert lo == pytest.approx(math.exp(0.05) - 1) and hi == pytest.approx(lo)  # no spread: a point


def test_perplexity_interval_widens_with_documents_that_disagree(tmp_path):
    mod = load_script("heldout_report")
    _ppl_run(tmp_path / "a", {f"d{i}": (400.0, 400.0 + (12.0 if i % 2 else -8.0)) for i in range(8)})
    r = mod.perplexity([tmp_path / "a"])["cfg"]
    lo, hi = r["vs_exact_95"]
    assert lo < r["vs_exact"] < hi and lo < 0 < hi  # +2% on average, within the documents' spread


def test_report_pools_needle_runs_and_writes_the_summary(tmp_path, capsys):
    mod = load_script("heldout_report")
    for name, rows in (("s0", [("p1", True, True), ("p2", True, False)]), ("s1", [("p3", True, True),
                                                                                ("p4", False, True)])):
        (tmp_path / name).mkdir()
        recs = [{"config": c, "layers": layers, "digest": d, "correct": ok}
                for d, e_ok, c_ok in rows for c, layers, ok in (("exact", 0, e_ok), ("cfg", 4, c_ok))]
        (tmp_path / name / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "summary.json"
    assert mod.main(["--needles", f"code={tmp_path / 's0'},{tmp_path / 's1'}", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["needles"]["code"]["cfg"]
    assert (row["prompts"], row["found"], row["kept"], row["exact_found"]) == (4, 3, 2, 3)
    assert "| cfg | 3/4 | 2 of 3 |" in capsys.readouterr().out


def test_used_files_lists_an_earlier_builds_documents(tmp_path):
    mod = load_script("heldout_corpora")
    m = tmp_path / "manifest.json"
    m.write_text(json.dumps({"corpora": {"code": {"documents": [{"files": ["numpy/a.py", "numpy/b.py"]},
                                                                {"files": ["numpy/c.py"]}]}}}))
    assert mod.used_files([m], "code") == {"numpy/a.py", "numpy/b.py", "numpy/c.py"}
    assert mod.used_files([m], "prose") == set()


# ---- heldout_corpora.py's copies corpus: passages of a library copied from far back --------------------------

DOC_TOKENS = 16384


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """The copies corpus built (2 documents, no other corpus) at seed 0, again at seed 0 with cold caches,
    and at seed 1 without seed 0's files: (module, {name: out folder})."""
    mod = load_script("heldout_corpora")
    root = tmp_path_factory.mktemp("copies")

    def build(name, *extra):
        try:
            mod.main(["--out", str(root / name), "--corpora", "copies", "--docs", "2", "--doc-tokens",
                      str(DOC_TOKENS), "--filler-tokens", "1", *extra])
        except SystemExit as e:
            if "give only" in str(e):
                pytest.skip(f"this machine lacks libraries installed twice: {e}")
            raise
        return root / name

    out = {"s0": build("s0")}
    for f in (mod.lib_files, mod.read, mod.usable, mod.similarity):
        f.cache_clear()
    out["s0_again"] = build("s0_again")
    out["s1"] = build("s1", "--seed", "1", "--exclude", str(out["s0"] / "manifest.json"))
    return mod, out


def _docs(out):
    manifest = json.loads((out / "manifest.json").read_text())
    recs = [json.loads(line) for line in (out / "copies" / "lcc.jsonl").read_text().splitlines()]
    return manifest, recs


def test_copies_documents_repeat_a_long_passage_from_far_back(copies):
    from transformers import AutoTokenizer

    from longpatch.assets import demo_model_path

    mod, out = copies
    tok = AutoTokenizer.from_pretrained(demo_model_path())
    manifest, recs = _docs(out["s0"])
    assert list(manifest["corpora"]) == ["copies"] and manifest["corpora"]["copies"]["subset"] == "lcc"
    docs = manifest["corpora"]["copies"]["documents"]
    assert len(docs) == len(recs) == 2
    for doc, rec in zip(docs, recs):
        ids = tok(rec["context"], add_special_tokens=False)["input_ids"]
        assert len(ids) == rec["length"] == doc["tokens"] >= DOC_TOKENS
        c = doc["copy"]
        assert 0 < c["start"] < c["end"] < c["copy_start"] < c["copy_end"] <= DOC_TOKENS
        assert c["distance"] == c["copy_start"] - c["start"] >= 2000
        i, j = c["longest_run_at"]
        n = c["longest_run"]
        # a run of >= 1000 tokens of A that A' repeats unchanged, >= 2000 tokens later
        assert n >= 1000 and ids[i:i + n] == ids[j:j + n] and j - i >= 2000
        assert c["start"] <= i and i + n <= c["end"] and c["copy_start"] <= j and j + n <= c["copy_end"]
        assert [f for f in doc["files"] if f.startswith(c["source"])] and \
            [f for f in doc["files"] if f.startswith(c["copy"])]
    assert (out["s0"] / "copies_filler.jsonl").is_file() and (out["s0"] / "copies_needle.yaml").is_file()


def test_copies_corpus_is_deterministic_and_excludes_earlier_builds(copies):
    mod, out = copies
    for name in ("copies/lcc.jsonl", "copies_filler.jsonl", "manifest.json"):
        assert (out["s0"] / name).read_bytes() == (out["s0_again"] / name).read_bytes(), name
    s0, _ = _docs(out["s0"])
    s1, _ = _docs(out["s1"])

    def contents(manifest):
        return {mod.read(Path(f))[1] for d in manifest["corpora"]["copies"]["documents"] for f in d["files"]}

    assert len(s1["corpora"]["copies"]["documents"]) == 2
    assert not contents(s0) & contents(s1)  # no file's text in both, whatever its path


def test_copies_corpus_leaves_the_stdlib_out(copies):
    import sysconfig

    mod, out = copies
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("s0", "s1"):
        manifest, _ = _docs(out[name])
        for doc in manifest["corpora"]["copies"]["documents"]:
            for f in map(Path, doc["files"]):
                assert not f.is_relative_to(stdlib) or "site-packages" in f.parts, f
                assert not mod.stdlib_like(mod.read(f)[0]), f
    # a stdlib module, and the vendored backport of it, are stdlib-like; numpy's code is not
    parser = stdlib / "tomllib" / "_parser.py"
    assert mod.stdlib_like(parser.read_text(encoding="utf-8"))
    assert mod.stdlib_like(parser.read_text(encoding="utf-8").replace("tomllib", "tomli"))
    numpy_file = Path(mod.numpy.__file__).parent / "_core" / "numeric.py"
    if numpy_file.is_file():
        assert not mod.stdlib_like(numpy_file.read_text(encoding="utf-8"))
    vendored = [loc / "_parser.py" for loc in mod.library_locations().get("tomli", [])]
    assert all(mod.usable(p) is None for p in vendored if p.is_file())
