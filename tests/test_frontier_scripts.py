"""scripts/executor_speed.py (#27 part 3) and scripts/routing_overhead.py (#26) on small shapes."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_executor_speed_reports_pairs_ideal_and_ratio(tmp_path, capsys):
    mod = _script("executor_speed")
    assert mod.main(["--n", "512", "--block", "64", "--repeats", "1", "--no-flex", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows and all(r["pairs"] > 0 and r["ideal_speedup"] > 1 and r["ratio"] > 0 for r in rows)
    dens = [r["density"] for r in rows]
    assert dens == sorted(dens) and (tmp_path / "executor_speed.png").exists()
    assert "ideal" in capsys.readouterr().out


def test_executor_speed_rejects_bad_sizes(tmp_path, capsys):
    assert _script("executor_speed").main(["--n", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--n: got 0" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_budget_for_hits_the_density():
    mod = _script("executor_speed")
    S = mod.budget_for(1 / 8, 128)
    att = sum(min(i, S) + 0.5 for i in range(128)) / 128
    assert att / 64.5 == pytest.approx(1 / 8, abs=0.01)


def test_routing_overhead_runs_on_a_tiny_model(tmp_path, capsys):
    mod = _script("routing_overhead")
    assert mod.main(["--model", "tiny:llama", "--n", "32", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["side"] for r in rows] == ["unpatched", "patched (exact)"]
    assert "routing overhead" in capsys.readouterr().out
