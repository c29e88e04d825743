"""--decode-tokens N in `eval ppl` (teacher-forced decode perplexity): each document's first seq_len - N tokens
prefilled, its last N fed one at a time through the KV cache, and only those N scored.

For exact attention that is the one-forward loss of the same N positions (up to float rounding); a patched
layer takes its decode path on each step; bad values and the sequence-parallel combination are one line;
a run with decode tokens has its own config ids, so it never resumes another's records.
Tiny random-weight models, the byte tokenizer and seq_len 64: the whole file runs in seconds.
"""
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from test_eval_longbench import FIXTURE, KEPT
from typer.testing import CliRunner

import longpatch
from longpatch import cli
from longpatch.errors import ConfigError
from longpatch.eval import perplexity
from longpatch.eval.ppl.run import PerplexitySpec
from longpatch.eval.ppl.scoring import chunk_bounds, evaluate_document, final_hidden_states, model_logits, token_nll
from longpatch.testing.tiny import tiny_model

ppl_module = sys.modules["longpatch.eval.ppl.run"]  # the package exports a function of the same name
SEQ = 64
DOCS = sum(len(v) for v in KEPT.values())  # 7 documents of the fixture are kept at seq_len 64
FAST = dict(tokenizer="bytes", seq_len=SEQ, progress=False, plots=False, warmup=0)
# MoBA with a decode of its own (one block per step besides the local one): its steps are not exact attention
MOBA = {"method": "moba", "layers": "all", "min_seq_len": 0, "params": {
    "chunk_size": 8, "topk": 3, "selection": "hybrid", "mass": 0.5, "estimate_queries": 4, "score_stride": 2,
    "decode_topk": 1}}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: tiny matmuls gain nothing from threads


def ids(n=SEQ, seed=0):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def one_forward_nll(model, t):
    """Token NLLs of positions 1..s-1 from the model's own full logits (no cache)."""
    with torch.no_grad():
        return F.cross_entropy(model_logits(model, t)[0, :-1], t[0, 1:], reduction="none")


def test_chunks_are_the_prefill_then_one_token_steps():
    assert chunk_bounds(10, None, 3) == [(0, 7), (7, 8), (8, 9), (9, 10)]
    assert chunk_bounds(10, 4, 3) == [(0, 4), (4, 7), (7, 8), (8, 9), (9, 10)]
    assert chunk_bounds(10, 4) == chunk_bounds(10, 4, None) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("name", ["llama", "chatglm2"])  # transformers' Cache objects, and a model's own tuples
@pytest.mark.parametrize("n, prefill_chunk", [(1, None), (8, None), (8, 16), (SEQ - 1, None)])
def test_unpatched_decode_nll_is_the_one_forward_nll_of_the_last_n(name, n, prefill_chunk):
    model = tiny_model(name)
    t = ids()
    r = evaluate_document(model, t, decode_tokens=n, prefill_chunk=prefill_chunk)
    want = one_forward_nll(model, t)[-n:]
    assert r["scored_tokens"] == n
    assert r["nll_sum"] == pytest.approx(float(want.double().sum()), rel=1e-5)
    assert r["nll_mean"] == pytest.approx(float(want.double().mean()), rel=1e-5)


def test_a_patched_layer_decodes_each_of_the_n_tokens():
    """Each of the N tokens is a one-token call on the method's decode path in every patched layer, and its loss
    is not the prefill's: MoBA's decode reads fewer blocks than its prefill selection did."""
    model = tiny_model("llama")
    t = ids()
    longpatch.patch_model(model, MOBA)
    layers = len(longpatch.patched_layers(model))
    model.longpatch.reset_stats()
    r = evaluate_document(model, t, decode_tokens=8)
    phases = model.longpatch.breakdown()["patched"]
    assert r["scored_tokens"] == 8
    assert phases["decode"]["method"]["calls"] == 8 * layers
    assert phases["prefill"]["method"]["calls"] == layers  # one prefill of the first 56 tokens
    with torch.no_grad():  # the same 8 positions scored from one patched prefill of the whole document
        prefill_only = token_nll(model, final_hidden_states(model, t), t)[-8:]
    assert abs(r["nll_sum"] - float(prefill_only.double().sum())) > 1e-3


def test_run_scores_n_tokens_per_document_and_records_them(data, tmp_path):
    """A sweep of the unpatched row and MoBA in every layer, both through the same decode steps."""
    model = tiny_model("llama")
    out = tmp_path / "run"
    sets = [f"{k}={v}" for k, v in MOBA["params"].items()] + ["min_seq_len=0"]
    r = perplexity(model, "0,all", method="moba", sets=sets, data=data, out=str(out), decode_tokens=8, **FAST)
    assert r["decode_tokens"] == 8 and json.loads((out / "plan.json").read_text())["decode_tokens"] == 8
    base, patched = (c["all"] for c in r["configs"])
    assert base["scored_tokens"] == patched["scored_tokens"] == DOCS * 8
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * DOCS and {rec["decode_tokens"] for rec in records} == {8}
    for rec in records:
        assert rec["scored_tokens"] == 8
        if rec["layers"]:
            assert rec["attention"]["patched"]["decode"]["method"]["calls"] == 8 * rec["layers"], rec["attention"]
    # the unpatched row: the one-forward perplexity of each kept document's last 8 tokens (byte ids, cut to SEQ)
    contexts = {(s, item[0]): item[1] for s, items in FIXTURE.items() for item in items if isinstance(item, tuple)}
    docs = [torch.tensor(list(contexts[(s, d)].encode())[:SEQ])[None] for s in KEPT for d in KEPT[s]]
    want = math.exp(sum(float(one_forward_nll(model, t)[-8:].double().sum()) for t in docs) / (DOCS * 8))
    assert base["ppl"] == pytest.approx(want, rel=1e-5)
    assert patched["ppl"] != pytest.approx(base["ppl"], rel=1e-5)


@pytest.mark.parametrize("value, allowed", [
    (0, "an int >= 1"), (-2, "an int >= 1"), (True, "an int >= 1"), ("8", "an int >= 1"),
    (SEQ, f"an int in [1, {SEQ - 1}]"), (SEQ + 5, f"an int in [1, {SEQ - 1}]")])
def test_bad_decode_tokens_are_one_line(value, allowed):
    with pytest.raises(ConfigError, match="--decode-tokens: got") as e:
        PerplexitySpec(seq_len=SEQ, decode_tokens=value)
    assert allowed in str(e.value) and "\n" not in str(e.value)
    PerplexitySpec(seq_len=SEQ, decode_tokens=SEQ - 1)  # one prefill token is enough
    PerplexitySpec(seq_len=SEQ, decode_tokens=8, prefill_chunk=16)


def test_decode_tokens_are_not_for_sequence_parallel():
    with pytest.raises(ConfigError, match="--decode-tokens 8 cannot be combined with --sequence-parallel 2") as e:
        PerplexitySpec(seq_len=SEQ, decode_tokens=8, sequence_parallel=2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("extra, needles", [
    (["--decode-tokens", "0"], ["--decode-tokens: got 0", "an int >= 1"]),
    (["--decode-tokens", "64"], ["--decode-tokens: got 64", "an int in [1, 63]"]),
    (["--decode-tokens", "8", "--sequence-parallel", "2"], ["--decode-tokens 8", "--sequence-parallel 2"]),
])
def test_cli_bad_values_exit_with_one_line_before_loading(data, tmp_path, monkeypatch, extra, needles):
    def no_loading(*a, **k):
        pytest.fail("loaded a model")

    monkeypatch.setattr("longpatch.loading.load_model", no_loading)
    monkeypatch.setattr("longpatch.eval.sweep.load_model", no_loading)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli.app, ["eval", "ppl", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", data,
                                     "--seq-len", str(SEQ), "--out", str(out), "--no-progress", *extra])
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output, r.output
    for n in needles:
        assert n in r.stderr, r.stderr
    assert not out.exists()


def test_runs_with_and_without_decode_tokens_do_not_resume_each_other(data, tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls = []
    real = ppl_module.evaluate_document
    monkeypatch.setattr(ppl_module, "evaluate_document", lambda *a, **k: calls.append(k) or real(*a, **k))

    def run(**extra):
        calls.clear()
        r = perplexity("tiny:llama", "0", data=data, out=str(out), max_docs=1, **FAST, **extra)
        return r["configs"][0], len(calls)

    full, n = run()
    assert n == 3 and full["all"]["scored_tokens"] == 3 * (SEQ - 1)
    dec, n = run(decode_tokens=8)  # its own config id: every document evaluated again, N tokens each
    assert n == 3 and dec["config_id"] != full["config_id"] and dec["all"]["scored_tokens"] == 3 * 8
    assert run(decode_tokens=8)[1] == 0  # the same run resumes all of its own records
    other, n = run(decode_tokens=4)
    assert n == 3 and other["config_id"] not in (full["config_id"], dec["config_id"])
    again, n = run()
    assert n == 0 and again["config_id"] == full["config_id"]  # the full-prefill records are still there
