"""--prefill-chunk N (chunked prefill: the prompt through the model N tokens at a time against the KV cache)
in `bench generate`, `eval needle` and `eval ppl`: with exact attention the numbers and answers are the
one-shot prefill's; a chunk size no config can run is one line before anything is loaded or written.

The demo model and its offline data, short prompts: the whole file runs in well under a minute. Nothing here
depends on whether a patched method runs its own attention on the chunks or exact attention.
"""
import json

import pytest
import torch
from typer.testing import CliRunner

from longpatch import cli

runner = CliRunner()
PPL = ["eval", "ppl", "--model", "demo", "--data", "demo", "--seq-len", "256", "--max-docs", "2", "--warmup", "0",
       "--no-progress"]
NEEDLE = ["eval", "needle", "--model", "demo", "--lengths", "256,320", "--depths", "0.25,0.75", "--trials", "1",
          "--no-progress"]
GENERATE = ["bench", "generate", "--model", "demo", "--contexts", "256", "--new-tokens", "3", "--warmup", "0",
            "--no-progress", "--no-plots"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small shapes: one thread avoids waking thread pools for tiny ops (slow on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ok(r):
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def _one_line_error(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output, r.output
    for n in needles:
        assert n in r.stderr, r.stderr


# ---- eval ppl ------------------------------------------------------------------------------------------

def test_ppl_in_chunks_is_the_one_shot_ppl_for_exact_attention(tmp_path):
    """Unpatched (0 layers) and patched with method exact in every layer: chunks that divide the document,
    chunks that do not (the last one shorter), and one chunk longer than the document (one forward)."""
    def run(out, *chunk):
        _ok(runner.invoke(cli.app, [*PPL, "--method", "exact", "--layer-counts", "0,all", "--out", str(out), *chunk]))
        return json.loads((out / "results.json").read_text())

    one = run(tmp_path / "one")
    assert one["prefill_chunk"] is None
    for chunk in (64, 100, 1000):
        res = run(tmp_path / f"chunk{chunk}", "--prefill-chunk", str(chunk))
        assert res["prefill_chunk"] == chunk
        assert [c["layers"] for c in res["configs"]] == [c["layers"] for c in one["configs"]] == [0, 4]
        for got, want in zip(res["configs"], one["configs"]):
            assert got["all"]["scored_tokens"] == want["all"]["scored_tokens"] == 2 * 255
            assert got["all"]["ppl"] == pytest.approx(want["all"]["ppl"], rel=1e-4), chunk
        records = [json.loads(line) for line in (tmp_path / f"chunk{chunk}" / "records.jsonl").read_text().splitlines()]
        assert {r["prefill_chunk"] for r in records} == {chunk}
        for r in records:  # each of the 4 patched layers called once per chunk of the 256 tokens
            if r["layers"]:
                calls = sum(s["calls"] for s in r["attention"]["patched"]["prefill"].values())
                assert calls == 4 * -(-256 // chunk), r["attention"]
        plan = json.loads((tmp_path / f"chunk{chunk}" / "plan.json").read_text())
        # its own config ids: a rerun in an out of one-shot records does not take them for its own
        assert plan["prefill_chunk"] == chunk
        assert {p["config_id"] for p in plan["points"]}.isdisjoint(c["config_id"] for c in one["configs"])


def test_ppl_prefill_chunk_is_not_for_sequence_parallel(tmp_path):
    out = tmp_path / "out"
    _one_line_error(runner.invoke(cli.app, [*PPL, "--out", str(out), "--prefill-chunk", "64",
                                            "--sequence-parallel", "2"]), "--prefill-chunk", "--sequence-parallel")
    assert not out.exists()


# ---- eval needle ---------------------------------------------------------------------------------------

def _answers(out):
    keep = ("config", "layers", "length", "depth", "trial", "expected", "predicted")
    return sorted(tuple(r[k] for k in keep) for r in json.loads((out / "results.json").read_text())["records"])


@pytest.mark.parametrize("batch", ["1", "2"])
def test_needle_in_chunks_answers_as_one_shot_for_exact_attention(tmp_path, batch):
    """generate()'s chunked prefill, one prompt at a time and in left-padded batches of two lengths."""
    base = [*NEEDLE, "--method", "exact", "--layer-counts", "0,all", "--batch-size", batch]
    _ok(runner.invoke(cli.app, [*base, "--out", str(tmp_path / "one")]))
    r = _ok(runner.invoke(cli.app, [*base, "--out", str(tmp_path / "chunked"), "--prefill-chunk", "96"]))
    assert "prefill in chunks of 96" in r.stdout
    assert _answers(tmp_path / "chunked") == _answers(tmp_path / "one") and len(_answers(tmp_path / "one")) == 8
    res = json.loads((tmp_path / "chunked" / "results.json").read_text())
    assert res["prefill_chunk"] == 96
    records = [json.loads(line) for line in (tmp_path / "chunked" / "records.jsonl").read_text().splitlines()]
    assert {r["prefill_chunk"] for r in records} == {96}
    if batch == "1":  # the prefill really went in chunks: each of the 4 patched layers called once per chunk
        for r in records:
            if r["layers"]:
                calls = sum(s["calls"] for s in r["attention"]["patched"]["prefill"].values())
                assert calls == 4 * -(-r["length"] // 96), r["attention"]
    assert json.loads((tmp_path / "one" / "results.json").read_text())["prefill_chunk"] is None


def test_needle_workers_get_the_chunk_size():
    """--num-processes workers rebuild the spec from to_kwargs(): the chunk size travels with it."""
    from longpatch.eval.needle.run import NeedleSpec
    from longpatch.eval.ppl.run import PerplexitySpec

    for spec in (NeedleSpec(prefill_chunk=256), PerplexitySpec(prefill_chunk=256)):
        kwargs = json.loads(json.dumps(spec.to_kwargs()))  # as spawn() passes them
        assert type(spec)(**kwargs).prefill_chunk == 256


# ---- bench generate ------------------------------------------------------------------------------------

def test_bench_generate_records_the_chunk_and_gives_the_one_shot_tokens(tmp_path):
    """Every row prefills in chunks (unpatched and patched with exact attention alike): the greedy tokens
    are the one-shot prefill's, the chunk size is in the meta, every row and the CSV."""
    def run(out, *chunk):
        r = _ok(runner.invoke(cli.app, [*GENERATE, "--method", "exact", "--layers", "all", "--out", str(out), *chunk]))
        assert ("prefill in chunks of 100" in r.stdout) == bool(chunk)
        return json.loads((out / "results.json").read_text())

    one = run(tmp_path / "one")
    chunked = run(tmp_path / "chunked", "--prefill-chunk", "100")
    # 256 tokens in chunks of 100: three prefill calls in each of the 4 patched layers, not one
    assert [sum(r["paths"]["prefill"].values()) for r in one["records"][1:]] == [4]
    assert [sum(r["paths"]["prefill"].values()) for r in chunked["records"][1:]] == [12]
    assert one["meta"]["prefill_chunk"] is None and chunked["meta"]["prefill_chunk"] == 100
    assert [r["prefill_chunk"] for r in chunked["records"]] == [100, 100]
    assert [r["tokens"] for r in chunked["records"]] == [r["tokens"] for r in one["records"]]
    assert all(r["peak_rss_mib"] > 0 for r in chunked["records"])
    header, *rows = (tmp_path / "chunked" / "results.csv").read_text().splitlines()
    assert "prefill_chunk" in header.split(",") and all(",100," in row for row in rows)


def test_bench_generate_runs_a_block_method_on_its_multiple(tmp_path):
    """A config whose method selects blocks of 256 keys runs with a multiple of it; whatever it computes on
    the chunks, the row is there and says so."""
    out = tmp_path / "out"
    _ok(runner.invoke(cli.app, [*GENERATE, "--contexts", "512", "--config", "demo-moba-32k", "--set",
                                "min_seq_len=0", "--out", str(out), "--prefill-chunk", "256"]))
    recs = json.loads((out / "results.json").read_text())["records"]
    assert [(r["method"], r["prefill_chunk"]) for r in recs] == [(None, 256), ("moba", 256)]


# ---- bad values: one line, nothing loaded, nothing written ----------------------------------------------

@pytest.mark.parametrize("command", [PPL, NEEDLE, GENERATE], ids=["ppl", "needle", "generate"])
@pytest.mark.parametrize("value, config, needles", [
    ("0", None, ["--prefill-chunk: got 0", "an int >= 1"]),
    ("-3", None, ["--prefill-chunk: got -3", "an int >= 1"]),
    ("100", "demo-moba-32k", ["--prefill-chunk: got 100", "a multiple of 256", "moba"]),
    ("300", "demo,demo-nsa-32k", ["--prefill-chunk: got 300", "a multiple of 256", "nsa"]),
])
def test_bad_chunk_is_one_line_before_loading(tmp_path, monkeypatch, command, value, config, needles):
    def no_loading(*a, **k):
        pytest.fail("loaded a model")

    monkeypatch.setattr("longpatch.loading.load_model", no_loading)
    monkeypatch.setattr("longpatch.eval.sweep.load_model", no_loading)
    out = tmp_path / "out"
    argv = [*command, "--out", str(out), "--prefill-chunk", value, *(["--config", config] if config else [])]
    _one_line_error(runner.invoke(cli.app, argv), *needles)
    assert not out.exists()


def test_a_chunk_every_config_can_run_is_accepted_before_loading(tmp_path, monkeypatch):
    """256 for demo-moba-32k (and any size for the others): the checks pass and the run goes on to load."""
    class Loaded(Exception):
        pass

    def loading(*a, **k):
        raise Loaded

    monkeypatch.setattr("longpatch.eval.sweep.load_model", loading)
    r = runner.invoke(cli.app, [*NEEDLE, "--out", str(tmp_path / "out"), "--prefill-chunk", "512", "--config",
                                "demo,demo-moba-32k"])
    assert isinstance(r.exception, Loaded), (r.output, r.exception)
