"""Per-layer params (PatchConfig.layer_params) and `longpatch calibrate`, which chooses them.

Tiny random-weight llama (4 layers, head_dim 16), the byte tokenizer and 256-token documents keep each
calibration to about a second.
"""
import json
import math
import random

import pytest
import torch
import yaml
from test_eval_longbench import record
from typer.testing import CliRunner

from longpatch import patch_model, unpatch_model
from longpatch.calibrate import (
    Tally,
    calibrate_documents,
    calibrated_config,
    candidates,
    choose,
    parse_grid,
    run_calibrate,
)
from longpatch.cli import app
from longpatch.config import PatchConfig, read_config
from longpatch.errors import ConfigError
from longpatch.eval.ppl.plan import digest
from longpatch.eval.sweep import config_id, make_points
from longpatch.methods import get_method
from longpatch.methods.exact import exact_attention
from longpatch.testing.tiny import tiny_model

SEQ = 256
# chunks of 16 at 256 tokens: 16 chunks, so topk 3 and 4 are sparse; stride 4 divides the chunk
BASE = dict(method="moba", params={"chunk_size": 16, "topk": 4, "selection": "hybrid", "mass": None, "local_blocks": 0,
                                   "estimate_queries": 8, "score_stride": 4}, layers="all")
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: conftest's one-thread fixture


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two documents of 300 bytes (kept at SEQ) and one too short, as LongBench jsonl."""
    d = tmp_path_factory.mktemp("calib")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "key", "value", "def", "return", "x", "y"]
    docs = [" ".join(rng.choice(words) for _ in range(80))[:300] for _ in range(2)] + ["short"]
    lines = [json.dumps(record("narrativeqa", f"d{i}", t)) for i, t in enumerate(docs)]
    (d / "narrativeqa.jsonl").write_text("\n".join(lines) + "\n")
    return str(d)


class Doc:
    def __init__(self, ids):
        self.ids, self.digest = ids, digest(ids)


def docs(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Doc(torch.randint(0, 256, (SEQ,), generator=g)) for _ in range(n)]


# --------------------------------------------------------------------------- layer_params


def test_layer_params_reach_their_layers():
    cfg = PatchConfig(**BASE, layer_params={1: {"topk": 3}, 3: {"topk": 8, "mass": 0.9}})
    model = tiny_model("llama")
    patch_model(model, cfg)
    params = {r["layer"]: r["params"] for r in model.longpatch.rows()}
    unpatch_model(model)
    assert params[0]["topk"] == 4 and params[2]["topk"] == 4
    assert params[1]["topk"] == 3 and params[3]["topk"] == 8 and params[3]["mass"] == 0.9
    assert cfg.params_of(1)["topk"] == 3 and cfg.params_of(None) == cfg.params


def test_layer_params_same_as_the_whole_config():
    """Every layer changed to topk 3 by layer_params gives the logits of the config with topk 3."""
    ids = docs(1)[0].ids.view(1, -1)
    model = tiny_model("llama")
    with torch.no_grad():
        patch_model(model, PatchConfig(**BASE, layer_params={i: {"topk": 3} for i in range(4)}))
        a = model(ids).logits
        unpatch_model(model)
        patch_model(model, PatchConfig(**{**BASE, "params": {**BASE["params"], "topk": 3}}))
        b = model(ids).logits
        unpatch_model(model)
        patch_model(model, PatchConfig(**BASE))
        c = model(ids).logits
        unpatch_model(model)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # the change matters at this length


@pytest.mark.parametrize("layer_params, message", [
    ({-1: {"topk": 2}}, "layer_params: got the key -1"),
    ({"1": {"topk": 2}}, "layer_params: got the key '1'"),
    ({True: {"topk": 2}}, "layer_params: got the key True"),
    ({1: 3}, "layer_params.1: got 3; allowed: a mapping"),
    ({1: {"topk": 0}}, "layer_params.1.topk"),
    ({1: {"nonsense": 1}}, "layer_params.1.nonsense"),
    ([1, 2], "layer_params: got [1, 2]; allowed: a mapping"),
])
def test_bad_layer_params_are_one_line(layer_params, message):
    with pytest.raises(ConfigError) as e:
        PatchConfig(**BASE, layer_params=layer_params)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_layer_params_of_layers_not_replaced(caplog):
    """Entries for layers the patch does not replace (a calibrated config run with fewer --layers) are
    said and unused; an index past the model's layers is an error."""
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="longpatch"):
        patch_model(model, PatchConfig(**{**BASE, "layers": 2}, layer_params={0: {"topk": 3}, 3: {"topk": 8}}))
    params = {r["layer"]: r["params"]["topk"] for r in model.longpatch.rows()}
    unpatch_model(model)
    assert params == {2: 4, 3: 8}
    assert "layer_params of layers 0 are not used" in caplog.text
    with pytest.raises(ConfigError, match="layer_params: layer 4 does not exist; allowed: 0-based indices below "
                                          "the model's 4 layers"):
        patch_model(model, PatchConfig(**BASE, layer_params={4: {"topk": 2}}))
    assert getattr(model, "longpatch", None) is None


def test_layer_params_in_yaml_and_sweeps(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "layer_params": {3: {"topk": 2}}}))
    cfg = read_config(str(path)).patch
    assert cfg.layer_params == {3: {"topk": 2}}
    # a sweep point replacing layers 2..3 keeps layer 3's change; one replacing layer 3 only too; none: none
    points = make_points(cfg, [2, 1, 0], 4, {"model": "m"})
    assert [p.cfg.layer_params for p in points] == [{3: {"topk": 2}}, {3: {"topk": 2}}, {}]
    # the ids of configs without layer_params are what they were; with them they differ
    plain = PatchConfig(**BASE)
    assert config_id({"model": "m"}, [3], plain) == config_id({"model": "m"}, [3], plain.replace(layer_params={}))
    assert config_id({"model": "m"}, [3], cfg) != config_id({"model": "m"}, [3], plain)


# --------------------------------------------------------------------------- the calibration


def test_grid_and_candidates():
    cfg = PatchConfig(**BASE)
    grid = parse_grid(["topk=3,4", "mass=[0.9, null]"], "moba")
    assert grid == {"topk": [3, 4], "mass": [0.9, None]}
    assert candidates(cfg, grid) == [{"topk": 3, "mass": 0.9}, {"topk": 3, "mass": None},
                                     {"topk": 4, "mass": 0.9}, {"topk": 4, "mass": None}]
    assert candidates(cfg, {}) == [{}]


@pytest.mark.parametrize("items, message", [
    (["topk"], "--grid 'topk': expected key=v1,v2"),
    (["topk="], "--grid 'topk=': expected key=v1,v2"),
    (["nope=1"], "--grid nope: not a param of method 'moba'"),
    (["topk=2", "topk=4"], "--grid topk: given twice"),
    (["topk=[2"], "--grid 'topk=[2': malformed value"),
    (["topk=[]"], "expected a non-empty list"),
])
def test_bad_grid_is_one_line(items, message):
    with pytest.raises(ConfigError) as e:
        parse_grid(items, "moba")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_candidates_are_checked():
    cfg = PatchConfig(**BASE)
    with pytest.raises(ConfigError, match=r"--grid \(topk=0\): params.topk"):
        candidates(cfg, {"topk": [0]})
    with pytest.raises(ConfigError, match="at most 64"):
        candidates(cfg, {"topk": list(range(1, 10)), "estimate_queries": list(range(1, 10))})
    gate = PatchConfig(method="moba", params={"chunk_size": 16, "topk": 4})
    with pytest.raises(ConfigError, match="does not count its work; allowed: moba or nsa with selection"):
        candidates(gate, {"topk": [2]})


def test_choose():
    t = [Tally(4, 100, 50), Tally(1, 100, 80), Tally(0.25, 100, 120)]  # errors 0.2, 0.1, 0.05
    assert choose(t, 0.15) == (1, True)  # the cheapest within 0.15
    assert choose(t, 1.0) == (0, True)
    assert choose(t, 0.01) == (2, False)  # none within: the most accurate


def _captured_inputs(model, ids, layer):
    """The (q, k, v) the exact model gives layer `layer`'s attention."""
    box = {}
    patch_model(model, PatchConfig(method="exact", layers=[layer]))
    route = model.longpatch.routes[layer]
    inner = route.bound

    def grab(q, k, v, **kw):
        box["qkv"] = (q.clone(), k.clone(), v.clone())
        return inner(q, k, v, **kw)
    route.bound = grab
    route.bound.exact_at = inner.exact_at
    with torch.no_grad():
        model(ids.view(1, -1), use_cache=False)
    unpatch_model(model)
    return box["qkv"]


def test_tallies_match_a_direct_computation():
    """Each (layer, candidate) error is ||o - o_exact|| / ||o_exact|| of the method on that layer's exact
    inputs, and its pairs are the method's own count."""
    model = tiny_model("llama")
    cfg = PatchConfig(**BASE)
    cands = [{"topk": 2}, {"topk": 4}]
    d = docs(1)
    totals = calibrate_documents(model, cfg, d, cands)
    assert sorted(totals) == [0, 1, 2, 3]
    q, k, v = _captured_inputs(model, d[0].ids, 2)
    ref = exact_attention(q, k, v, causal=True)
    for c, t in zip(cands, totals[2]):
        st = {}
        out = get_method("moba").bind({**cfg.params, **c}, q.shape[-1], 2)(q, k, v, causal=True, state=st)
        want = float(((out - ref) ** 2).sum() / (ref ** 2).sum()) ** 0.5
        assert t.error == pytest.approx(want, rel=1e-4)
        assert t.pairs == sum(st["work"].values()) > 0
    assert totals[2][0].pairs < totals[2][1].pairs
    assert totals[2][0].error > totals[2][1].error  # fewer chunks, more error on this input


def test_calibrated_config_keeps_only_changes():
    cfg = PatchConfig(**BASE)
    totals = {0: [Tally(1, 100, 10), Tally(0, 100, 20)], 1: [Tally(100, 100, 10), Tally(0.01, 100, 20)]}
    out, rows = calibrated_config(cfg, [{"topk": 2}, {"topk": 4}], totals, 0.15)
    assert out.layer_params == {0: {"topk": 2}}  # layer 1 keeps the config's topk 4: no entry
    assert [r["meets_max_error"] for r in rows] == [True, True]


def test_relative_max_error():
    """'Rx': each layer's limit is R times the error of the config's own params there."""
    cfg = PatchConfig(**BASE)  # topk 4
    cands = [{"topk": 2}, {"topk": 4}, {"topk": 8}]
    totals = {0: [Tally(1.2, 100, 10), Tally(1, 100, 20), Tally(0.5, 100, 40)],  # errors ~0.11, 0.1, ~0.07
              1: [Tally(4, 100, 10), Tally(1, 100, 20), Tally(0.5, 100, 40)]}  # 0.2, 0.1, ~0.07
    out, rows = calibrated_config(cfg, cands, totals, 1.2, relative=True)
    assert out.layer_params == {0: {"topk": 2}}  # layer 1's topk 2 is 2x worse than its own: kept at 4
    assert rows[0]["limit"] == pytest.approx(0.12) and rows[1]["own"] == {"error": 0.1, "pairs": 20}
    out, _ = calibrated_config(cfg, cands, totals, 1.0, relative=True)
    assert out.layer_params == {}  # nothing cheaper is as accurate as the config itself


def test_a_candidate_run_exactly_costs_dense_attention():
    """A candidate the method runs exactly (topk covering every chunk) is an exact call: its error is 0
    and its cost dense attention's products, so the README's grid at a short length runs as written."""
    model = tiny_model("llama")
    d = docs(1)
    totals = calibrate_documents(model, PatchConfig(**BASE), d, [{"topk": 2}, {"topk": 16}])  # 16 chunks: exact
    n = len(d[0].ids)
    for sparse, exact in totals.values():
        assert exact.error < 1e-5 < sparse.error
        assert exact.pairs == 4 * n * (n + 1) // 2 > sparse.pairs  # 4 query heads, causal


def test_cli_end_to_end_and_resume(data, tmp_path):
    out = tmp_path / "cal"
    args = ["calibrate", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", data, "--seq-len", str(SEQ),
            "--set", "chunk_size=16", "--set", "selection=hybrid", "--set", "estimate_queries=8",
            "--set", "score_stride=4", "--set", "mass=null", "--method", "moba", "--grid", "topk=3,4,8",
            "--out", str(out), "--no-progress"]
    r = runner.invoke(app, [*args, "--max-error", "0.3"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "calibration.json").read_text())
    assert len(res["docs"]) == 2 and len(res["layers"]) == 4
    exact = res["exact_pairs_per_layer"]
    for row in res["layers"]:
        errs = [c["error"] for c in row["candidates"]]
        pairs = [c["pairs"] for c in row["candidates"]]
        assert pairs == sorted(pairs) and 0 < pairs[0] < exact
        # exact attention is one more choice: error 0 at dense attention's products
        i, ok = choose([Tally(e * e, 1.0, p) for e, p in zip(errs, pairs)] + [Tally(0.0, 1.0, exact)], 0.3)
        assert row["chosen"] == [*res["candidates"], "exact"][i] and ok and row["meets_max_error"]
    cfg = read_config(str(out / "calibrated.yaml"))
    assert cfg.patch.method == "moba" and cfg.load["model"] == "tiny:llama"
    assert all(set(v) == {"topk"} for v in cfg.patch.layer_params.values())
    kept = [r["layer"] for r in res["layers"] if r["chosen"] != "exact"]
    assert cfg.patch.layers == (kept if len(kept) < 4 else "all")
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # a rerun with another --max-error resumes: no new records, a config from the same tallies
    r = runner.invoke(app, [*args, "--max-error", "1e9"])
    assert r.exit_code == 0, r.output
    assert (out / "records.jsonl").read_text().splitlines() == lines
    cheapest = read_config(str(out / "calibrated.yaml")).patch
    assert cheapest.layer_params == {i: {"topk": 3} for i in range(4)}


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "4096"], "the calibration text is too short"),
    (["--max-error", "0"], "--max-error: got '0'"),
    (["--max-error", "1.2y"], "--max-error: got '1.2y'"),
    (["--max-error", "-1x"], "--max-error: got '-1x'"),
    (["--max-error", "1.2x", "--grid", "topk=3,5"], "--max-error 1.2x: relative to the config's own error, but "
                                                    "--grid does not hold the config's own values"),
    (["--grid", "topk"], "--grid 'topk': expected key=v1,v2"),
    (["--max-docs", "0"], "--max-docs: got 0"),
])
def test_cli_bad_input_is_one_line(data, tmp_path, extra, message):
    out = tmp_path / "cal"
    args = ["calibrate", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", data, "--seq-len", str(SEQ),
            "--method", "moba", "--set", "chunk_size=16", "--set", "selection=hybrid", "--set", "score_stride=4",
            "--out", str(out), "--no-progress", *extra]
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_cli_refuses_a_users_directory(data, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="non-empty directory that longpatch did not write"):
        run_calibrate("tiny:llama", method="moba", data=data, out=str(out), seq_len=SEQ, tokenizer="bytes")
    assert (out / "notes.txt").read_text() == "keep" and len(list(out.iterdir())) == 1


def test_calibration_text_script(tmp_path):
    """scripts/calibration_text.py joins the demo's documents into ones of at least --min-tokens tokens,
    in a directory `--data` reads; it refuses a non-empty --out and a count below 1."""
    import subprocess
    import sys
    from pathlib import Path

    from longpatch.eval.longbench.data import load_longbench
    from longpatch.loading import load_model

    script = Path(__file__).resolve().parents[1] / "scripts" / "calibration_text.py"
    out = tmp_path / "cal"
    r = subprocess.run([sys.executable, str(script), "--out", str(out), "--min-tokens", "40000"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    _, tok = load_model("demo")
    lb = load_longbench(str(out), "all")
    texts = [rec.context for recs in lb.records.values() for rec in recs]
    assert len(texts) >= 4 and all(len(tok(t)["input_ids"]) >= 40000 for t in texts)
    again = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True)
    assert again.returncode != 0 and "is not empty" in again.stderr
    bad = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "x"), "--min-tokens", "0"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--min-tokens: got 0" in bad.stderr and not (tmp_path / "x").exists()


def test_max_docs_is_per_subset(tmp_path):
    """--max-docs counts per subset, as in eval ppl: two subsets of two long documents each, max 1 -> 2."""
    d = tmp_path / "mixed"
    d.mkdir()
    rng = random.Random(1)
    for subset in ("narrativeqa", "lcc"):
        texts = ["".join(rng.choice("abcdef gh\n") for _ in range(300)) for _ in range(2)]
        (d / f"{subset}.jsonl").write_text("".join(json.dumps(record(subset, f"{subset}{i}", t)) + "\n"
                                                   for i, t in enumerate(texts)))
    res = run_calibrate("tiny:llama", method="moba", sets=["chunk_size=16", "selection=hybrid", "score_stride=4",
                                                           "estimate_queries=8"],
                        grid=["topk=3,4"], data=str(d), out=str(tmp_path / "out"), seq_len=SEQ, max_docs=1,
                        tokenizer="bytes", progress=False)
    assert sorted(x["subset"] for x in res["docs"]) == ["lcc", "narrativeqa"]


# --------------------------------------------------------------------------- the held-out text


def test_choose_with_a_held_out_text():
    """A candidate qualifies only within both limits; none within: the one least over them."""
    cal = [Tally(1, 100, 10), Tally(0.25, 100, 20), Tally(0.01, 100, 40)]  # errors 0.1, 0.05, 0.01
    held = [Tally(9, 100, 12), Tally(1, 100, 22), Tally(0.04, 100, 44)]  # 0.3, 0.1, 0.02
    assert choose(cal, 0.15) == (0, True)  # the calibration text alone takes the cheapest
    assert choose(cal, 0.15, held, 0.15) == (1, True)  # the held-out text refuses it
    assert choose(cal, 0.15, held, 0.05) == (2, True)
    assert choose(cal, 0.15, held, 0.01) == (2, False)  # none within: least over (0.02 / 0.01)
    assert choose(cal, 0.15, held, 0.0) == (2, False)  # a zero limit: no division by it


def test_calibrated_config_with_a_held_out_text():
    """Each text's relative limit is R times the config's own error on that text; the rows report both."""
    cfg = PatchConfig(**BASE)  # topk 4
    cands = [{"topk": 2}, {"topk": 4}, {"topk": 8}]
    totals = {0: [Tally(1.0, 100, 10), Tally(1, 100, 20), Tally(0.5, 100, 40)],  # 0.1, 0.1, ~0.07
              1: [Tally(1.0, 100, 10), Tally(1, 100, 20), Tally(0.5, 100, 40)]}
    held = {0: [Tally(1.0, 100, 11), Tally(1, 100, 21), Tally(0.5, 100, 41)],  # topk 2 holds on the other text
            1: [Tally(16, 100, 11), Tally(1, 100, 21), Tally(0.5, 100, 41)]}  # topk 2: 4x its own error
    out, rows = calibrated_config(cfg, cands, totals, 1.0, relative=True)
    assert out.layer_params == {0: {"topk": 2}, 1: {"topk": 2}}
    out, rows = calibrated_config(cfg, cands, totals, 1.0, relative=True, held=held)
    assert out.layer_params == {0: {"topk": 2}}  # layer 1 keeps topk 4: topk 2 lost on the held-out text
    h = rows[1]["held_out"]
    assert h["limit"] == pytest.approx(0.1) and h["error"] == pytest.approx(0.1) and h["own"]["pairs"] == 21
    assert [c["error"] for c in h["candidates"]] == pytest.approx([0.4, 0.1, 0.5 ** 0.5 / 10])


def test_a_layer_may_keep_exact_attention():
    """With exact_pairs, exact attention is a choice: where no candidate is within the limits, or where it is
    cheaper than those that are, the layer leaves the config's layers (and its layer_params)."""
    cfg = PatchConfig(**BASE)  # layers all, topk 4
    cands = [{"topk": 2}, {"topk": 4}]
    totals = {0: [Tally(1, 100, 10), Tally(0.25, 100, 20)],  # 0.1, 0.05: topk 2 within 0.15
              1: [Tally(16, 100, 10), Tally(9, 100, 20)],  # 0.4, 0.3: none within
              2: [Tally(1, 100, 10), Tally(0.25, 100, 90)]}  # topk 2 within, cheaper than exact (50)
    out, rows = calibrated_config(cfg, cands, totals, 0.15)
    assert out.layers == "all" and out.layer_params == {0: {"topk": 2}, 2: {"topk": 2}}  # 1: the most accurate
    out, rows = calibrated_config(cfg, cands, totals, 0.15, exact_pairs=(50, 50))
    assert out.layers == [0, 2] and out.layer_params == {0: {"topk": 2}, 2: {"topk": 2}}
    assert rows[1]["chosen"] == "exact" and rows[1]["error"] == 0 and rows[1]["pairs"] == 50
    assert rows[1]["meets_max_error"]
    out, rows = calibrated_config(cfg, cands, totals, 0.15, exact_pairs=(5, 5))  # dense cheaper than all
    assert out.layers == [] and out.layer_params == {}


def test_cli_holdout(data, tmp_path):
    """--holdout runs every candidate on a second text; a layer's choice holds on both, the report and
    calibration.json show both; a held-out text that is too short, or is the calibration text, is refused
    in one line with nothing written."""
    held = tmp_path / "held"
    held.mkdir()
    rng = random.Random(5)
    text = "".join(rng.choice("the quick brown fox jumps over a lazy dog.\n") for _ in range(320))
    (held / "gov_report.jsonl").write_text(json.dumps(record("gov_report", "h0", text)) + "\n")
    out = tmp_path / "cal"
    args = ["calibrate", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", data, "--seq-len", str(SEQ),
            "--set", "chunk_size=16", "--set", "selection=hybrid", "--set", "estimate_queries=8",
            "--set", "score_stride=4", "--set", "mass=null", "--method", "moba", "--grid", "topk=3,4,8",
            "--max-error", "1.0x", "--no-exact-layers", "--no-progress"]
    r = runner.invoke(app, [*args, "--holdout", str(held), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "error held out" in r.output
    res = json.loads((out / "calibration.json").read_text())
    assert res["held_out"]["data"].endswith("held") and len(res["held_out"]["docs"]) == 1
    for row in res["layers"]:
        h = row["held_out"]
        cal = [Tally(c["error"] ** 2, 1.0, c["pairs"]) for c in row["candidates"]]
        other = [Tally(c["error"] ** 2, 1.0, c["pairs"]) for c in h["candidates"]]
        i, ok = choose(cal, row["limit"], other, h["limit"])
        assert row["chosen"] == res["candidates"][i] and row["meets_max_error"] == ok
        if ok:
            assert row["error"] <= row["limit"] * (1 + 1e-9) and h["error"] <= h["limit"] * (1 + 1e-9)
    assert len((out / "records.jsonl").read_text().splitlines()) == 3  # two calibration documents, one held out
    short = tmp_path / "short"
    short.mkdir()
    (short / "gov_report.jsonl").write_text(json.dumps(record("gov_report", "s0", text[:100])) + "\n")
    for extra, message in ((["--holdout", data], "--holdout: 2 of its documents are calibration documents too"),
                           (["--holdout", str(short)], "the held-out text (--holdout) is too short")):
        bad = tmp_path / "bad"
        r = runner.invoke(app, [*args, "--out", str(bad), *extra])
        assert r.exit_code == 2, r.output
        assert message in r.output and "Traceback" not in r.output
        assert not bad.exists()


# --------------------------------------------------------------------------- the perplexity target


def test_layer_ppl_is_each_layer_alone_against_exact():
    """layer_ppl: the perplexity ratio of the model with one layer replaced by a candidate (the others
    exact) over the unpatched model's, minus 1, pooled over the documents' tokens."""
    from longpatch.calibrate import layer_ppl
    from longpatch.eval.ppl.scoring import final_hidden_states, token_nll

    model = tiny_model("llama")
    cfg = PatchConfig(**BASE)
    d = docs(2, seed=4)
    cands = [{"topk": 2}, {"topk": 4}]
    got = layer_ppl(model, cfg, d, cands, [1, 3])

    def nll():
        with torch.no_grad():
            return sum(float(token_nll(model, final_hidden_states(model, x.ids.view(1, -1)), x.ids.view(1, -1))
                             .double().sum()) for x in d)
    base = nll()
    tokens = sum(len(x.ids) - 1 for x in d)
    for layer in (1, 3):
        for i, c in enumerate(cands):
            patch_model(model, cfg.replace(layers=[layer], params={**cfg.params, **c}))
            want = math.exp((nll() - base) / tokens) - 1
            unpatch_model(model)
            assert got[layer][i] == pytest.approx(want, abs=1e-9)
    assert any(abs(v) > 1e-6 for vs in got.values() for v in vs)  # the candidates do change the model


def test_cli_max_ppl_increase(data, tmp_path):
    """--max-ppl-increase judges each layer by the perplexity increase it causes alone (a decrease counts
    as 0), cheapest within; the records resume; it and --max-error together, or a value <= 0, are refused."""
    out = tmp_path / "cal"
    args = ["calibrate", "--model", "tiny:llama", "--tokenizer", "bytes", "--data", data, "--seq-len", str(SEQ),
            "--set", "chunk_size=16", "--set", "selection=hybrid", "--set", "estimate_queries=8",
            "--set", "score_stride=4", "--set", "mass=null", "--method", "moba", "--grid", "topk=3,8",
            "--no-progress", "--out", str(out)]
    r = runner.invoke(app, [*args, "--max-ppl-increase", "0.5"])
    assert r.exit_code == 0, r.output
    assert "ppl increase" in r.output
    res = json.loads((out / "calibration.json").read_text())
    assert res["metric"] == "ppl_increase" and res["max_error"] == pytest.approx(0.005)
    exact = res["exact_pairs_per_layer"]
    for row in res["layers"]:
        tallies = [Tally(c["error"] ** 2, 1.0, c["pairs"]) for c in row["candidates"]] + [Tally(0.0, 1.0, exact)]
        i, _ = choose(tallies, 0.005)
        assert row["chosen"] == [*res["candidates"], "exact"][i]
        assert all(c["error"] >= 0 for c in row["candidates"])
    lines = (out / "records.jsonl").read_text().splitlines()
    assert sum('"key": "ppl|' in line for line in lines) == 2  # one perplexity record per document
    r = runner.invoke(app, [*args, "--max-ppl-increase", "1e6"])  # resumed: no new records
    assert r.exit_code == 0, r.output
    assert (out / "records.jsonl").read_text().splitlines() == lines
    assert read_config(str(out / "calibrated.yaml")).patch.layer_params == {i: {"topk": 3} for i in range(4)}
    for extra, message in ((["--max-ppl-increase", "1", "--max-error", "0.2"], "both given; allowed: one of them"),
                           (["--max-ppl-increase", "0"], "--max-ppl-increase: got 0.0")):
        bad = tmp_path / "bad"
        r = runner.invoke(app, [*args[:-1], str(bad), *extra])
        assert r.exit_code == 2, r.output
        assert message in r.output and "Traceback" not in r.output
        assert not bad.exists()
