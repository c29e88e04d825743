"""The benchmark scripts run every registered method end to end (tiny shapes; no timing asserts)."""
import json

import pytest

from longpatch.bench import run_attention_bench
from longpatch.bench_decode import run_decode_bench
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
    with pytest.raises(ValueError, match="kv_heads"):
        run_attention_bench(methods=("exact",), seq_lens=(64,), heads=4, kv_heads=3, out_dir=tmp_path, progress=False)


def test_decode_bench_every_decoding_method(tmp_path, one_thread):
    methods = [m for m in _methods() if available_methods()[m].decode is not None]
    params = {m: p for m, p in SMALL.items() if m in methods}
    rows = run_decode_bench(methods=tuple(methods), cache_lens=(300,), heads=4, kv_heads=2, repeats=1,
                            out_dir=tmp_path, method_params=params, progress=False)
    assert {r["method"] for r in rows} == set(methods)
    for r in rows:
        assert r["decode_ms"] > 0 and r["err_random"] == r["err_random"]
