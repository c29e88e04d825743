"""RULER's outside data: the essay haystack (Paul Graham essays) and the QA sets (SQuAD 2.0 dev,
HotpotQA dev distractor), read as RULER reads them (scripts/data/synthetic/qa.py, niah.py).

--essays: a .json file {"text": ...} (RULER's PaulGrahamEssays.json, made by its
download_paulgraham_essay.py), a .txt file (the essays' text), a directory of .txt files (read in
name order), or 'demo': the demo model's held-out text as a stand-in (not essays; every output says so).
--qa: a directory holding squad.json and/or hotpotqa.json (the files RULER's download_qa_dataset.sh
writes: SQuAD's dev-v2.0.json, HotpotQA's hotpot_dev_distractor_v1.json), or 'hub': those files from
the Hugging Face hub (HotpotQA: the copy RULER's script falls back to; SQuAD 2.0: rajpurkar/squad_v2's
validation split).
"""
from __future__ import annotations

import json
from pathlib import Path

from ...errors import ConfigError
from ...options import missing_path

DEMO_ESSAYS = "demo"
DEMO_LABEL = "demo stand-in: the demo model's held-out Python source, not Paul Graham essays"
HOTPOT_HUB = ("namlh2004/hotpotqa", "hotpot_dev_distractor_v1.json", "7e54db4656209750ff487f6fdf8e39a66dba136b")
SQUAD_HUB = ("rajpurkar/squad_v2", "squad_v2/validation-00000-of-00001.parquet")


def load_essays(spec: str) -> tuple[list[str], str]:
    """(texts, label) of --essays."""
    if spec == DEMO_ESSAYS:
        from ...assets import eval_documents
        return eval_documents(), DEMO_LABEL
    path = Path(spec)
    try:
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise ConfigError(f"--essays {spec}: a directory without .txt files")
            return [f.read_text(encoding="utf-8") for f in files], f"essays: {path}"
        if not path.is_file():
            raise missing_path("--essays", spec, 'a .json ({"text": ...}), a .txt file, a directory of .txt files, '
                               "or demo")
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--essays {spec}: not UTF-8 text") from None
    if path.suffix == ".json":
        try:
            text = json.loads(raw)["text"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"--essays {spec}: expected JSON {{\"text\": \"...\"}} (RULER's "
                              "PaulGrahamEssays.json)") from None
        if not isinstance(text, str):
            raise ConfigError(f"--essays {spec}: \"text\" must be a string")
        raw = text
    if not raw.split():
        raise ConfigError(f"--essays {spec}: no text")
    return [raw], f"essays: {path}"


def read_squad(data: dict) -> tuple[list[dict], list[str]]:
    """qa.py's read_squad: distinct paragraphs (sorted) as documents; each answerable question with its
    answers, its paragraph, and the other paragraphs of its article."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    at = {c: i for i, c in enumerate(docs)}
    questions = []
    for d in data["data"]:
        article = [at[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    questions.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                      "context": [at[p["context"]]],
                                      "more_context": [i for i in article if i != at[p["context"]]]})
    return questions, docs


def read_hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    """qa.py's read_hotpotqa: distinct 'title\\nsentences' paragraphs (sorted) as documents; each question
    with its answer and its ten paragraphs."""
    def doc(title, sentences):
        return f"{title}\n{''.join(sentences)}"
    docs = sorted({doc(t, s) for d in data for t, s in d["context"]})
    at = {c: i for i, c in enumerate(docs)}
    return [{"query": d["question"], "outputs": [d["answer"]], "context": [at[doc(t, s)] for t, s in d["context"]]}
            for d in data], docs


READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}


def load_qa(spec: str, wanted: list[str]) -> tuple[dict, str, list[str]]:
    """({dataset: (questions, documents)}, label, problems) of --qa for the wanted datasets; a dataset it
    lacks is left out (its task is skipped, the problem said)."""
    out, problems = {}, []
    for name in wanted:
        try:
            data = _hub(name) if spec == "hub" else _file(spec, name)
        except ConfigError as e:
            problems.append(str(e))
            continue
        try:
            out[name] = READERS[name](data)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ConfigError(f"--qa {spec}: {name}: not in {name}'s format ({type(e).__name__}: {e})") from None
    return out, f"qa: {spec}", problems


QA_ALLOWED = "a directory holding squad.json and/or hotpotqa.json, or hub"


def check_qa(spec: str) -> None:
    """--qa names hub or a directory; anything else is an error (not a reason to skip the QA tasks)."""
    if spec != "hub" and not Path(spec).is_dir():
        raise missing_path("--qa", spec, QA_ALLOWED)


def _file(spec: str, name: str):
    root = Path(spec)
    check_qa(spec)
    path = root / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"--qa {spec}: no {name}.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--qa {path}: not JSON ({e})") from None


def _hub(name: str):
    """The dataset from the Hugging Face hub (network); a failure is reported and the task skipped."""
    try:
        from huggingface_hub import hf_hub_download

        if name == "hotpotqa":
            repo, file, rev = HOTPOT_HUB
            return json.loads(Path(hf_hub_download(repo, file, repo_type="dataset", revision=rev)).read_text())
        repo, file = SQUAD_HUB
        import pandas as pd

        rows = pd.read_parquet(hf_hub_download(repo, file, repo_type="dataset"))
    except Exception as e:  # offline, no such file, no pandas: the task is skipped with this reason
        raise ConfigError(f"--qa hub: {name} not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                          ) from None
    articles: dict[str, dict] = {}
    for r in rows.itertuples():  # SQuAD's JSON layout from the flat rows
        art = articles.setdefault(r.title, {"title": r.title, "paragraphs": {}})
        para = art["paragraphs"].setdefault(r.context, {"context": r.context, "qas": []})
        texts = list(r.answers["text"])
        para["qas"].append({"question": r.question, "answers": [{"text": t} for t in texts],
                            "is_impossible": not texts})
    return {"data": [{"title": a["title"], "paragraphs": list(a["paragraphs"].values())} for a in articles.values()]}
