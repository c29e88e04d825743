"""The GPU checks' code on the CPU: scripts/gpu_kernels.py (Triton vs torch, under the interpreter at
small shapes) and the benchmarks' --device option (cpu explicit; cuda refused where none is visible)."""
import json

import pytest
import torch
from helpers import load_script
from typer.testing import CliRunner

from longpatch import cli
from longpatch.methods.common import flex_available

SMALL = ["--device", "cpu", "--n", "80", "--heads", "2", "--kv-heads", "1", "--head-dims", "16", "--dtypes",
         "float32", "--grad-n", "48"]


def test_gpu_kernels_pairs_every_triton_path_with_its_twin(tmp_path, capsys):
    mod = load_script("gpu_kernels")
    assert mod.main([*SMALL, "--methods", "exact,moba,nsa,sparse", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"exact", "moba", "nsa", "sparse"}
    assert all(r["ok"] and r["err_out"] < 1e-4 for r in rows)
    grads = [r for r in rows if r["grad"]]
    assert len(grads) == 4 and all(r["err_dq"] < 1e-4 and r["err_dv"] < 1e-4 for r in grads)
    assert any("err_decode" in r for r in rows)
    assert "[gpu_kernels] moba n=80" in capsys.readouterr().out  # a line per case as it ends


def test_gpu_kernels_fails_when_a_path_disagrees(tmp_path, monkeypatch):
    mod = load_script("gpu_kernels")
    monkeypatch.setattr(mod, "TOL", {"float32": 0.0, "bfloat16": 0.0, "float16": 0.0})
    assert mod.main([*SMALL, "--methods", "moba", "--grad-n", "0", "--out", str(tmp_path)]) == 1
    assert not all(r["ok"] for r in json.loads((tmp_path / "results.json").read_text())["rows"])


@pytest.mark.skipif(not flex_available(), reason="torch without FlexAttention (needs >= 2.11)")
def test_gpu_flex_check_compares_flex_with_torch_and_can_fail(tmp_path, monkeypatch):
    """scripts/gpu_flex_check.py on the CPU: every case at a length where the selections are sparse (9
    blocks of 128, at most 6), flex against torch; with no tolerance left, the same run exits 1."""
    mod = load_script("gpu_flex_check")
    out = tmp_path / "check.json"
    assert mod.main(["--device", "cpu", "--lengths", "1100", "--demo-len", "0", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["cases"]
    assert {r["case"] for r in rows} == set(mod.CASES) and all(r["ok"] for r in rows)
    assert max(r["rel_err"] for r in rows) > 0  # the flex path ran (not the torch path twice)
    monkeypatch.setattr(mod, "TOL", {torch.float32: -1.0})
    assert mod.main(["--device", "cpu", "--lengths", "1100", "--demo-len", "0", "--out", str(out)]) == 1


def test_gpu_kernels_rejects_unknown_methods(tmp_path, capsys):
    assert load_script("gpu_kernels").main(["--device", "cpu", "--methods", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "--methods: got 'nope'" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("command", ["attention", "decode"])
def test_bench_device_cuda_is_refused_without_a_gpu(tmp_path, command):
    r = CliRunner().invoke(cli.app, ["bench", command, "--device", "cuda", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--device: got 'cuda'" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_bench_device_names_the_device_in_the_results(tmp_path):
    r = CliRunner().invoke(cli.app, ["bench", "decode", "--methods", "sparse", "--cache-lens", "256", "--repeats",
                                     "1", "--device", "cpu", "--no-errors", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "decode_bench.json").read_text())["meta"]
    assert meta["device"] == "cpu"
    r = CliRunner().invoke(cli.app, ["bench", "attention", "--device", "tpu", "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "--device: got 'tpu'; allowed: cpu, cuda, cuda:N" in r.stderr


def _needle_records(path, rows):
    path.write_text("".join(json.dumps({"config": c, "layers": 0 if c == "exact" else 4, "digest": d,
                                        "correct": ok, "predicted": text}) + "\n" for c, d, ok, text in rows))


def test_needle_agreement_matches_prompts_and_flags_a_lost_needle(tmp_path, capsys):
    """scripts/needle_agreement.py (issue 41's GPU check): per config, prompts in both runs, same answers,
    and needles kept of exact's in each; exit 1 when the other run keeps fewer."""
    mod = load_script("needle_agreement")
    ref, gpu = tmp_path / "cpu.jsonl", tmp_path / "gpu.jsonl"
    _needle_records(ref, [("exact", "a", True, "1"), ("exact", "b", True, "2"), ("exact", "c", False, "x"),
                          ("moba", "a", True, "1"), ("moba", "b", True, "2"), ("moba", "c", False, "y")])
    _needle_records(gpu, [("exact", "a", True, "1"), ("exact", "b", True, "2"), ("exact", "c", False, "x"),
                          ("moba", "a", True, "1"), ("moba", "b", True, "2 "), ("moba", "d", True, "3")])
    out = tmp_path / "agree.json"
    assert mod.main(["--reference", str(ref), "--other", str(gpu), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["configs"]
    assert rows["moba"] == {"prompts": 2, "same_answer": 2, "same_text": 1, "reference_kept": 2,
                            "reference_exact": 2, "other_kept": 2, "other_exact": 2}
    assert rows["exact"]["prompts"] == 3 and rows["exact"]["same_text"] == 3
    _needle_records(gpu, [("exact", "a", True, "1"), ("exact", "b", True, "2"), ("moba", "a", True, "1"),
                          ("moba", "b", False, "9")])
    assert mod.main(["--reference", str(ref), "--other", str(gpu), "--out", str(out)]) == 1
    assert "| moba | 2 | 1 | 1 | 2 of 2 | 1 of 2 |" in capsys.readouterr().out
    assert mod.main(["--reference", str(tmp_path / "none"), "--other", str(gpu), "--out", str(out)]) == 2
    # several references: a later file's record of the same prompt and config wins (a config re-run)
    rerun = tmp_path / "rerun.jsonl"
    _needle_records(rerun, [("moba", "b", False, "9")])
    assert mod.main(["--reference", str(ref), str(rerun), "--other", str(gpu), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["configs"]["moba"]["reference_kept"] == 1


def test_gpu_decode_profile_dry_run_times_every_step(tmp_path):
    """scripts/gpu_decode_profile.py (where a decode step's time goes on a GPU), tiny, on the CPU."""
    out = tmp_path / "profile.json"
    assert load_script("gpu_decode_profile").main(["--dry-run", "--cache-len", "8192", "--steps", "2",
                                                   "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["cases"]
    assert [r["case"] for r in rows] == ["sdpa", "moba query-aware", "nsa query-aware", "sparse defaults",
                                         "moba graph-safe", "moba compiled", "nsa graph-safe", "nsa compiled"]
    assert res["kernel"]["bytes_read"] > 0 and res["kernel"]["max_abs_err_vs_twin"] == 0.0  # the twin on the CPU
    assert all(r["wall_ms"] > 0 and r["aten_ops_per_step"] >= 1 for r in rows)
    assert rows[1]["aten_ops_per_step"] > rows[0]["aten_ops_per_step"]  # a selection step is many ops
