"""LongBench loading: subsets and categories, every source form, record validation with file:line."""
import json
import zipfile

import pytest

from longpatch.errors import ConfigError
from longpatch.eval.longbench import data as longbench
from longpatch.eval.longbench.data import CATEGORIES, CATEGORY_OF, SUBSETS, DataError, load_longbench, resolve_subsets

# A small LongBench-format fixture, shared with test_eval_perplexity.py. Lengths are in UTF-8
# bytes, so with the byte tokenizer and seq_len 64, "long" documents are kept and "short" ones skipped.
LONG = "The quick brown fox jumps over the lazy dog; long contexts need fast attention. " * 3  # 240 bytes
FIXTURE = {
    "narrativeqa": [("nqa-0", LONG), ("nqa-1", "too short"), ("nqa-2", "Ünïcödé text, " * 8), ("nqa-3", LONG[::-1])],
    "hotpotqa": [("hqa-0", "x" * 63), ("hqa-1", LONG[5:] + " tail"), "{broken json", ("hqa-2", LONG.upper())],
    "lcc": [("lcc-0", "def f(x):\n    return x * 2\n" * 4), ("lcc-1", "short code"), {"missing": "answers"},
            ("lcc-2", "y" * 64)],
}
# kept at seq_len 64 with the byte tokenizer (hqa-0 has 63 bytes, lcc-2 exactly 64)
KEPT = {"narrativeqa": ["nqa-0", "nqa-2", "nqa-3"], "hotpotqa": ["hqa-1", "hqa-2"], "lcc": ["lcc-0", "lcc-2"]}
BAD_LINES = {("hotpotqa", 3), ("lcc", 3)}


def record(subset, doc_id, context):
    return {"input": "question?", "context": context, "answers": ["answer"], "length": len(context.split()),
            "dataset": subset, "language": "en", "all_classes": None, "_id": doc_id}


def fixture_lines(subset):
    for item in FIXTURE[subset]:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            yield json.dumps(item)
        else:
            yield json.dumps(record(subset, *item), ensure_ascii=False)


def write_longbench(root, form="dir"):
    """Write the fixture as a directory of <subset>.jsonl, a data.zip, or a parquet file; return its path."""
    root.mkdir(parents=True, exist_ok=True)
    if form == "dir":
        for subset in FIXTURE:
            (root / f"{subset}.jsonl").write_text("\n".join(fixture_lines(subset)) + "\n", encoding="utf-8")
        return root
    if form == "zip":
        path = root / "data.zip"
        with zipfile.ZipFile(path, "w") as zf:
            for subset in FIXTURE:
                zf.writestr(f"data/{subset}.jsonl", "\n".join(fixture_lines(subset)) + "\n")
            zf.writestr("data/lcc_e.jsonl", "")  # LongBench-E files sit beside; not v1 subsets
        return path
    if form == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        rows = [record(s, *item) for s in FIXTURE for item in FIXTURE[s] if isinstance(item, tuple)]
        path = root / "longbench.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    raise ValueError(form)


def test_subsets_and_categories():
    assert len(SUBSETS) == 21 and len(set(SUBSETS)) == 21
    assert len(CATEGORIES) == 6
    assert CATEGORY_OF["repobench-p"] == "code" and CATEGORY_OF["lsht"] == "few-shot"
    assert resolve_subsets("all") == list(SUBSETS)
    assert resolve_subsets("lcc,narrativeqa") == ["narrativeqa", "lcc"]  # canonical order
    assert resolve_subsets("code,trec") == ["trec", "lcc", "repobench-p"]
    with pytest.raises(ConfigError, match="unknown name 'nope'.*narrativeqa"):
        resolve_subsets("nope")


@pytest.mark.parametrize("form", ["dir", "zip"])
def test_jsonl_forms_validate_with_file_and_line(tmp_path, form):
    lb = load_longbench(str(write_longbench(tmp_path, form)))
    assert {s: [r.doc_id for r in recs] for s, recs in lb.records.items() if recs} == {
        "narrativeqa": ["nqa-0", "nqa-1", "nqa-2", "nqa-3"], "hotpotqa": ["hqa-0", "hqa-1", "hqa-2"],
        "lcc": ["lcc-0", "lcc-1", "lcc-2"]}
    assert {(p.file.rsplit("/", 1)[-1].removesuffix(".jsonl"), p.line) for p in lb.problems} == BAD_LINES
    messages = sorted(str(p) for p in lb.problems)
    assert "hotpotqa.jsonl:3: invalid JSON" in messages[0]
    assert "lcc.jsonl:3: missing fields" in messages[1] and "answers" in messages[1]
    assert len(lb.missing) == 18 and "qasper" in lb.missing
    if form == "zip":
        assert "data.zip!data/hotpotqa.jsonl:3" in messages[0]


def test_strict_makes_a_bad_line_fatal(tmp_path):
    with pytest.raises(DataError, match=r"hotpotqa\.jsonl:3: invalid JSON.*strict"):
        load_longbench(str(write_longbench(tmp_path)), strict=True)


def test_parquet_and_single_file(tmp_path):
    lb = load_longbench(str(write_longbench(tmp_path, "parquet")), "narrativeqa,lcc")
    assert [r.doc_id for r in lb.records["narrativeqa"]] == ["nqa-0", "nqa-1", "nqa-2", "nqa-3"]
    assert lb.records["narrativeqa"][2].context == "Ünïcödé text, " * 8
    assert lb.records["lcc"][0].where.endswith("longbench.parquet:row 8")  # after 4 + 3 rows
    path = write_longbench(tmp_path / "d") / "lcc.jsonl"
    lb = load_longbench(str(path), "lcc")
    assert [r.doc_id for r in lb.records["lcc"]] == ["lcc-0", "lcc-1", "lcc-2"] and len(lb.problems) == 1


def test_field_checks(tmp_path):
    bad = [
        ({**record("trec", "a", "c"), "answers": "not a list"}, "field 'answers'"),
        ({**record("trec", "b", "c"), "length": -1}, "field 'length'"),
        ({**record("trec", "c", "c"), "all_classes": [1, 2]}, "field 'all_classes'"),
        ({**record("trec", "d", "c"), "dataset": "lsht"}, "field 'dataset' is 'lsht'"),
        (record("trec", "e", "c"), None),
        (record("trec", "e", "again"), "duplicate _id 'e'"),
        ([1, 2], "expected a JSON object"),
    ]
    (tmp_path / "trec.jsonl").write_text("\n".join(json.dumps(r) for r, _ in bad) + "\n\n")
    lb = load_longbench(str(tmp_path), "trec")
    assert [r.doc_id for r in lb.records["trec"]] == ["e"]
    problems = {p.line: p.message for p in lb.problems}
    assert len(problems) == 6
    for n, (_, msg) in enumerate(bad, 1):
        assert (n not in problems) if msg is None else (msg in problems[n]), (n, problems.get(n))
    assert "(first at" in problems[6] and "trec.jsonl:5" in problems[6]


def test_nothing_reachable_names_what_was_tried(tmp_path, monkeypatch):
    def offline(**kwargs):
        raise OSError("no network")

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(DataError,
                       match=r"Tried the hub dataset THUDM/LongBench file data\.zip.*no network.*--data PATH"):
        load_longbench(None)
    with pytest.raises(DataError, match="does not exist"):
        load_longbench(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no <subset>\.jsonl.*no data\.zip.*no \*\.parquet"):
        load_longbench(str(tmp_path / "empty"))
    root = write_longbench(tmp_path / "d")
    with pytest.raises(DataError, match="has no subset qasper"):
        load_longbench(str(root), "narrativeqa,qasper")  # named explicitly: an error, not a silent gap
    with pytest.raises(DataError, match="subsets looked for: trec, triviaqa, samsum, lsht"):
        load_longbench(str(root), "few-shot")
    with pytest.raises(DataError, match="holds none of the requested subsets"):
        load_longbench(str(write_longbench(tmp_path / "z", "zip")), "few-shot")


def test_named_sources(tmp_path):
    root = write_longbench(tmp_path / "lb")
    own = tmp_path / "own"
    own.mkdir()
    (own / "demo_code.jsonl").write_text(json.dumps(record("demo_code", "d-0", "x = 1\n" * 20)) + "\n")
    longbench.register_source("fixture-test", lambda: root)
    longbench.register_source("own-test", lambda: own, subsets={"demo_code": "code"})
    try:
        assert len(load_longbench("fixture-test", "lcc").records["lcc"]) == 3
        lb = load_longbench("own-test")  # 'all' means the source's own subsets
        assert [r.doc_id for r in lb.records["demo_code"]] == ["d-0"] and lb.categories == {"demo_code": "code"}
        assert resolve_subsets("code", "own-test") == ["demo_code"]
        with pytest.raises(ConfigError, match="unknown name 'lcc'.*demo_code"):
            resolve_subsets("lcc", "own-test")
        with pytest.raises(ConfigError, match="unknown category"):
            longbench.register_source("bad-test", lambda: own, subsets={"x": "poetry"})
    finally:
        longbench._SOURCES.pop("fixture-test")
        longbench._SOURCES.pop("own-test")
