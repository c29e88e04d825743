"""LongBench perplexity: protocol, exact numbers, chunked loss, sweeps, resume, several processes.

Tiny random-weight models, the byte tokenizer and seq_len 64 keep every run to a fraction of a second;
the two multi-process tests start fresh interpreters and take most of this file's time.
"""
import csv
import json
import math
import os
import socket
import statistics
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_eval_longbench import FIXTURE, KEPT, write_longbench

from longpatch.errors import ConfigError
from longpatch.eval import perplexity
from longpatch.eval.ppl import scoring
from longpatch.eval.ppl.plan import digest
from longpatch.eval.ppl.run import run_eval_ppl
from longpatch.eval.ppl.scoring import final_hidden_states, model_logits, token_nll
from longpatch.eval.records import read_records
from longpatch.eval.sweep import RunSpec
from longpatch.methods.base import _METHODS, Method, register_method
from longpatch.testing.tiny import tiny_model

ppl_module = sys.modules["longpatch.eval.ppl.run"]  # the package exports a function of the same name
SEQ = 64
FAST = dict(tokenizer="bytes", seq_len=SEQ, progress=False, plots=False, warmup=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared, busy CPU idle OpenMP threads cost 50x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def contexts():
    return {(s, item[0]): item[1] for s, items in FIXTURE.items() for item in items if isinstance(item, tuple)}


def kept_ids():
    """The protocol by hand: byte ids of each kept context, truncated to SEQ, in plan order."""
    ctx = contexts()
    return [(s, d, torch.tensor(list(ctx[(s, d)].encode())[:SEQ])) for s in KEPT for d in KEPT[s]]


def test_layer_sweep():
    def sweep(counts):
        return RunSpec(layer_counts=counts).sweep()

    assert sweep("20") == [20]
    assert sweep("0,4,8") == [0, 4, 8]
    assert sweep("0:28:4") == [0, 4, 8, 12, 16, 20, 24, 28]  # end included: Figure 3's axis
    assert sweep("2:4") == [2, 3, 4]
    assert sweep("0,all,0") == [0, "all"]
    assert sweep(None) == [None] and sweep(3) == [3]
    assert RunSpec(layers="8:9").sweep() == [None]  # --layers: which layers, applied to each config
    for bad in ("-1", "4:2", "0:8:0", "a", "", "1:2:3:4", "1:x"):
        with pytest.raises(ConfigError, match="--layer-counts"):
            sweep(bad)
    with pytest.raises(ConfigError, match="give one"):
        RunSpec(layers="2", layer_counts="0,2")


@pytest.mark.parametrize("name", ["llama", "phi", "chatglm2"])
def test_chunked_loss_equals_full_logits_loss(name):
    model = tiny_model(name)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    head = model.transformer.output_layer if name == "chatglm2" else model.get_output_embeddings()
    rows = []
    head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    with torch.no_grad():
        want = F.cross_entropy(model_logits(model, ids)[0, :-1], ids[0, 1:], reduction="none")
        rows.clear()
        hidden = final_hidden_states(model, ids)
        assert rows == [] and hidden.shape == (1, 50, 64)  # the forward stopped before the LM head
        for chunk in (7, 16, 1000):
            rows.clear()
            got = token_nll(model, hidden, ids, chunk)
            assert max(rows) == min(chunk, 49) and sum(rows) == 49  # never more than `chunk` rows of logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_protocol_and_hand_computation(data, tmp_path, capsys):
    model = tiny_model("llama")
    out = tmp_path / "run"
    r = run_eval_ppl(model, "0", data=data, out=str(out), **{k: v for k, v in FAST.items() if k != "plots"})
    assert getattr(model, "longpatch", None) is None  # a model we were given is left unpatched
    plan = json.loads((out / "plan.json").read_text())
    want = kept_ids()
    assert [(d["subset"], d["doc_id"], d["digest"]) for d in plan["docs"]] == [(s, d, digest(t)) for s, d, t in want]
    skipped = {(s["doc_id"], s["reason"], s["context_tokens"]) for s in plan["skipped"]}
    assert skipped == {("nqa-1", "too_short", 9), ("hqa-0", "too_short", 63), ("lcc-1", "too_short", 10)}
    assert plan["per_subset"]["lcc"] == {"records": 3, "kept": 2, "too_short": 1, "not_examined": 0}
    assert {(p["file"].rsplit("/", 1)[-1], p["line"]) for p in r["data_problems"]} == {
        ("hotpotqa.jsonl", 3), ("lcc.jsonl", 3)}

    with torch.no_grad():  # perplexity by hand from the model's full logits
        nll = {(s, d): -torch.log_softmax(model_logits(model, t[None])[0, :-1].double(), -1)
               .gather(1, t[1:, None]).squeeze(1) for s, d, t in want}
    pooled = math.exp(sum(float(v.sum()) for v in nll.values()) / (len(nll) * (SEQ - 1)))
    doc_mean = sum(math.exp(float(v.mean())) for v in nll.values()) / len(nll)
    a = r["configs"][0]["all"]
    assert a["docs"] == 7 and a["scored_tokens"] == 7 * (SEQ - 1) and a["complete"]
    assert a["ppl"] == pytest.approx(pooled, rel=1e-6) and a["ppl_doc_mean"] == pytest.approx(doc_mean, rel=1e-6)
    lcc = [v for (s, _), v in nll.items() if s == "lcc"]
    assert r["configs"][0]["subsets"]["lcc"]["ppl"] == pytest.approx(
        math.exp(sum(float(v.sum()) for v in lcc) / (2 * (SEQ - 1))), rel=1e-6)
    assert set(r["configs"][0]["categories"]) == {"single-doc-qa", "multi-doc-qa", "code"}
    assert a["attention_speedup"] == 1.0 and a["attention_seconds"] > 0 and a["tokens_per_second"] > 0
    assert "doc-mean" in capsys.readouterr().out  # the table run_eval_ppl prints

    with torch.no_grad():  # all-zero logits: every token has NLL ln(256), so both perplexities are 256
        model.lm_head.weight.zero_()
    r = perplexity(model, "0", data=data, out=str(tmp_path / "uniform"), **FAST)["configs"][0]["all"]
    # (1e-7: each token NLL is a float32 ln(256))
    assert r["ppl"] == pytest.approx(256, rel=1e-7) and r["ppl_doc_mean"] == pytest.approx(256, rel=1e-7)
    assert r["refcode_metric"] == pytest.approx(2 ** math.log(256), rel=1e-7)  # the reference code's exp2


def test_tokenizer_is_required(data, tmp_path):
    with pytest.raises(ConfigError, match="without a tokenizer.*'bytes'"):
        perplexity(tiny_model("llama"), "0", data=data, out=str(tmp_path), seq_len=SEQ)
    with pytest.raises(ConfigError, match="at least 256"):
        perplexity(tiny_model("llama", vocab_size=128), "0", data=data, out=str(tmp_path), **FAST)


def test_transformers_tokenizer_keeps_special_tokens():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="[UNK]", model_max_length=4)
    encode, _ = scoring.make_encoder(tok, None, 256, "m")
    assert encode("a b a b a c") == [1, 2, 3, 2, 3, 2, 0]  # BOS kept, nothing truncated at model_max_length


@pytest.fixture
def blur():
    """A deliberately bad method (uniform causal average of values) so that patching changes the loss."""
    def prefill(q, k, v, *, causal, scale, backend, buffers, **params):
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        steps = torch.arange(1, v.shape[2] + 1, dtype=v.dtype).view(1, 1, -1, 1)
        return (v.cumsum(2) / steps)[:, :, -q.shape[2]:]

    register_method(Method("test_blur", "test only", prefill))
    yield "test_blur"
    _METHODS.pop("test_blur")


def test_layer_sweep_repatches_and_reports(data, tmp_path, blur):
    out = tmp_path / "sweep"
    r = perplexity("tiny:llama", "0:4:2", method=blur, data=data, out=str(out), max_docs=1,
                   **{**FAST, "plots": True})
    assert [(c["label"], c["layers"], c["indices"]) for c in r["configs"]] == [
        ("exact", 0, []), ("test_blur:2", 2, [2, 3]), ("test_blur:4", 4, [0, 1, 2, 3])]
    ppl = [c["all"]["ppl"] for c in r["configs"]]
    assert len(set(ppl)) == 3  # each point really ran with its own layers
    assert r["documents"]["skipped"] == {"too_short": 1, "not_examined": 3 + 1 + 2}  # max_docs=1 per subset
    records = read_records(out)
    assert len(records) == 3 * 3
    for rec in records:
        calls = {side: sum(s["calls"] for paths in phases.values() for s in paths.values())
                 for side, phases in rec["attention"].items()}
        assert calls == {"patched": rec["layers"], "unpatched": 4 - rec["layers"]}
        assert set(rec["attention"]["patched"]) <= {"prefill"}  # no decode in a perplexity forward
        assert set(rec["attention"]["patched"].get("prefill", {})) <= {"method"}  # seq_len >= min_seq_len
    base = {(x["subset"], x["doc_id"]): x for x in records if x["layers"] == 0}
    for c in r["configs"]:
        mine = [x for x in records if x["config_id"] == c["config_id"]]
        # the median of the documents' paired ratios
        want = statistics.median(base[(x["subset"], x["doc_id"])]["attention_seconds"] / x["attention_seconds"]
                                 for x in mine)
        assert c["all"]["attention_speedup"] == pytest.approx(want, rel=1e-9)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * (1 + 3 + 3)  # per config: all, 3 categories, 3 subsets
    assert {row["scope"] for row in rows} == {"all", "category", "subset"}
    assert sorted(r["files"]["plots"]) == ["ppl_by_category.png", "ppl_vs_layers.png", "speedup_vs_layers.png"]
    assert all((out / p).stat().st_size > 1000 for p in r["files"]["plots"])


def test_chatglm2_layout_end_to_end(data, tmp_path):
    r = perplexity("tiny:chatglm2", "0,all", method="exact", data=data, out=str(tmp_path), max_docs=1, **FAST)
    base, full = (c["all"] for c in r["configs"])
    assert base["docs"] == full["docs"] == 3
    assert full["ppl"] == pytest.approx(base["ppl"], rel=1e-5)  # exact attention in every layer


def test_resume_skips_finished_documents(data, tmp_path, monkeypatch):
    out = tmp_path / "resume"
    first = perplexity("tiny:llama", "0,2", method="exact", data=data, out=str(out), **FAST)
    path = out / "records.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * 7
    path.write_text("\n".join(lines[:10]) + "\n" + lines[10][: len(lines[10]) // 2])  # killed mid-write

    calls = []
    real = ppl_module.evaluate_document
    monkeypatch.setattr(ppl_module, "evaluate_document", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = perplexity("tiny:llama", "0,2", method="exact", data=data, out=str(out), **FAST)
    assert len(calls) == 4
    assert [json.loads(line)["doc_id"] for line in path.read_text().splitlines()][10:] == [
        json.loads(line)["doc_id"] for line in lines[10:]]  # the cut line was dropped, then redone
    assert [(c["all"]["ppl"], c["all"]["docs"]) for c in again["configs"]] == [
        (c["all"]["ppl"], 7) for c in first["configs"]]
    calls.clear()
    perplexity("tiny:llama", "0,2", method="exact", data=data, out=str(out), **FAST)
    assert calls == []

    changed = write_longbench(tmp_path / "changed")  # same ids, one context edited: its records no longer count
    text = (changed / "lcc.jsonl").read_text().replace("y" * 64, "z" * 64)
    (changed / "lcc.jsonl").write_text(text)
    perplexity("tiny:llama", "0,2", method="exact", data=str(changed), out=str(out), **FAST)
    assert len(calls) == 2


def _compare_with_single(data, out_single, out_multi, results):
    def strip(s):  # timings differ between runs
        return {k: v for k, v in s.items() if "second" not in k and "speedup" not in k}

    def per_doc(out):
        return {(x["config_id"], x["subset"], x["doc_id"]): x["nll_sum"] for x in read_records(out)}

    single = json.loads((out_single / "results.json").read_text())
    for a, b in zip(single["configs"], results["configs"]):
        for scope in ("all", "categories", "subsets"):
            if scope == "all":
                assert strip(a["all"]) == strip(b["all"])
            else:
                assert {k: strip(v) for k, v in a[scope].items()} == {k: strip(v) for k, v in b[scope].items()}
    assert per_doc(out_single) == per_doc(out_multi)


def test_two_processes_match_one(data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    perplexity("tiny:llama", "0,2", method="exact", data=data, out=str(one), **FAST)
    r = perplexity("tiny:llama", "0,2", method="exact", data=data, out=str(two), num_processes=2, **FAST)
    assert sorted(p.name for p in two.glob("records*.jsonl")) == ["records.rank0.jsonl", "records.rank1.jsonl"]
    ranks = [x["rank"] for x in read_records(two)]
    assert ranks.count(0) == 2 * 4 and ranks.count(1) == 2 * 3  # 7 documents dealt round-robin
    _compare_with_single(data, one, two, r)


def test_launcher_processes_match_one(data, tmp_path):
    """What `accelerate launch -m longpatch eval ppl ...` gives each process: RANK, WORLD_SIZE, a rendezvous."""
    one, two = tmp_path / "one", tmp_path / "two"
    perplexity("tiny:llama", "0", data=data, out=str(one), **FAST)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("from longpatch.eval.ppl.run import run_eval_ppl; "
            f"run_eval_ppl('tiny:llama', '0', data={data!r}, out={str(two)!r}, tokenizer='bytes', "
            f"seq_len={SEQ}, warmup=0, progress=False)")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(
        os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1")) for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    _compare_with_single(data, one, two, json.loads((two / "results.json").read_text()))


def test_configurations_are_timed_side_by_side_and_speedups_are_medians(data, tmp_path):
    # the demo's speedups contradicted each other under load (the whole forward 4.2x
    # faster, its attention 1.8x): each configuration's documents were timed in a block of their own
    from longpatch.eval.ppl.report import summarize

    out = tmp_path / "run"
    perplexity("tiny:llama", "0,1,2", method="moba", data=data, out=str(out), **FAST)
    lines = (out / "records.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    order = [(r["subset"], r["doc_id"]) for r in recs]
    assert len(set(order)) > 1
    # document by document, every configuration of the sweep in turn
    assert order == [d for d in dict.fromkeys(order) for _ in range(3)]
    assert [r["layers"] for r in recs] == [0, 1, 2] * len(set(order))
    # attention takes 2 s of a 4 s forward at 0 layers, 1 s of 3 s patched; a load spike hits one baseline
    for i, r in enumerate(recs):
        r["attention_seconds"], r["forward_seconds"] = (2.0, 4.0) if r["layers"] == 0 else (1.0, 3.0)
        if i == 0:
            r["attention_seconds"], r["forward_seconds"] = 50.0, 52.0
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for c in summarize(out, plots=False)["configs"][1:]:
        assert c["all"]["attention_speedup"] == 2.0 and c["all"]["forward_speedup"] == pytest.approx(4 / 3)
