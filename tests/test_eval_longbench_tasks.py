"""LongBench task scores (`longpatch eval longbench`): metrics against the official ones, the prompt
protocol, the demo tasks, and the CLI run (every metric end to end, resume, two processes, bad input)."""
import json
from pathlib import Path

import pytest

from longpatch.errors import ConfigError
from longpatch.eval import longbench_score
from longpatch.eval.longbench import metrics as M
from longpatch.eval.longbench import tasks as T
from longpatch.eval.longbench.data import code_completion_tasks, load_longbench

FIXTURE = Path(__file__).parent / "fixtures" / "longbench_metrics.json"


# ---- metrics: the official numbers (fixture from LongBench's own metrics.py / eval.py) ------------

@pytest.fixture(scope="module")
def official():
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_every_metric_matches_the_official_one(official):
    cases = official["cases"]
    assert len(cases) >= 300 and {c["metric"] for c in cases} == set(M.METRICS)
    for c in cases:
        got = M.METRICS[c["metric"]](c["prediction"], c["answer"], all_classes=c["all_classes"])
        assert abs(got - c["score"]) <= 1e-9, c


def test_scorers_match_the_official_ones(official):
    assert official["dataset2metric"] == T.METRIC
    for s in official["scorers"]:
        args = (s["dataset"], s["predictions"], s["answers"])
        assert longbench_score(*args, s["all_classes"]) == s["score"], s["dataset"]
        assert M.longbench_score_e(*args, s["lengths"], s["all_classes"]) == s["score_e"], s["dataset"]


def test_classification_keeps_the_official_loop_quirk():
    # "Human" is a substring of the answer "Human being" and is dropped; the official loop then skips
    # the class right after it ("Location"), which stays counted: 1/2, not 1
    classes = ["Human", "Location", "Human being"]
    assert M.classification("Human Location Human being", "Human being", all_classes=classes) == 0.5


def test_score_contract_errors():
    with pytest.raises(ConfigError, match="predictions"):
        longbench_score("lcc", [], [], None)


# ---- protocol --------------------------------------------------------------------------------------

def test_tasks_resolve():
    assert T.resolve_tasks("all") == list(T.SUBSETS)
    assert T.resolve_tasks("zh") == ["multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"]
    assert T.resolve_tasks("code,trec") == ["trec", "lcc", "repobench-p"]
    assert T.resolve_tasks("all", e=True) == list(T.LONGBENCH_E)
    with pytest.raises(ConfigError, match="LongBench-E has only"):
        T.resolve_tasks("dureader", e=True)
    with pytest.raises(ConfigError, match="unknown name 'nope'"):
        T.resolve_tasks("nope")


def test_max_length_defaults():
    class Cfg:
        max_position_embeddings = 4096
    assert T.default_max_length("chatglm2-6b-32k") == 31500
    assert T.default_max_length("THUDM/chatglm2-6b-32k") == 31500
    assert T.default_max_length("some/model", Cfg()) == 3596
    with pytest.raises(ConfigError, match="--max-length"):
        T.default_max_length("some/model", None)


class _CharTok:
    """A tokenizer of one id per character (BOS = 0), enough to check the middle truncation."""
    eos_token_id = 1

    def __init__(self, chat_template=None):
        self.chat_template = chat_template

    def __call__(self, text, truncation=False, add_special_tokens=True):
        return {"input_ids": [0] * add_special_tokens + [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
        return f"<user>{msgs[0]['content']}<assistant>"


def test_prompt_is_cut_in_the_middle_and_chat_formatted():
    tok = _CharTok()
    short = T.prompt_ids(tok, "lcc", "x = 1\n", "", 1000, "m")
    assert tok.decode(short, True) == "Please complete the code given below. \nx = 1\nNext line of code:\n"
    ids = T.prompt_ids(tok, "lcc", "A" * 500 + "B" * 500, "", 100, "m")
    text = tok.decode(ids, True)
    # first 50 tokens (BOS + 49 characters of the template) and the last 50 characters
    assert text == ("Please complete the code given below. \n" + "A" * 10) + ("B" * 31 + "Next line of code:\n")
    # hotpotqa gets the chat format, trec (few-shot) does not
    chat = T.prompt_ids(_CharTok("t"), "hotpotqa", "c", "q", 1000, "m")
    assert tok.decode(chat).startswith("<user>Answer")  # no BOS added in front of a chat template
    assert tok.decode(T.prompt_ids(_CharTok("t"), "trec", "c", "q", 1000, "m"), True).startswith("Please determine")
    assert T.chat_format(_CharTok(), "hi", "THUDM/chatglm2-6b-32k") == "[Round 1]\n\n问：hi\n\n答："
    assert T.chat_format(_CharTok(), "hi", "base-model") == "hi"
    assert T.stop_ids(tok, "samsum") == ([1, 10], 1) and T.stop_ids(tok, "lcc") == (None, 0)


def test_demo_tasks_are_lcc_format():
    records = load_longbench("demo").records["demo_code"]
    tasks = code_completion_tasks(records, "demo_lcc")
    assert len(tasks) == len(records)
    for rec, task in zip(records, tasks):
        assert rec.context.startswith(task.context) and task.context.endswith("\n")
        rest = rec.context[len(task.context):]
        assert next(line for line in rest.split("\n") if line.strip()).rstrip() == task.answers[0]
        assert task.input == "" and T.metric_of(task.subset) == "code_sim"


# ---- the CLI run on the demo model -----------------------------------------------------------------

def _cli(*argv):
    from typer.testing import CliRunner

    from longpatch import cli
    return CliRunner().invoke(cli.app, ["eval", "longbench", *argv])


def _preds(out: Path) -> dict:
    return {p.relative_to(out).as_posix(): p.read_text(encoding="utf-8") for p in sorted(out.glob("*/pred/*.jsonl"))}


# short generations (the metric does not matter here, the determinism does); the patched layers run
# their method on the 300-token prompts (min_seq_len lowered)
DEMO = ["--model", "demo", "--data", "demo", "--config", "demo", "--layer-counts", "0,4", "--max-samples", "2",
        "--max-length", "300", "--set", "params.min_seq_len=128", "--max-new-tokens", "6", "--no-progress"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lb") / "run"
    r = _cli(*DEMO, "--out", str(out))
    assert r.exit_code == 0, (r.output, r.exception)
    return out


def test_demo_run_writes_longbench_outputs(demo_run):
    res = json.loads((demo_run / "results.json").read_text())
    assert [(c["config"], c["layers"]) for c in res["configs"]] == [("exact", 0), ("demo", 4)]
    for c in res["configs"]:
        assert c["complete"] and set(c["categories"]) == {"code"}
        assert c["attention_seconds"] > 0 and "patched" in c["attention_seconds_by_path"] or c["layers"] == 0
        rows = [json.loads(line) for line in (demo_run / c["dir"] / "pred" / "demo_lcc.jsonl").open()]
        assert len(rows) == 2 and set(rows[0]) == {"pred", "answers", "all_classes", "length"}
        result = json.loads((demo_run / c["dir"] / "result.json").read_text())
        assert result == {"demo_lcc": longbench_score("lcc", [r["pred"] for r in rows], [r["answers"] for r in rows],
                                                      None)}
    assert (demo_run / "results.csv").read_text().startswith("config,layers,method,scope,name,score")
    assert (demo_run / "scores_vs_layers.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_gives_the_same_predictions(demo_run, tmp_path):
    out = tmp_path / "resumed"
    r = _cli(*DEMO, "--out", str(out))
    assert r.exit_code == 0, r.output
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    # interrupted after one generation, in the middle of writing the second
    (out / "records.jsonl").write_text(lines[0] + lines[1][:40])
    for p in out.glob("*/pred/*.jsonl"):
        p.unlink()
    r = _cli(*DEMO, "--out", str(out))
    assert r.exit_code == 0, r.output
    assert len((out / "records.jsonl").read_text().splitlines()) == 4
    assert _preds(out) == _preds(demo_run)


def test_two_processes_give_the_same_predictions(demo_run, tmp_path):
    out = tmp_path / "two"
    r = _cli(*DEMO, "--out", str(out), "--num-processes", "2")
    assert r.exit_code == 0, (r.output, r.exception)
    assert sorted(p.name for p in out.glob("records*.jsonl")) == ["records.rank0.jsonl", "records.rank1.jsonl"]
    assert _preds(out) == _preds(demo_run)


# ---- a LongBench-format directory covering every metric ----------------------------------------------

def _record(task, context, question, answers, classes=None, length=100, i=0):
    return {"input": question, "context": context, "answers": answers, "length": length, "dataset": task,
            "language": "zh" if task in T.CHINESE else "en", "all_classes": classes, "_id": f"{task}-{i}"}


EVERY_METRIC = {  # one task per metric (and samsum for its newline stop)
    "narrativeqa": _record("narrativeqa", "Tom lives in Paris.", "Where does Tom live?", ["Paris"]),
    "multifieldqa_zh": _record("multifieldqa_zh", "张三住在北京。", "张三住在哪里？", ["北京"]),
    "gov_report": _record("gov_report", "The agency spent the budget.", "", ["The agency spent its budget."]),
    "vcsum": _record("vcsum", "我们讨论了项目进度。", "", ["会议讨论了项目进度。"]),
    "trec": _record("trec", "Question: Who? Type: Human", "Question: Where?", ["Location"],
                    ["Human", "Location", "Number"]),
    "samsum": _record("samsum", "Dialogue: A: hi\nSummary: A greets.", "Dialogue: B: bye\nSummary:", ["B leaves."]),
    "passage_count": _record("passage_count", "Paragraph 1: a\n\nParagraph 2: b", "", [2]),
    "passage_retrieval_en": _record("passage_retrieval_en", "Paragraph 1: a\n\nParagraph 2: b", "b",
                                    ["Paragraph 2"]),
    "passage_retrieval_zh": _record("passage_retrieval_zh", "段落1：甲\n\n段落2：乙", "乙", ["段落2"]),
    "lcc": _record("lcc", "def f(x):\n    y = x + 1\n", "", ["    return y"]),
}


def _write_dir(root: Path, records: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for task, rec in records.items():
        (root / f"{task}.jsonl").write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    return root


def test_every_metric_end_to_end(tmp_path):
    data = _write_dir(tmp_path / "lb", dict(EVERY_METRIC, passage_count=_record(
        "passage_count", "Paragraph 1: a", "", ["2"])))
    out = tmp_path / "out"
    r = _cli("--model", "demo", "--method", "exact", "--layers", "0", "--data", str(data), "--tasks",
             ",".join(EVERY_METRIC), "--max-length", "256", "--max-new-tokens", "8", "--out", str(out),
             "--no-progress")
    assert r.exit_code == 0, (r.output, r.exception)
    res = json.loads((out / "results.json").read_text())
    (c,) = res["configs"]
    assert set(c["tasks"]) == set(EVERY_METRIC) and {t["metric"] for t in c["tasks"].values()} == set(M.METRICS)
    assert set(c["categories"]) == {"single-doc-qa", "summarization", "few-shot", "synthetic", "code"}
    result = json.loads((out / c["dir"] / "result.json").read_text())
    for task in EVERY_METRIC:
        rows = [json.loads(line) for line in (out / c["dir"] / "pred" / f"{task}.jsonl").open(encoding="utf-8")]
        assert result[task] == longbench_score(task, [x["pred"] for x in rows], [x["answers"] for x in rows],
                                               rows[0]["all_classes"])
    records = {x["task"]: x for x in map(json.loads, (out / "records.jsonl").open())}
    assert records["samsum"]["new_tokens"] >= 1 and all(x["new_tokens"] <= 8 for x in records.values())


def test_missing_tasks_as_eval_ppl_treats_subsets(tmp_path, caplog):
    # a category or 'all' runs the tasks the data has (and says which it lacks); a task named by itself
    # that the data lacks is an error: the rule eval ppl applies to its subsets
    data = _write_dir(tmp_path / "lb", {"lcc": EVERY_METRIC["lcc"]})
    base = ("--model", "demo", "--method", "exact", "--layers", "0", "--data", str(data), "--max-length", "64",
            "--max-new-tokens", "2", "--no-progress")
    with caplog.at_level("WARNING", logger="longpatch"):
        r = _cli(*base, "--tasks", "code", "--out", str(tmp_path / "a"))
    assert r.exit_code == 0, (r.output, r.exception)
    assert any("has no data for subset(s) repobench-p" in m for m in caplog.messages)
    r = _cli(*base, "--tasks", "lcc,repobench-p", "--out", str(tmp_path / "b"))
    assert r.exit_code == 2 and "has no subset repobench-p" in r.stderr


def test_longbench_e_buckets(tmp_path):
    recs = {t: dict(_record(t, "def f():\n", "", ["    pass"], length=n), dataset=f"{t}_e")
            for t, n in (("lcc", 5000),)}
    root = tmp_path / "lbe"
    root.mkdir()
    for t, rec in recs.items():
        (root / f"{t}_e.jsonl").write_text(json.dumps(rec) + "\n")
    out = tmp_path / "out"
    r = _cli("--model", "demo", "--method", "exact", "--layers", "0", "--data", str(root), "--e", "--tasks", "lcc",
             "--max-length", "64", "--max-new-tokens", "4", "--out", str(out), "--no-progress")
    assert r.exit_code == 0, (r.output, r.exception)
    (c,) = json.loads((out / "results.json").read_text())["configs"]
    result = json.loads((out / c["dir"] / "result.json").read_text())
    assert set(result["lcc"]) == {"0-4k", "4-8k", "8k+"} and result["lcc"]["0-4k"] is None
    assert result["lcc"]["4-8k"] == c["tasks"]["lcc"]["score"]


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "bogus"], "--tasks: unknown name 'bogus'"),
    (["--max-length", "3"], "--max-length: got 3"),
    (["--e"], "--e: LongBench-E needs"),
    (["--layers", "x"], "--layers"),
    (["--max-new-tokens", "0"], "--max-new-tokens: got 0"),
])
def test_bad_options_fail_in_one_line(tmp_path, argv, message):
    out = tmp_path / "out"
    r = _cli("--model", "demo", "--data", "demo", "--out", str(out), "--no-progress", *argv)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("longpatch: error:")]
    assert len(errors) == 1 and message in errors[0], r.output
    assert not out.exists()


def test_bad_data_fails_and_writes_nothing(tmp_path):
    data = _write_dir(tmp_path / "lb", {"lcc": EVERY_METRIC["lcc"]})
    with open(data / "lcc.jsonl", "a") as f:
        f.write('{"input": "", "context": 3}\n')
    out = tmp_path / "out"
    base = ["--model", "demo", "--method", "exact", "--layers", "0", "--tasks", "lcc", "--out", str(out),
            "--no-progress", "--max-length", "64"]
    r = _cli(*base, "--data", str(data), "--strict")
    assert r.exit_code == 2 and "lcc.jsonl:2: missing fields" in r.output and not out.exists(), r.output
    r = _cli(*base, "--data", str(tmp_path / "missing"))
    assert r.exit_code == 2 and "does not exist" in r.output and not out.exists(), r.output


def test_batches_give_the_predictions_of_batch_size_one(tmp_path):
    """batch_size: a task's records generated together, left-padded, each prediction the record's alone;
    samsum's newline stop and minimum length included."""
    from longpatch.eval.longbench.run import longbench
    from longpatch.eval.records import read_records

    recs = {"lcc": [_record("lcc", "def f(x):\n    y = x + 1\n" * k, "", ["    return y"], i=k) for k in (1, 3, 5)],
            "samsum": [_record("samsum", "Dialogue: A: hi\nSummary: A greets.\n" * k, "Dialogue: B: bye\nSummary:",
                               ["B leaves."], i=k) for k in (1, 4)]}
    data = tmp_path / "lb"
    data.mkdir()
    for task, rows in recs.items():
        (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def preds(out):
        return sorted((r["task"], r["doc_id"], r["pred"], r["new_tokens"]) for r in read_records(out))

    opts = dict(method="moba", sets=["chunk_size=32", "topk=2", "min_seq_len=0"], data=str(data),
                max_length=256, max_new_tokens=6, progress=False, plots=False)
    longbench("demo", "4", out=str(tmp_path / "one"), **opts)
    longbench("demo", "4", out=str(tmp_path / "three"), batch_size=3, **opts)
    assert preds(tmp_path / "one") == preds(tmp_path / "three") and len(preds(tmp_path / "one")) == 5
    # groups of 3 in task order (samsum, then lcc), each split by task: samsum 2, lcc 1, lcc 2
    assert sorted(r["batch"] for r in read_records(tmp_path / "three")) == [1, 2, 2, 2, 2]
