"""scripts/executor_speed.py (#27 part 3) and scripts/routing_overhead.py (#26) on small shapes."""
import json

import pytest
from helpers import load_script


def test_executor_speed_reports_pairs_ideal_and_ratio(tmp_path, capsys):
    mod = load_script("executor_speed")
    assert mod.main(["--n", "512", "--block", "64", "--repeats", "1", "--no-flex", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows and all(r["pairs"] > 0 and r["ideal_speedup"] > 1 and r["ratio"] > 0 for r in rows)
    dens = [r["density"] for r in rows]
    assert dens == sorted(dens) and (tmp_path / "executor_speed.png").exists()
    assert "ideal" in capsys.readouterr().out


def test_executor_speed_rejects_bad_sizes(tmp_path, capsys):
    assert load_script("executor_speed").main(["--n", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--n: got 0" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_budget_for_hits_the_density():
    mod = load_script("executor_speed")
    S = mod.budget_for(1 / 8, 128)
    att = sum(min(i, S) + 0.5 for i in range(128)) / 128
    assert att / 64.5 == pytest.approx(1 / 8, abs=0.01)


def test_routing_overhead_runs_on_a_tiny_model(tmp_path, capsys):
    mod = load_script("routing_overhead")
    assert mod.main(["--model", "tiny:llama", "--n", "32", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["side"] for r in rows] == ["unpatched", "patched (exact)"]
    assert "routing overhead" in capsys.readouterr().out


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


def test_sdpa_rows_times_every_row_count_and_thread_count(tmp_path, capsys):
    mod = load_script("sdpa_rows")
    assert mod.main(["--rows", "64,256", "--threads", "1", "--keys", "128", "--pairs", "65536", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["threads"], r["rows"]) for r in res] == [(1, 64), (1, 256)]
    assert all(r["ns_per_pair"] > 0 for r in res) and (tmp_path / "sdpa_rows.png").exists()
    assert mod.main(["--rows", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--rows: got 0" in capsys.readouterr().err and not (tmp_path / "x").exists()
