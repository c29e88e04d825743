"""The benchmark scripts run every registered method end to end (tiny shapes; no timing asserts)."""
import json

import pytest

from longpatch.bench.attention import run_attention_bench
from longpatch.bench.decode import run_decode_bench
from longpatch.methods import available_methods

# Every registered method except the test probe (tests/helpers.py), with parameters small enough
# that the approximate path really runs at n = 256 instead of falling back to exact attention.
SMALL = {"hyper": {"min_seq_len": 64, "block_size": 32, "sample_size": 32},
         "moba": {"chunk_size": 64, "topk": 2},
         "nsa": {"compress_block": 16, "compress_stride": 8, "select_block": 16, "num_selected": 4, "window": 32},
         "sparse": {"window": 32, "global_tokens": 8, "random_blocks": 1, "block": 16},
         "performer": {"num_features": 32}}


def _methods():
    return [m for m in available_methods() if m not in ("probe", "exact")]


def test_attention_bench_gqa_rows(tmp_path, one_thread):
    methods = _methods()
    params = {m: p for m, p in SMALL.items() if m in methods}
    rows = run_attention_bench(methods=("exact", *methods), seq_lens=(256,), causal_modes=(True, False), heads=4,
                               kv_heads=2, repeats=1, out_dir=tmp_path, method_params=params, progress=False,
                               memory=False)
    assert {r["method"] for r in rows if r["causal"]} == {"exact", *methods}
    causal_only = {m for m in methods if available_methods()[m].causal_only}
    assert "nsa" in causal_only  # NSA is defined for causal attention only: no non-causal rows
    assert {r["method"] for r in rows if not r["causal"]} == {"exact", *methods} - causal_only
    for r in rows:
        assert r["kv_heads"] == 2 and r["fwd_ms"] > 0
        assert r["err_random"] is not None and r["err_random"] == r["err_random"]  # not NaN
    saved = json.loads((tmp_path / "attention_bench.json").read_text())
    assert len(saved["rows"]) == len(rows) and (tmp_path / "attention_bench.png").stat().st_size > 0


def test_attention_bench_rejects_bad_kv_heads(tmp_path):
    with pytest.raises(ValueError, match="--kv-heads: got 3"):
        run_attention_bench(methods=("exact",), seq_lens=(64,), heads=4, kv_heads=3, out_dir=tmp_path, progress=False)


def test_decode_bench_every_decoding_method(tmp_path, one_thread):
    methods = [m for m in _methods() if available_methods()[m].decode is not None]
    params = {m: p for m, p in SMALL.items() if m in methods}
    rows = run_decode_bench(methods=tuple(methods), cache_lens=(300,), heads=4, kv_heads=2, repeats=1,
                            out_dir=tmp_path, method_params=params, progress=False)
    assert {r["method"] for r in rows} == set(methods)
    for r in rows:
        assert r["decode_ms"] > 0 and r["err_random"] == r["err_random"]


@pytest.mark.parametrize("argv, needle", [
    (["attention", "--dtype", "float8", "--seq-lens", "64"], "dtype: got 'float8'"),
    (["attention", "--heads", "4", "--kv-heads", "3", "--seq-lens", "64"], "--kv-heads: got 3"),
    (["decode", "--methods", "hyper", "--cache-lens", "64"], "method 'hyper' has no decode"),
    (["decode", "--threads", "0"], "--threads: got 0"),
])
def test_bench_cli_bad_input_is_one_line(tmp_path, argv, needle):
    from typer.testing import CliRunner

    from longpatch import cli

    r = CliRunner().invoke(cli.app, ["bench", *argv, "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and needle in r.stderr and r.stderr.count("\n") == 1, (r.output, r.exception)
    assert not (tmp_path / "b").exists()


def test_bench_cli_writes_json_and_plot(tmp_path, one_thread):
    from typer.testing import CliRunner

    from longpatch import cli

    r = CliRunner().invoke(cli.app, ["bench", "attention", "--methods", "exact,moba", "--seq-lens", "128",
                                     "--mode", "causal", "--repeats", "1", "--no-memory", "--threads", "1",
                                     "--set", "chunk_size=32", "--set", "topk=2", "--out", str(tmp_path)])
    assert r.exit_code == 0, (r.output, r.exception)
    rows = json.loads((tmp_path / "attention_bench.json").read_text())["rows"]
    assert [(x["method"], x["mem_mb"], x["params"]["chunk_size"] if x["method"] == "moba" else None) for x in rows] \
        == [("exact", None, None), ("moba", None, 32)]
    assert (tmp_path / "attention_bench.png").stat().st_size > 0


def test_params_for_a_method_not_benchmarked_are_refused(tmp_path):
    from longpatch.errors import ConfigError

    with pytest.raises(ConfigError, match="method_params: 'moba' is not a benchmarked method"):
        run_attention_bench(methods=("exact", "hyper"), seq_lens=(64,), repeats=1, out_dir=tmp_path / "b",
                            method_params={"moba": {"topk": 2}}, progress=False, memory=False)
    assert not (tmp_path / "b").exists()
