"""scripts/needle_budgets.py (retrieval against attention budget): the budget formula and one tiny run."""
import json
import sys

from helpers import load_script


def _script():
    return load_script("needle_budgets")


def test_keys_per_query():
    nb = _script()
    assert nb.keys_per_query("moba", {"chunk_size": 256, "topk": 16}, 32768) == 4096
    assert nb.keys_per_query("moba", {"chunk_size": 512, "topk": 16}, 4096) == 4096  # capped at n
    assert nb.keys_per_query("nsa", {"num_selected": 32, "select_block": 64, "window": 256}, 32768) == 2304
    hyper = {"min_seq_len": 4096, "block_size": 512, "sample_size": 512}
    assert nb.keys_per_query("hyper", hyper, 32768) == 4096 + 3 * 1024  # leaf + 3 halvings to 4096
    assert nb.keys_per_query("hyper", hyper, 2048) == 2048  # below the leaf: exact
    assert nb.keys_per_query("exact", {}, 1000) == 1000


def test_tiny_run_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    nb = _script()
    monkeypatch.setattr(nb, "VARIANTS", {"moba 64x2": ("demo-moba", {"chunk_size": 64, "topk": 2}),
                                         "nsa 4x64": ("demo-nsa", {"num_selected": 4, "window": 64})})
    out = tmp_path / "nb"
    argv = ["needle_budgets.py", "--length", "512", "--depths", "0.5", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    nb.main()
    rows = json.loads((out / "budgets.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["exact", "moba 64x2", "nsa 4x64"]
    assert rows[0]["keys"] == 512 and rows[0]["speedup"] == 1.0
    assert rows[1]["keys"] == 128 and rows[1]["method"] == "moba" and rows[1]["layers"] == 4
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["attention_seconds"] > 0 for r in rows)
    assert (out / "budgets.png").stat().st_size > 0
    records = (out / "records.jsonl").read_text()
    nb.main()  # same --out: resumes, nothing generated again
    assert (out / "records.jsonl").read_text() == records
    assert "moba 64x2" in capsys.readouterr().out


def test_bad_options_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    import pytest

    nb = _script()
    out = tmp_path / "nb"
    for bad, needle in ((["--length", "10"], "--length: got 10"), (["--depths", "5"], "--depths"),
                        (["--trials", "0"], "trials"), (["--template", "nope"], "--template")):
        monkeypatch.setattr(sys, "argv", ["needle_budgets.py", *bad, "--out", str(out)])
        with pytest.raises(SystemExit) as e:
            nb.main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err
        assert not out.exists()
