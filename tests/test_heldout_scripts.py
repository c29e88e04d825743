"""scripts/heldout_report.py (pooled figures and their intervals) and heldout_corpora.py's --exclude (#41)."""
import json
import math

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
