"""scripts/frontier_report.py (kept needles against prefill speed, from eval needle and bench generate records)
on a small fixture."""
import json

import pytest
from helpers import load_script


def test_frontier_report_counts_kept_needles_and_speedups(tmp_path, capsys):
    needles, gen = tmp_path / "needles", tmp_path / "gen"
    needles.mkdir(), gen.mkdir()
    recs = []
    for depth, exact_ok, a_ok in [(0.1, True, True), (0.5, True, False), (0.9, False, True)]:
        recs.append({"config": "exact", "method": "exact", "layers": 0, "length": 64, "depth": depth, "trial": 0,
                     "correct": exact_ok})
        recs.append({"config": "cfg-a", "method": "moba", "layers": 4, "length": 64, "depth": depth, "trial": 0,
                     "correct": a_ok})
    (needles / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (gen / "results.json").write_text(json.dumps({"records": [
        {"config": "unpatched", "layers": 0, "context": 64, "ttft_s": 3.0},
        {"config": "cfg-a", "layers": 4, "context": 64, "ttft_s": 1.0}]}))
    mod = load_script("frontier_report")
    out = tmp_path / "out"
    assert mod.main(["--needles", str(needles), "--generate", str(gen), "--context", "64", "--out", str(out)]) == 0
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert (row["found"], row["kept"], row["exact_found"]) == (2, 1, 2)  # the 0.9 find is not one exact made
    assert row["prefill_speedup"] == pytest.approx(3.0) and (out / "frontier.png").exists()
    assert mod.main(["--needles", str(needles), "--generate", str(tmp_path / "none"), "--out", str(out)]) == 2
