"""Needle-in-a-haystack pieces: templates, grid, prompts, judging and the report."""
import json

import pytest
from transformers import AutoTokenizer

from longpatch.assets import demo_model_path
from longpatch.errors import ConfigError, LongpatchError
from longpatch.eval.needle import prompts as N


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def filler(tok):
    return N.Filler(N.filler_texts("demo")[:6], tok)


def test_builtin_templates_render():
    needle, question, answer = N.BUILTIN_TEMPLATES["code"].render("71432")
    assert (needle, question, answer) == ("PASSKEY = 71432", "assert PASSKEY ==", "71432")
    needle, question, answer = N.BUILTIN_TEMPLATES["passkey"].render("5")
    assert needle == "The pass key is 5. Remember it. 5 is the pass key."
    assert question == "What is the pass key? The pass key is"


def test_yaml_template(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("needle: 'The door code is {key}.'\nquestion: 'The door code is'\ndigits: 4\n")
    t = N.load_template(str(p))
    assert t.name == "t" and t.digits == 4 and t.render("1234")[0] == "The door code is 1234."
    p.write_text("needle: 'x {key}'\nquestion: q\ncolour: red\n")
    with pytest.raises(ConfigError, match="unknown key.*colour"):
        N.load_template(str(p))
    p.write_text("needle: 'no key here'\nquestion: q\n")
    with pytest.raises(ConfigError, match="must contain"):
        N.load_template(str(p))
    p.write_text("needle: '{who} has {key}'\nquestion: q\n")
    with pytest.raises(ConfigError, match="unknown field"):
        N.load_template(str(p))
    p.write_text("needle: 'x {key'\nquestion: q\n")
    with pytest.raises(ConfigError, match="not a valid format string"):
        N.load_template(str(p))
    with pytest.raises(ConfigError, match="neither a built-in"):
        N.load_template(str(tmp_path / "missing.yaml"))


def test_depth_grid():
    assert N.parse_depths("0:1:0.1") == [round(i / 10, 6) for i in range(11)]
    assert N.parse_depths("0.5,0.05") == [0.05, 0.5]
    for bad in ("0:2:0.5", "a,b", "1:0:0.1", "-0.1"):
        with pytest.raises(ConfigError, match="--depths"):
            N.parse_depths(bad)


def test_keys_seeded_and_distinct():
    t = N.BUILTIN_TEMPLATES["code"]
    keys = N.cell_keys(t, 4096, 0.5, 20, seed=0)
    assert keys == N.cell_keys(t, 4096, 0.5, 20, seed=0)
    assert len(set(keys)) == 20 and all(len(k) == 5 for k in keys)
    assert keys != N.cell_keys(t, 4096, 0.5, 20, seed=1)
    assert keys != N.cell_keys(t, 4096, 0.6, 20, seed=0)


@pytest.mark.parametrize("template", ["code", "passkey"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_prompt_length_depth_and_question(tok, filler, template, depth):
    t = N.BUILTIN_TEMPLATES[template]
    p = N.build_prompt(filler, t, "71432", 1024, depth, start_seed=3)
    assert len(p.ids) == 1024
    text = tok.decode(p.ids)
    needle, question, _ = t.render("71432")
    assert text.endswith(question)
    assert text.count(needle) == 1
    # the needle starts a line, at about the requested depth of the prompt
    assert text[text.index(needle) - 1] == "\n"
    assert abs(p.needle_token / 1024 - depth) < 0.1
    assert tok.decode(p.ids[p.needle_token:p.needle_token + 4]).startswith(needle[:4])


def test_prompts_differ_per_trial_and_are_reproducible(filler):
    t = N.BUILTIN_TEMPLATES["code"]
    a = N.build_prompt(filler, t, "11111", 512, 0.5, start_seed=1)
    assert a == N.build_prompt(filler, t, "11111", 512, 0.5, start_seed=1)
    assert a.ids != N.build_prompt(filler, t, "11111", 512, 0.5, start_seed=2).ids


def test_prompt_errors(filler):
    t = N.BUILTIN_TEMPLATES["code"]
    with pytest.raises(ConfigError, match="too short"):
        N.build_prompt(filler, t, "1", 10, 0.5, 0)
    with pytest.raises(ConfigError, match="only .* tokens"):
        N.build_prompt(filler, t, "1", 10 ** 7, 0.5, 0)


def test_judge():
    assert N.judge(" 71432\nassert", "71432")
    assert N.judge("71432", " 71432")
    assert not N.judge(" 7143", "71432")
    assert not N.judge(" 1 71432", "71432")


def test_filler_sources(tmp_path, tok):
    p = tmp_path / "f.jsonl"
    p.write_text(json.dumps({"context": "a\nb\n"}) + "\n" + json.dumps({"text": "c\n"}) + "\n")
    assert N.filler_texts(str(p)) == ["a\nb\n", "c\n"]
    p.write_text('{"other": 1}\n')
    with pytest.raises(ConfigError, match="f.jsonl:1"):
        N.filler_texts(str(p))
    with pytest.raises(ConfigError, match="--filler"):
        N.filler_texts(str(tmp_path / "nope.txt"))


def test_summary_and_heatmap(tmp_path):
    recs = [{"config": "c", "method": "hyper", "layers": 2, "length": n, "depth": d, "trial": t,
             "expected": "1", "predicted": "1" if (t + n) % 2 else "2", "correct": bool((t + n) % 2)}
            for n in (1024, 2048) for d in (0.0, 0.5) for t in range(3)]
    summary = N.summarize_records(recs)
    assert [(s["length"], s["prompts"]) for s in summary] == [(1024, 6), (2048, 6)]
    assert summary[0]["accuracy"] == pytest.approx(1 / 3)
    lengths, depths, grid = N.accuracy_grid(recs, "c", 2)
    assert lengths == [1024, 2048] and depths == [0.0, 0.5] and grid[0][1] == pytest.approx(1 / 3)
    N.heatmap(recs, "c", 2, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


# ---- the CLI run (`longpatch eval needle`): structure and determinism, not accuracy (the demo model
# cannot retrieve yet) ------------------------------------------------------------------------------

GRID = ["--model", "demo", "--lengths", "256,512", "--depths", "0.25,0.75", "--trials", "1", "--no-progress"]


def _needle(*argv):
    from typer.testing import CliRunner

    from longpatch import cli
    return CliRunner().invoke(cli.app, ["eval", "needle", *argv])


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("needle") / "run"
    r = _needle(*GRID, "--config", "demo,demo-moba", "--layer-counts", "0,4", "--out", str(out))
    assert r.exit_code == 0, (r.output, r.exception)
    return out


def test_cli_writes_results_csv_and_heatmaps(grid_run):
    import csv

    res = json.loads((grid_run / "results.json").read_text())
    recs = res["records"]
    # layer 0 is one shared exact baseline; each config gets its own 4-layer point
    assert {(r["config"], r["method"], r["layers"]) for r in recs} == {
        ("exact", "exact", 0), ("demo", "hyper", 4), ("demo-moba", "moba", 4)}
    assert len(recs) == 3 * 2 * 2
    types = {"config": str, "method": str, "layers": int, "length": int, "depth": float, "trial": int,
             "expected": str, "predicted": str, "correct": bool}
    for r in recs:
        assert all(type(r[k]) is t for k, t in types.items()), r
    assert sorted({r["length"] for r in recs}) == [256, 512] and sorted({r["depth"] for r in recs}) == [0.25, 0.75]
    # the same prompts for every configuration
    keys = {}
    for r in recs:
        keys.setdefault((r["length"], r["depth"], r["trial"]), set()).add(r["expected"])
    assert all(len(v) == 1 for v in keys.values())
    summary = {(s["config"], s["layers"], s["length"]): s for s in res["summary"]}
    assert len(summary) == 3 * 2
    for (config, layers, length), s in summary.items():
        cell = [r for r in recs if (r["config"], r["layers"], r["length"]) == (config, layers, length)]
        assert s["prompts"] == 2 and s["accuracy"] == sum(r["correct"] for r in cell) / 2
        assert s["attention_seconds"] > 0 and "patched" in s["attention_seconds_by_path"] or layers == 0
    rows = list(csv.DictReader((grid_run / "results.csv").open()))
    assert {(r["config"], int(r["layers"]), int(r["length"])) for r in rows} == set(summary)
    for name in ("heatmap_exact_0.png", "heatmap_demo_4.png", "heatmap_demo-moba_4.png"):
        assert (grid_run / name).read_bytes()[:4] == b"\x89PNG"
    assert sorted(res["files"]["heatmaps"]) == sorted(["heatmap_exact_0.png", "heatmap_demo_4.png",
                                                       "heatmap_demo-moba_4.png"])


def test_cli_resume_generates_nothing_new(grid_run):
    lines = (grid_run / "records.jsonl").read_text().splitlines()
    before = json.loads((grid_run / "results.json").read_text())["records"]
    r = _needle(*GRID, "--config", "demo,demo-moba", "--layer-counts", "0,4", "--out", str(grid_run))
    assert r.exit_code == 0, (r.output, r.exception)
    assert (grid_run / "records.jsonl").read_text().splitlines() == lines
    assert json.loads((grid_run / "results.json").read_text())["records"] == before


def test_a_smaller_grid_in_the_same_out_reports_only_its_own_cells(tmp_path):
    out = tmp_path / "run"
    base = ["--model", "demo", "--lengths", "256", "--no-progress", "--out", str(out), "--layers", "0"]
    assert _needle(*base, "--depths", "0.25,0.75", "--trials", "2").exit_code == 0
    r = _needle(*base, "--depths", "0.25", "--trials", "1")  # every prompt of this grid is already done
    assert r.exit_code == 0, (r.output, r.exception)
    assert len((out / "records.jsonl").read_text().splitlines()) == 4
    res = json.loads((out / "results.json").read_text())
    assert [(x["depth"], x["trial"]) for x in res["records"]] == [(0.25, 0)]
    assert res["trials"] == 1 and res["summary"][0]["prompts"] == 1


@pytest.mark.parametrize("argv, needle", [
    (["--depths", "0:2:0.5"], "--depths"),
    (["--lengths", "256,abc"], "--lengths"),
    (["--lengths", "32"], "--lengths"),
    (["--template", "missing.yaml"], "neither a built-in"),
    (["--trials", "0"], "trials: got 0"),
    (["--layers", "-1"], "--layers"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, argv, needle):
    out = tmp_path / "out"
    r = _needle(*GRID, *argv, "--out", str(out))
    assert r.exit_code == 2 and needle in r.stderr and r.stderr.count("\n") == 1, (r.output, r.exception)
    assert "Traceback" not in r.output and not out.exists()


def test_bad_template_file_is_one_line(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("needle: 'no key'\nquestion: q\n")
    r = _needle(*GRID, "--template", str(p), "--out", str(tmp_path / "out"))
    assert r.exit_code == 2 and "must contain" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_two_processes_give_the_records_of_one(tmp_path):
    from longpatch.eval.needle.run import needle
    from longpatch.eval.records import read_records

    def records(out):
        keep = ("config", "layers", "length", "depth", "trial", "expected", "predicted", "correct")
        return sorted(tuple(r[k] for k in keep) for r in read_records(out))

    opts = dict(config="demo-moba", lengths="256", depths="0.25,0.75", trials=1, progress=False, plots=False)
    one = needle("demo", "4", out=str(tmp_path / "one"), **opts)
    two = needle("demo", "4", out=str(tmp_path / "two"), num_processes=2, **opts)
    assert sorted(p.name for p in (tmp_path / "two").glob("records*.jsonl")) == [
        "records.rank0.jsonl", "records.rank1.jsonl"]
    assert records(tmp_path / "one") == records(tmp_path / "two") and len(records(tmp_path / "one")) == 2
    untimed = [[{k: v for k, v in r.items() if "seconds" not in k and k != "attention"} for r in res["records"]]
               for res in (one, two)]
    assert untimed[0] == untimed[1]


def test_longbench_filler_reads_the_contexts_of_the_named_subsets(tmp_path):
    def rec(context, subset):
        return json.dumps({"input": "q", "context": context, "answers": ["a"], "length": 1, "dataset": subset,
                           "language": "en", "all_classes": None, "_id": context})
    (tmp_path / "lcc.jsonl").write_text(rec("def f(): pass", "lcc") + "\n" + rec("x = 1", "lcc") + "\n")
    (tmp_path / "trec.jsonl").write_text(rec("Question: why?", "trec") + "\n")
    assert N.filler_texts(f"longbench:lcc@{tmp_path}") == ["def f(): pass", "x = 1"]
    assert sorted(N.filler_texts(f"longbench:lcc,trec@{tmp_path}")) == ["Question: why?", "def f(): pass", "x = 1"]
    assert len(N.filler_texts("longbench:code@demo")) == len(N.filler_texts("demo"))  # the embedded source
    with pytest.raises(LongpatchError, match="does not exist"):
        N.filler_texts(f"longbench:lcc@{tmp_path / 'missing'}")


def test_batches_give_the_records_of_batch_size_one(tmp_path):
    """--batch-size: prompts of different lengths in one left-padded batch, each row's answer what the
    prompt gives alone, for a method with its own decode path and for exact attention."""
    from longpatch.eval.needle.run import needle
    from longpatch.eval.records import read_records

    def records(out):
        keep = ("config", "layers", "length", "depth", "trial", "expected", "predicted", "correct")
        return sorted(tuple(r[k] for k in keep) for r in read_records(out))

    opts = dict(config="demo-moba", lengths="256,384", depths="0.25,0.75", trials=2, progress=False, plots=False,
                sets=["chunk_size=64", "topk=2", "min_seq_len=0"])
    one = tmp_path / "one"
    needle("demo", "0,4", out=str(one), **opts)
    four = tmp_path / "four"
    needle("demo", "0,4", out=str(four), batch_size=3, **opts)
    assert records(one) == records(four) and len(records(one)) == 2 * 2 * 2 * 2
    assert {r["batch"] for r in read_records(four)} == {3, 2}  # 8 prompts per point: batches of 3, 3, 2
