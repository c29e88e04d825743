"""The shipped demo model and its evaluation set: offline loading, long-context use, patching."""
import pytest

import longpatch
from longpatch.assets import demo_model_path, eval_documents
from longpatch.eval.demo import demo_configs, long_context_report


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = longpatch.demo_model_path()
    assert path == demo_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_loads_offline_with_the_promised_shape(demo):
    model, tok = demo
    c = model.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 64)
    assert sum(p.numel() for p in model.parameters()) < 6e6
    assert len(tok) == c.vocab_size == 8192
    # v2: YaRN settings that serve 32k prompts are in config.json, so plain transformers gets them
    assert c.max_position_embeddings >= 32768 and c.rope_parameters["rope_type"] == "yarn"


def test_v2_finds_a_passkey_with_exact_attention(demo, tmp_path):
    """Model v2 retrieves: a prose passkey at 3 depths of a 2048-token held-out haystack (the full 4k-32k
    grid is in the model card; `python scripts/build_demo_model.py --report`)."""
    from longpatch.eval.needle.run import needle
    model, tok = demo
    res = needle(model, "0", method="sparse", template="passkey", lengths="2048", depths="0.1,0.5,0.9", trials=1,
                 out=str(tmp_path / "needle"), tokenizer=tok, progress=False, plots=False)
    assert sum(r["correct"] for r in res["records"]) >= 2


def test_tokenizer_round_trips(demo):
    _, tok = demo
    text = eval_documents(1)[0][:3000] + "\n\tdef f(x):  # ünïcode → ok\n        return x ** 2\n"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_uses_long_context(demo):
    """Late positions (2048..4095) are predicted better than early ones and than with 256 tokens of context."""
    model, tok = demo
    r = long_context_report(model, tok, eval_documents(3))
    assert r["docs"] == 3
    assert r["late"] < r["early"] - 0.3
    assert r["late"] < r["late_short_context"]


def test_exact_patch_reproduces_unpatched_perplexity(demo, tmp_path):
    model, tok = demo
    from longpatch.eval import perplexity
    res = perplexity(model, "0,4", config="demo", method="exact", data="demo", seq_len=1024,
                                    max_docs=2, out=str(tmp_path), tokenizer=tok, progress=False, plots=False)
    base, patched = (c["all"]["ppl"] for c in res["configs"])
    assert res["configs"][1]["layers"] == 4 and base == pytest.approx(patched, rel=1e-5)
    assert 1 < base < 8192


def test_demo_configs_and_apply(monkeypatch, capsys):
    import sys

    from longpatch import cli
    assert {"demo", "demo-moba", "demo-nsa", "demo-sparse"} == set(demo_configs())  # the 32k ones: the first table
    assert "demo-hyper-32k" not in demo_configs()  # exact attention at the demo's 4096 tokens
    monkeypatch.setattr(sys, "argv", ["longpatch", "apply", "--model", "demo", "--prefill", "512"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "patched 2 of 4 layers with 'hyper'" in out
    # the needle-at-32k config replaces every layer (its budget: docs/demo.md, scripts/needle_budgets.py)
    monkeypatch.setattr(sys, "argv", ["longpatch", "apply", "--model", "demo-hyper-32k", "--prefill", "512"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 0
    assert "patched 4 of 4 layers with 'hyper'" in capsys.readouterr().out


@pytest.mark.slow
def test_uses_long_context_on_the_whole_eval_set(demo):
    model, tok = demo
    r = long_context_report(model, tok, eval_documents())
    assert r["docs"] == 24
    assert r["late"] < r["early"] - 0.5 and r["late"] < r["late_short_context"] - 0.05


def test_demo_job_reports_retrieval_beside_perplexity(tmp_path):
    """The main job: perplexity, speed and needle accuracy for every demo config and layer count."""
    import json

    from longpatch.eval.demo import run_demo
    s = run_demo(layer_counts="0,4", max_docs=1, out=str(tmp_path), progress=False, needle_length=512, needle_trials=1,
                 headline_length=1024, headline_ppl_length=1024)
    assert s["needle"]["length"] == 512 and len(s["needle"]["depths"]) == 5
    assert {r["config"] for r in s["rows"]} == set(demo_configs())
    assert all(0 <= r["needle_accuracy"] <= 1 for r in s["rows"])
    assert json.loads((tmp_path / "demo.json").read_text())["rows"] == s["rows"]
    needle = json.loads((tmp_path / "needle" / "results.json").read_text())
    assert {(r["config"], r["layers"]) for r in needle["summary"]} == \
        {("exact", 0)} | {(c, 4) for c in demo_configs()}
    assert (tmp_path / "figure3.png").stat().st_size > 0
    # the first table: the 32k configs as shipped (layer 1 exact), then every layer, beside exact (here at 1024 tokens)
    head = s["headline"]
    assert [(r["config"], r["layers"]) for r in head["rows"]] == [
        ("exact", []), ("demo-moba-32k", [0, 2, 3]), ("demo-moba-32k", "all"), ("demo-nsa-32k", [0, 2, 3]),
        ("demo-nsa-32k", "all")]
    assert all(r["prefill_s"] > 0 and r["needles"] == 3 and r["ppl"] > 1 for r in head["rows"])
    for name in ("needle", "needle-shipped", "ppl", "ppl-shipped"):  # the shipped rows: runs of their own layers
        assert (tmp_path / "headline" / name / "results.json").exists(), name
    shipped = json.loads((tmp_path / "headline" / "ppl-shipped" / "results.json").read_text())
    assert {(c["config"], c["layers"]) for c in shipped["configs"]} == {("demo-moba-32k", 3), ("demo-nsa-32k", 3)}
    assert all(0 <= r["needles_kept"] <= r["needles_found"] for r in head["rows"][1:])
    assert (tmp_path / "headline" / "needle" / "results.json").exists() and (tmp_path / "frontier.png").exists()
