"""`eval ruler`: RULER's scoring on a hand-worked fixture, its prompts (templates, needles, answer prefixes,
length fitting, determinism), its data readers, and the command offline on the tiny and demo models
(results, RULER's prediction files, resume, --num-processes 2, skipped tasks, one-line errors)."""
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from longpatch import cli
from longpatch.errors import ConfigError
from longpatch.eval.ruler import data as D
from longpatch.eval.ruler import metrics as M
from longpatch.eval.ruler import tasks as T
from longpatch.loading import ByteTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "ruler"
runner = CliRunner()


def invoke(*argv):
    return runner.invoke(cli.app, [str(a) for a in argv])


class ChatBytes(ByteTokenizer):
    """Byte tokenizer with a chat template (a Phi-3-like one-turn wrapping)."""
    chat_template = "phi3-like"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt and len(messages) == 1
        return "<|user|>\n" + messages[0]["content"] + "<|end|>\n<|assistant|>\n"


@pytest.fixture(scope="module")
def qa_data():
    data, label, problems = D.load_qa(str(FIXTURES), ["squad", "hotpotqa"])
    assert not problems and label == f"qa: {FIXTURES}"
    return data


@pytest.fixture(scope="module")
def builder(qa_data):
    essays = "The first essay. It has sentences! Does it ask? Yes.\n\nAnother   essay here. " * 40
    return T.Builder(ByteTokenizer(), T.Wrapper(), T.Data(essays=T.essay_words([essays]), qa=qa_data))


# ---- scoring ---------------------------------------------------------------------------------------

def test_scoring_matches_ruler_on_fixture():
    cases = json.loads((FIXTURES / "scoring.json").read_text())["cases"]
    for case in cases:
        task, samples = case["task"], case["samples"]
        assert M.metric_name(task) == case["metric"]
        preds, refs = [s["pred"] for s in samples], [s["outputs"] for s in samples]
        assert M.task_score(task, preds, refs) == case["score"], task
        for s in samples:
            assert M.sample_score(task, s["pred"], s["outputs"]) == round(s["term"] * 100, 2)
    # qa counts a sample once any answer is found; all-match would give the third sample 0.5
    assert M.string_match_all(["the broncos won"], [["Denver Broncos", "Broncos"]]) == 50.0
    assert M.string_match_part(["the broncos won"], [["Denver Broncos", "Broncos"]]) == 100.0


def test_postprocess_as_ruler():
    assert M.postprocess("\tfoo\x01bar \n") == "foo\nbar"
    assert M.postprocess("  \x00 ") == ""


# ---- tasks and prompts -----------------------------------------------------------------------------

def test_task_table_is_rulers():
    assert list(T.TASKS) == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                             "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
                             "qa_2"]
    assert {t: T.tokens_to_generate(t) for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")} == \
        {"niah_single_1": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32}
    assert T.TASKS["niah_multikey_3"]["args"]["type_needle_k"] == "uuids"
    assert T.TASKS["niah_multikey_1"]["args"]["num_needle_k"] == 4
    assert [T.needs(t) for t in ("niah_single_1", "niah_single_2", "niah_multikey_2", "qa_1", "qa_2")] == \
        [None, "essays", None, "squad", "hotpotqa"]
    assert T.resolve_tasks("qa,vt") == ["vt", "qa_1", "qa_2"]
    assert T.DEPTHS[:4] == [0, 3, 5, 8] and T.DEPTHS[-1] == 100 and len(T.DEPTHS) == 40
    with pytest.raises(ConfigError, match="unknown task 'niah_9'"):
        T.resolve_tasks("niah_9")


def _needles(text):
    return re.findall(r"One of the special magic (\w+) for (\S+) is: (\S+)\.", text)


def test_niah_single_prompt(builder):
    s, = builder.samples("niah_single_1", 2048, 1)
    key = re.search(r"for (\S+) mentioned", s.answer_prefix).group(1)
    assert s.text.startswith("A special magic number is hidden within the following text. Make sure to memorize it. "
                             "I will quiz you about the number afterwards.\nThe grass is green.")
    assert s.text.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text? "
                           f"The special magic number for {key} mentioned in the provided text is")
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert _needles(s.text) == [("numbers", key, s.outputs[0])]  # the needle keeps RULER's plural
    assert re.fullmatch(r"\d{7}", s.outputs[0]) and re.fullmatch(r"[a-z]+-[a-z]+", key)
    assert s.text.count(T.NOISE) > 5
    assert 2048 - 128 - 30 <= len(s.ids) <= 2048 - 128  # grown to fit prompt + generation budget
    assert builder.samples("niah_single_1", 2048, 1)[0].ids == s.ids  # seeded
    other = T.Builder(ByteTokenizer(), T.Wrapper(), builder.data, seed=7).samples("niah_single_1", 2048, 1)[0]
    assert other.outputs != s.outputs


def test_niah_variants(builder):
    uu = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    s, = builder.samples("niah_multikey_3", 2048, 1)
    needles = _needles(s.text)
    assert len(needles) > 5 and all(re.fullmatch(uu, k) and re.fullmatch(uu, v) for _, k, v in needles)
    key = re.search(r"for (\S+) mentioned", s.answer_prefix).group(1)
    assert [v for _, k, v in needles if k == key] == s.outputs
    s, = builder.samples("niah_multivalue", 2048, 1)
    assert s.text.startswith("Some special magic numbers are hidden") and s.answer_prefix.endswith("text are")
    key = re.search(r"for (\S+) mentioned", s.answer_prefix).group(1)
    assert sorted(v for _, k, v in _needles(s.text) if k == key) == sorted(s.outputs) and len(s.outputs) == 4
    s, = builder.samples("niah_multiquery", 2048, 1)
    query = re.search(r"for (.+) mentioned", s.answer_prefix).group(1)
    keys = query.replace(", and ", ", ").split(", ")
    assert len(keys) == 4 and ", and " in query
    found = dict((k, v) for _, k, v in _needles(s.text))
    assert [found[k] for k in keys] == s.outputs
    s, = builder.samples("niah_single_2", 2048, 1)  # essay haystack: the needle between sentences
    assert "The first essay." in s.text and len(_needles(s.text)) == 1


def test_vt_prompt(builder):
    s, = builder.samples("vt", 2048, 1)
    value = re.search(r"assigned the value (\d{5}), they are: $", s.text).group(1)
    assert s.answer_prefix == (" Answer: According to the chain(s) of variable assignment in the text above, 5 "
                               f"variables are assigned the value {value}, they are: ")
    # the in-context example (3-letter names, solved) comes first, then the task
    assert s.text.count("Memorize and track the chain(s) of variable assignment") == 2
    first, task = s.text.split("Memorize and track", 2)[1:]
    assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n", first)
    assert f"VAR {s.outputs[0]} = {value}" in task and len(s.outputs) == 5
    for a, b in zip(s.outputs, s.outputs[1:]):
        assert f"VAR {b} = VAR {a} " in task
    assert task.index(f"VAR {s.outputs[0]} =") < task.index(f"VAR {s.outputs[-1]} =")


def test_cwe_and_fwe_answers_are_the_most_frequent(builder):
    s, = builder.samples("cwe", 2048, 1)
    assert s.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"
    listed = re.findall(r"\d+\. (\S+)", s.text.rsplit("Below is a numbered list of words.", 1)[1])
    counts = {w: listed.count(w) for w in set(listed)}
    top = sorted(counts, key=counts.get, reverse=True)[:len(s.outputs)]
    assert set(top) == set(s.outputs) and min(counts[w] for w in s.outputs) > max(
        [c for w, c in counts.items() if w not in s.outputs] or [0])
    s, = builder.samples("fwe", 2048, 1)
    words = s.text.split("Find the three most frequently appeared coded words. ")[1].split("\nQuestion:")[0].split()
    counts = {w: words.count(w) for w in set(words) if w != "..."}
    ranked = sorted(counts, key=counts.get, reverse=True)
    assert counts[s.outputs[0]] >= counts[s.outputs[1]] >= counts[s.outputs[2]] and set(ranked[:3]) == set(s.outputs)
    assert words.count("...") > counts[s.outputs[0]]


def test_qa_prompt_and_readers(builder, qa_data):
    questions, docs = qa_data["squad"]
    assert [q["query"] for q in questions] == ["What is the capital of France?", "Which river runs through Lyon?",
                                               "Which team won Super Bowl 50?"]  # the impossible one left out
    assert docs == sorted(docs) and len(docs) == 7 and len(questions[0]["more_context"]) == 2
    hq, hdocs = qa_data["hotpotqa"]
    assert hq[0]["outputs"] == ["Paris"] and len(hdocs) == 5  # Berlin's paragraph once
    assert "Eiffel Tower\nThe Eiffel Tower is a tower in Paris, France. It was built in 1889." in hdocs
    s0, s1 = builder.samples("qa_1", 1024, 2)
    assert s0.outputs == ["Paris"] and s1.outputs == ["Rhone", "the Rhone"]
    assert s0.text.startswith("Answer the question based on the given documents. Only give me the answer and do not "
                              "output any other words.\n\nThe following are given documents.\n\nDocument 1:\n")
    assert s0.text.endswith("Question: What is the capital of France? Answer:") and s0.answer_prefix == " Answer:"
    assert "Paris is the capital and largest city of France." in s0.text
    assert builder.samples("qa_2", 1024, 1)[0].text.count("Document ") >= 3


def test_chat_template_wraps_task_before_answer_prefix(builder):
    tok = ChatBytes()
    w = T.model_wrapper(tok)
    assert (w.before, w.after, w.special) == ("<|user|>\n", "<|end|>\n<|assistant|>\n", False)
    s, = T.Builder(tok, w, builder.data).samples("fwe", 1024, 1)
    assert s.text.startswith("<|user|>\nRead the following coded text")
    assert s.text.endswith("in the above coded text?<|end|>\n<|assistant|>\n Answer: According to the coded text "
                           "above, the three most frequently appeared words are:")
    assert T.model_wrapper(ByteTokenizer()) == T.Wrapper()


def test_length_too_short(builder):
    with pytest.raises(ConfigError, match="--lengths 300: too short for vt"):
        builder.samples("vt", 300, 1)


def test_essay_and_qa_sources(tmp_path):
    (tmp_path / "pg.json").write_text(json.dumps({"text": "An essay.  Two spaces.\nNew line."}))
    texts, label = D.load_essays(str(tmp_path / "pg.json"))
    assert T.essay_words(texts) == ["An", "essay.", "Two", "spaces.", "New", "line."]
    texts, label = D.load_essays("demo")
    assert label == D.DEMO_LABEL and texts
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ConfigError, match="PaulGrahamEssays.json"):
        D.load_essays(str(tmp_path / "bad.json"))
    data, _, problems = D.load_qa(str(tmp_path), ["squad"])
    assert data == {} and "no squad.json" in problems[0]


# ---- the command -----------------------------------------------------------------------------------

TINY = ["--model", "tiny:llama", "--tokenizer", "bytes", "--lengths", "2048", "--no-progress"]


def _scores(out):
    r = json.loads((Path(out) / "results.json").read_text())
    recs = sorted((x["task"], x["config"], x["layers"], x["length"], x["index"], x["predicted"], x["score"])
                  for x in r["records"])
    summ = sorted((x["config"], x["layers"], x["task"], x["length"], x["score"], x["samples"]) for x in r["summary"])
    return recs, summ


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ruler") / "full"
    r = invoke("eval", "ruler", *TINY, "--tasks", "vt,fwe", "--samples", "2",
               "--layer-counts", "0,2", "--config", "tiny-llama", "--out", out)
    assert r.exit_code == 0, (r.output, r.exception)
    return out, r


def test_tiny_run_outputs(tiny_run):
    out, r = tiny_run
    assert "skipping" not in r.stderr  # tasks named without their data are an error (test_user_round5_inputs)
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"] == ["vt", "fwe"] and not res["skipped"]
    assert len(res["records"]) == 2 * 2 * 2  # configs x tasks x samples
    rec = res["records"][0]
    assert {"task", "config", "layers", "length", "index", "outputs", "predicted", "score"} <= set(rec)
    assert rec["attention"] and "attention_seconds" in rec
    rows = {(s["config"], s["layers"], s["task"]): s for s in res["summary"]}
    assert set(rows) == {(c, n, t) for c, n in (("exact", 0), ("tiny-llama", 2))
                         for t in ("vt", "fwe", "average")}
    for (c, n, t), s in rows.items():
        if t == "average":
            assert s["score"] == round((rows[(c, n, "vt")]["score"] + rows[(c, n, "fwe")]["score"]) / 2, 2)
    assert (out / "results.csv").read_text().startswith("config,layers,method,task,length,score")
    assert (out / "heatmap_exact_0.png").is_file() and (out / "heatmap_tiny-llama_2.png").is_file()
    # RULER's prediction files, which its evaluate.py reads (index, pred, input, outputs, others)
    lines = [json.loads(x) for x in (out / "pred" / "tiny-llama_2" / "2048" / "fwe.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and {"index", "pred", "input", "outputs", "others", "truncation", "length"} <= set(lines[0])
    assert lines[0]["input"].endswith("the three most frequently appeared words are:")
    assert M.task_score("fwe", [x["pred"] for x in lines], [x["outputs"] for x in lines]) == \
        rows[("tiny-llama", 2, "fwe")]["score"]
    data = [json.loads(x) for x in (out / "data" / "2048" / "fwe.jsonl").read_text().splitlines()]
    assert data[0]["input"] + data[0]["answer_prefix"] == lines[0]["input"] and data[0]["length"] <= 2048


def test_resume_and_processes_equal_one_run(tiny_run, tmp_path):
    out, _ = tiny_run
    want = _scores(out)
    resumed = tmp_path / "resumed"
    args = ["eval", "ruler", *TINY, "--tasks", "vt,fwe", "--layer-counts", "0,2", "--config", "tiny-llama",
            "--out", resumed]
    assert invoke(*args, "--samples", "1").exit_code == 0  # an interrupted run: half the samples done
    assert invoke(*args, "--samples", "2").exit_code == 0
    assert len((resumed / "records.jsonl").read_text().splitlines()) == 8  # the first 4 not done again
    assert _scores(resumed) == want
    r = invoke(*args[:-1], tmp_path / "procs", "--samples", "2", "--num-processes", "2")
    assert r.exit_code == 0, r.output
    assert _scores(tmp_path / "procs") == want
    assert sorted(p.name for p in (tmp_path / "procs").glob("records*.jsonl")) == ["records.rank0.jsonl",
                                                                                   "records.rank1.jsonl"]


def test_demo_model_offline_with_essay_stand_in(tmp_path):
    out = tmp_path / "demo"
    r = invoke("eval", "ruler", "--model", "demo", "--tasks", "vt,niah_single_2", "--lengths", "1024", "--samples", "1",
               "--essays", "demo", "--layer-counts", "0", "--no-progress", "--out", out)
    assert r.exit_code == 0, (r.output, r.exception)
    res = json.loads((out / "results.json").read_text())
    assert res["essays"] == D.DEMO_LABEL and "skipping" not in r.stderr
    rows = {s["task"]: s for s in res["summary"]}
    assert rows["niah_single_2"]["haystack"] == "essay (demo stand-in)" and set(rows) == {"vt", "niah_single_2",
                                                                                           "average"}
    assert "essay (demo stand-in)" in (out / "results.csv").read_text()
    assert res["chat_template"] is False and all(0 <= s["score"] <= 100 for s in res["summary"])


def test_qa_tasks_from_a_directory(tmp_path):
    out = tmp_path / "qa"
    r = invoke("eval", "ruler", *TINY, "--tasks", "qa", "--qa", FIXTURES, "--samples", "2", "--layer-counts", "0",
               "--out", out)
    assert r.exit_code == 0, (r.output, r.exception)
    res = json.loads((out / "results.json").read_text())
    assert res["tasks"] == ["qa_1", "qa_2"] and not res["skipped"] and res["qa"] == f"qa: {FIXTURES}"
    assert {s["metric"] for s in res["summary"] if s["task"] != "average"} == {"string_match_part"}
    assert [x["outputs"] for x in res["records"] if x["task"] == "qa_2"] == [["Paris"], ["yes"]]


@pytest.mark.parametrize("argv, needles", [
    (["--lengths", "100"], ["--lengths", "[256, "]),
    (["--tasks", "niah_9"], ["unknown task 'niah_9'"]),
    (["--samples", "0"], ["--samples", "[1, "]),
    (["--tasks", "qa_1"], ["--tasks: qa_1 cannot run", "qa_1: no --qa"]),
    (["--essays", "/no/such/file.json", "--tasks", "niah_single_2"], ["--essays"]),
    (["--layers", "0,2"], ["--layer-counts 0,2"]),
])
def test_bad_options_one_line_nothing_written(tmp_path, argv, needles):
    out = tmp_path / "bad"
    r = invoke("eval", "ruler", *TINY, "--out", out, *argv)
    assert r.exit_code == 2, (r.output, r.exception)
    err = r.stderr.strip().splitlines()
    assert len([x for x in err if x.startswith("longpatch: error:")]) == 1 and "Traceback" not in r.stderr, err
    assert all(n in err[-1] for n in needles), err
    assert not out.exists()


def test_batches_equal_one_run(tiny_run, tmp_path):
    out, _ = tiny_run
    args = ["eval", "ruler", *TINY, "--tasks", "vt,fwe", "--layer-counts", "0,2", "--config", "tiny-llama",
            "--samples", "2", "--batch-size", "3", "--out", tmp_path / "batched"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert _scores(tmp_path / "batched") == _scores(out)
    batches = [json.loads(x)["batch"] for x in (tmp_path / "batched" / "records.jsonl").read_text().splitlines()]
    assert sorted(batches) == [1, 1, 3, 3, 3, 3, 3, 3]  # 4 samples per point: a batch of 3, then 1
