"""`longpatch bench generate`: end-to-end greedy generation, unpatched vs patched (tiny model, short
contexts; no timing asserts)."""
import csv
import json

import pytest
from typer.testing import CliRunner

from longpatch import cli
from longpatch.bench.generate import CSV_COLUMNS, run_generate_bench
from longpatch.outdir import MARKER, claim_out, written_by

runner = CliRunner()
CONTEXTS = (256, 512)
NEW = 4


@pytest.fixture
def configs(tmp_path):
    moba = tmp_path / "moba-small.yaml"
    moba.write_text("method: moba\nparams: {chunk_size: 64, topk: 2}\nlayers: 2\n")
    exact = tmp_path / "exact.yaml"
    exact.write_text("method: exact\nlayers: all\n")
    return str(moba), str(exact)


def test_records_files_and_greedy_tokens(tmp_path, configs, one_thread):
    moba, exact = configs
    out = tmp_path / "out"
    res = run_generate_bench("tiny:llama", f"{moba},{exact}", None, "512,256", NEW, out, tokenizer="bytes",
                             progress=False)
    recs = res["records"]
    # one row per (config, layers, context): the unpatched model first, then each config in order
    assert [(r["config"], r["layers"], r["context"]) for r in recs] == [
        ("exact", 0, 256), ("exact", 0, 512), (moba, 2, 256), (moba, 2, 512), (exact, 4, 256),
        (exact, 4, 512)]
    for r in recs:
        assert {"config", "layers", "context", "ttft_s", "decode_ms_per_token", "peak_rss_mib", "tokens_per_s",
                "decode_tokens_per_s", "ttft_speedup", "decode_speedup", "tokens"} <= set(r)
        assert r["ttft_s"] > 0 and r["decode_ms_per_token"] > 0 and r["tokens_per_s"] > 0
        assert r["peak_rss_mib"] > 0 and r["new_tokens"] == NEW
        assert len(r["tokens"]) == NEW and all(0 <= t < 256 for t in r["tokens"])
    base = {r["context"]: r for r in recs if r["config"] == "exact"}
    for r in recs:
        if r["config"] != "exact":
            assert r["decode_speedup"] == pytest.approx(base[r["context"]]["decode_ms_per_token"]
                                                        / r["decode_ms_per_token"])
            assert 0 <= r["tokens_match_exact"] <= NEW
    # the patched layers ran the method in prefill and in every decode step (2 layers x NEW - 1 steps)
    m = next(r for r in recs if r["config"] == moba and r["context"] == 512)
    assert m["method"] == "moba" and m["indices"] == [2, 3]
    assert m["paths"]["decode"] == {"method": 2 * (NEW - 1)} and "method" in m["paths"]["prefill"]
    # exact attention in every layer gives the unpatched model's greedy tokens
    for r in recs:
        if r["config"] == exact:
            assert r["tokens"] == base[r["context"]]["tokens"] and r["tokens_match_exact"] == NEW
    # the dense memory floor: every weight and the whole cache once at the measured copy bandwidth
    meta = res["meta"]
    assert meta["copy_bandwidth_gbs"] > 0 and meta["weight_bytes"] > 0 and meta["kv_bytes_per_token"] > 0
    for r in recs:
        kv = meta["kv_bytes_per_token"] * (r["context"] + NEW / 2)
        want = (meta["weight_bytes"] + kv) / (meta["copy_bandwidth_gbs"] * 1e9) * 1e3
        assert r["dense_floor_ms"] == pytest.approx(want)
        assert r["of_floor"] == pytest.approx(r["dense_floor_ms"] / r["decode_ms_per_token"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["records"] == recs and saved["meta"]["contexts"] == list(CONTEXTS)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_COLUMNS and len(rows) == len(recs)
    assert (out / "generate.png").stat().st_size > 0
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "generate.png", "results.csv", "results.json"]
    assert written_by(out) == "bench generate"


def test_a_static_cache_gives_the_growing_caches_tokens(tmp_path, configs, one_thread):
    """--cache static: transformers' StaticCache, preallocated for the prompt and the new tokens; the patched
    layers run the method in every step on the written keys, so the tokens are the growing cache's."""
    moba, _ = configs
    runs = {c: run_generate_bench("tiny:llama", moba, None, "256", NEW, tmp_path / c, tokenizer="bytes",
                                  progress=False, cache=c, plots=False)["records"] for c in ("growing", "static")}
    assert [r["tokens"] for r in runs["static"]] == [r["tokens"] for r in runs["growing"]]
    m = next(r for r in runs["static"] if r["config"] == moba)
    assert m["paths"]["decode"] == {"method": 2 * (NEW - 1)}


def test_cli_prints_the_table(tmp_path, one_thread):
    out = tmp_path / "out"
    r = runner.invoke(cli.app, ["bench", "generate", "--model", "tiny:llama", "--tokenizer", "bytes", "--method",
                                "sparse", "--layers", "1", "--contexts", "64", "--new-tokens", "2", "--out", str(out),
                                "--no-progress", "--no-plots", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    assert "exact (no patch)" in r.stdout and "sparse" in r.stdout and "decode ms/token" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "results.csv", "results.json"]


def _one_line_error(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("args, needles", [
    (["--contexts", "0"], ["--contexts", "'0'", "[64, "]),
    (["--contexts", "256,x"], ["--contexts", "comma-separated"]),
    (["--new-tokens", "0"], ["--new-tokens: got 0", "[2, "]),
    (["--new-tokens", "99999999999"], ["--new-tokens: got 99999999999", "[2, 1073741824]"]),
    (["--repeats", "0"], ["--repeats: got 0"]),
    (["--repeats", "100000"], ["--repeats: got 100000", "[1, 10000]"]),
    (["--config", "demo-moba,nope"], ["config: 'nope'", "neither a file nor a bundled alias"]),
    (["--layer-counts", "1,"], ["--layer-counts", "empty item"]),
    (["--layers", "0,4"], ["--layers 0,4", "--layer-counts 0,4", "layers=[0, 4]"]),
    (["--layers", "9"], ["layers: got 9", "4 layers"]),
    (["--filler", "missing.txt"], ["--filler", "missing.txt"]),
    (["--threads", "0"], ["--threads: got 0"]),
    (["--cache", "paged"], ["cache: got 'paged'", "growing, dynamic, static"]),
    (["--profile", "-1"], ["--profile: got -1"]),
    (["--new-tokens", "4", "--profile", "3"], ["--profile: got 3", "[0, 2]"]),
    (["--tokenizer", None], ["tokenizer", "tiny:llama", "--tokenizer"]),
])
def test_bad_options_fail_in_one_line_and_write_nothing(tmp_path, args, needles):
    out = tmp_path / "out"
    argv = ["bench", "generate", "--model", "tiny:llama", "--tokenizer", "bytes", "--contexts", "64",
            "--new-tokens", "2", "--out", str(out), "--no-progress", *args]
    if args[-1] is None:  # drop an option: a tiny model without a tokenizer
        argv = [a for a in argv if a not in ("--tokenizer", "bytes", None)]
    _one_line_error(runner.invoke(cli.app, argv), *needles)
    assert not out.exists()


@pytest.mark.parametrize("kind", ["file", "other command"])
def test_an_unusable_out_is_refused_before_loading(tmp_path, monkeypatch, kind):
    target = tmp_path / "results"
    if kind == "file":
        target.write_text("keep me")
    else:
        claim_out(target, "bench decode")
    before = {p.name: p.read_bytes() for p in ([target] if target.is_file() else target.iterdir())}
    monkeypatch.setattr("longpatch.loading.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    r = runner.invoke(cli.app, ["bench", "generate", "--model", "tiny:llama", "--tokenizer", "bytes",
                                "--out", str(target), "--no-progress"])
    _one_line_error(r, "--out", "is not a directory" if kind == "file" else "longpatch bench decode")
    assert before == {p.name: p.read_bytes() for p in ([target] if target.is_file() else target.iterdir())}


def test_batch_size_generates_copies_together(tmp_path, configs, one_thread):
    moba, _ = configs
    one = run_generate_bench("tiny:llama", moba, None, "256", NEW, tmp_path / "one", tokenizer="bytes", progress=False,
                             plots=False)["records"]
    three = run_generate_bench("tiny:llama", moba, None, "256", NEW, tmp_path / "three", tokenizer="bytes",
                               progress=False, plots=False, batch_size=3)["records"]
    assert [r["batch"] for r in one] == [1, 1] and [r["batch"] for r in three] == [3, 3]
    # the same greedy tokens (the first row's), the method in every patched layer, tokens/s over all rows
    assert [r["tokens"] for r in one] == [r["tokens"] for r in three]
    m = next(r for r in three if r["config"] == moba)
    assert m["paths"]["decode"] == {"method": 2 * (NEW - 1)}
    assert m["tokens_per_s"] == pytest.approx(3 * NEW / m["total_s"])


@pytest.mark.parametrize("allocator,noted", [("glibc, freed memory kept (longpatch.memory)", True),
                                             ("as the process started", False)])
def test_the_table_says_when_peak_rss_is_the_processs_high_water_mark(allocator, noted):
    """With freed memory kept the resident set never shrinks: a row's peak RSS includes every row
    before it, and the table says so under it (only then)."""
    from rich.console import Console

    from longpatch.bench.generate import print_table

    row = dict(config="exact", layers=0, context=256, ttft_s=1.0, ttft_speedup=1.0, decode_ms_per_token=2.0,
               decode_speedup=1.0, tokens_per_s=3.0, peak_rss_mib=100.0, tokens_match_exact=None, new_tokens=4)
    console = Console(record=True, width=200)
    print_table({"meta": {"model": "tiny", "new_tokens": 4, "allocator": allocator}, "records": [row]}, console)
    assert ("high-water mark" in console.export_text()) == noted


def test_memory_floor_parts():
    """weight_bytes counts each storage once (tied embeddings once); kv_bytes_per_token is K and V of every
    layer's KV heads; the floor grows with the context and the batch."""
    from longpatch.bench.generate import dense_floor_ms, kv_bytes_per_token, weight_bytes
    from longpatch.testing.tiny import tiny_model

    model = tiny_model("llama")
    c = model.config
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert kv_bytes_per_token(model) == 2 * c.num_hidden_layers * c.num_key_value_heads * dim * 4
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    assert weight_bytes(model) == sum(storages.values())
    before, head = weight_bytes(model), model.lm_head.weight
    if head.untyped_storage().data_ptr() != model.model.embed_tokens.weight.untyped_storage().data_ptr():
        model.lm_head.weight = model.model.embed_tokens.weight  # tied: counted once
        assert weight_bytes(model) == before - head.untyped_storage().nbytes()
    one = dense_floor_ms(1000, 10, 100, 4, 1, 1e6)
    assert one == pytest.approx((1000 + 10 * 102) / 1e6 * 1e3)
    assert dense_floor_ms(1000, 10, 200, 4, 1, 1e6) > one and dense_floor_ms(1000, 10, 100, 4, 2, 1e6) > one
    assert dense_floor_ms(1000, None, 100, 4, 1, 1e6) is None


def test_compiled_steps_give_the_eager_tokens(tmp_path, one_thread, monkeypatch):
    """--compile: a static cache and the decode steps under torch.compile, here with fullgraph=True (a graph
    break fails) on backend eager (no codegen on the CPU runner), unpatched and with MoBA's hybrid selection
    (its graph-safe step): the growing cache's tokens, the warm-up (the compile) reported per row."""
    from longpatch.bench import generate

    monkeypatch.setitem(generate.COMPILE_OPTIONS, "fullgraph", True)
    monkeypatch.setitem(generate.COMPILE_OPTIONS, "backend", "eager")
    hybrid = tmp_path / "hybrid.yaml"
    hybrid.write_text("method: moba\nparams: {chunk_size: 64, topk: 3, selection: hybrid, estimate_queries: 16,"
                      " decode_page: 4, decode_topk: 1}\nlayers: all\n")
    kw = dict(tokenizer="bytes", progress=False, plots=False, warmup=1)
    eager = run_generate_bench("tiny:llama", str(hybrid), None, "320", NEW, tmp_path / "eager", **kw)["records"]
    compiled = run_generate_bench("tiny:llama", str(hybrid), None, "320", NEW, tmp_path / "compiled", compiled=True,
                                  **kw)
    assert compiled["meta"]["compiled"] and compiled["meta"]["cache"] == "static"
    assert [r["tokens"] for r in compiled["records"]] == [r["tokens"] for r in eager]
    assert all(r["warmup_s"] > 0 for r in compiled["records"])


@pytest.mark.parametrize("args, needles", [
    (["--cache", "growing"], ["--cache growing with --compile", "--cache static"]),
    (["--method", "moba", "--set", "topk=2"], ["--compile: config 'moba'", "no graph-safe decode step"]),
])
def test_compile_refuses_what_it_cannot_capture(tmp_path, args, needles):
    out = tmp_path / "out"
    argv = ["bench", "generate", "--model", "tiny:llama", "--tokenizer", "bytes", "--contexts", "64",
            "--new-tokens", "2", "--out", str(out), "--no-progress", "--compile", *args]
    _one_line_error(runner.invoke(cli.app, argv), *needles)
    assert not out.exists()


def test_the_step_profile_and_what_the_steps_read(tmp_path, one_thread):
    """--profile splits the last steps' time into ranking, attending, exact attention and the rest; every row of a
    query-aware selection says what share of the cache its steps listed (own, local, kept and ranked blocks)."""
    hybrid = tmp_path / "hybrid.yaml"
    hybrid.write_text("method: moba\nparams: {chunk_size: 32, topk: 3, selection: hybrid, estimate_queries: 8, "
                      "score_stride: 8, decode_topk: 1, decode_page: 8, decode_prefill: false}\nlayers: [0]\n")
    res = run_generate_bench("tiny:llama", str(hybrid), None, "320", 6, tmp_path / "out", tokenizer="bytes",
                             progress=False, plots=False, warmup=0, profile=3)
    base, patched = res["records"]
    p = patched["step_profile"]
    assert p["steps"] == 3 and p["rank_ms"] > 0 and p["attend_ms"] > 0 and p["exact_ms"] > 0
    assert abs(p["rank_ms"] + p["attend_ms"] + p["exact_ms"] + p["rest_ms"] - p["step_ms"]) < 1e-6
    assert base["step_profile"]["rank_ms"] == 0 and base["step_profile"]["exact_ms"] > 0
    # the sink, one ranked block (maybe the sink), the local one and the own partial block: at most 4 * 32 of ~322 keys
    share = patched["read_share"][0]
    assert 0.15 < share <= 128 / 321, share
    assert base["read_share"] is None
