"""Write tests/fixtures/longbench_metrics.json: scores of LongBench's OFFICIAL metric functions (its
metrics.py) and scorers (its eval.py) on a few hundred deterministic (prediction, answer) pairs,
English and Chinese, for tests/test_eval_longbench_tasks.py to check longpatch's metrics against.

Used for the shipped fixture: THUDM/LongBench at commit 2e00731f8d0bff23dc4325161044d0ed8af94c1e
(files LongBench/metrics.py and LongBench/eval.py, last changed in c5ea10bcd06285223c58dfed76bbc92d22273709),
with rouge 1.0.1, jieba 0.42.1 and fuzzywuzzy 0.18.0 without python-Levenshtein (difflib).

    git -C <LongBench mirror> show <commit>:LongBench/metrics.py > /tmp/lb/metrics.py
    git -C <LongBench mirror> show <commit>:LongBench/eval.py > /tmp/lb/eval.py
    python scripts/longbench_metric_fixture.py /tmp/lb/metrics.py --commit <commit>

eval.py is read from beside metrics.py. Only the official functions are run here; nothing of
longpatch is imported, so the fixture cannot inherit a longpatch bug.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import random
import sys
from pathlib import Path

EN_WORDS = ("the a an cat dog river bank paris france 1998 president john smith's report budget agency "
            "unanswerable yes no blue house war of peace city state, new-york. (born) u.s. \"quoted\" "
            "don't it's 42 3.14 well-known café naïve").split()
ZH_WORDS = ("北京 上海 中国 人民 大学 会议 总结 我们 讨论 了 项目 进度 问题 答案 是 的 在 一个 公司 "
            "发展 经济 ，。！？《》“”、（） 2023 年 月 日 张三 李四 研究 表明").split()
CODE_LINES = ("x = 1", "    return self.value", "for i in range(10):", "// comment line", "# comment",
              "```python", "print('hello')", "if a == b: pass", "    self.assertEqual(a, b)", "}", "",
              "int main() {", "    x += 1  # inc", "def f(a, b):", "return x;", "  ", "import os")
CLASSES_EN = ("Description", "Entity", "Abbreviation", "Human being", "Location", "Numeric value", "Human",
              "Number", "Date", "City", "Country", "Color")
CLASSES_ZH = ("财经", "体育", "娱乐", "科技", "教育", "时政", "国际", "社会", "军事", "汽车", "房产", "财经新闻")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _en(rng: random.Random, lo=0, hi=12) -> str:
    return " ".join(rng.choice(EN_WORDS) for _ in range(rng.randint(lo, hi)))


def _zh(rng: random.Random, lo=0, hi=12) -> str:
    sep = rng.choice(("", "", " "))
    return sep.join(rng.choice(ZH_WORDS) for _ in range(rng.randint(lo, hi)))


def _near(rng: random.Random, text: str) -> str:
    """text with a few edits: overlapping but rarely equal."""
    words = text.split(" ")
    for _ in range(rng.randint(0, 3)):
        op = rng.random()
        if op < 0.4 and words:
            words[rng.randrange(len(words))] = rng.choice(EN_WORDS)
        elif op < 0.7 and words:
            words.pop(rng.randrange(len(words)))
        else:
            words.insert(rng.randint(0, len(words)), rng.choice(EN_WORDS))
    return " ".join(words)


def pairs(rng: random.Random):
    """(metric, prediction, answer, all_classes) cases, ~40 per metric, edge cases first."""
    out = []
    for metric in ("qa_f1", "rouge"):
        out += [(metric, p, a, None) for p, a in (("", ""), ("", "Paris"), ("The Paris.", "paris"),
                                                  ("...", "a"), ("a an the", "the"), ("Paris", "Paris"))]
        for _ in range(40):
            a = _en(rng, 1, 20)
            out.append((metric, _near(rng, a) if rng.random() < 0.7 else _en(rng), a, None))
    for metric in ("qa_f1_zh", "rouge_zh"):
        out += [(metric, p, a, None) for p, a in (("", ""), ("北京", "北京"), ("。。", "北京"), ("北京。", "北京"),
                                                  ("Paris 北京", "paris北京"))]
        for _ in range(40):
            a = _zh(rng, 1, 16)
            p = a[: rng.randint(0, len(a))] + _zh(rng, 0, 6) if rng.random() < 0.7 else _zh(rng)
            out.append((metric, p, a, None))
    for _ in range(40):  # classification: several classes named, substrings of the answer, duplicates
        zh = rng.random() < 0.4
        pool = CLASSES_ZH if zh else CLASSES_EN
        classes = rng.sample(pool, rng.randint(3, len(pool)))
        if rng.random() < 0.2:
            classes.append(rng.choice(classes))
        answer = rng.choice(classes)
        named = rng.sample(classes, rng.randint(0, min(4, len(classes))))
        if rng.random() < 0.5:
            named.append(answer)
        pred = ("，" if zh else ", ").join(named) + rng.choice(("", "\nQuestion: x", " Type:"))
        out.append(("classification", pred, answer, classes))
    for metric, word in (("retrieval", "Paragraph "), ("retrieval_zh", "段落")):
        for _ in range(40):
            k = rng.randint(1, 30)
            pred = rng.choice((f"{word}{k}", f"{word}{rng.randint(1, 30)}", f"{word}{k}, {word}{k + 1}",
                               "I don't know", f"The answer is {word}{k}.", f"{k} {k} 7", "１２", ""))
            out.append((metric, pred, f"{word}{k}", None))
    for _ in range(40):
        n = rng.randint(1, 40)
        pred = rng.choice((str(n), str(n + 1), f"{n}, {n}", f"There are {n} paragraphs in 2 groups", "none", ""))
        out.append(("count", pred, n if rng.random() < 0.3 else str(n), None))
    for _ in range(50):
        answer = rng.choice(CODE_LINES)
        lines = [rng.choice(CODE_LINES) for _ in range(rng.randint(0, 4))]
        if rng.random() < 0.5:
            lines.insert(rng.randint(0, len(lines)), _near(rng, answer))
        pred = rng.choice(("", "\n", "\n\n")) + "\n".join(lines)
        out.append(("code_sim", pred, answer, None))
    return out


SCORER_SETS = (  # (dataset, how to make a prediction from the answers)
    "hotpotqa", "multifieldqa_zh", "gov_report", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc",
)


def scorer_cases(rng: random.Random, metric_of: dict):
    cases = []
    for dataset in SCORER_SETS:
        metric = metric_of[dataset]
        kind = [c for c in pairs(random.Random(rng.random())) if c[0] == metric]
        recs = rng.sample(kind, min(9, len(kind)))
        preds = []
        answers = []
        for _, p, a, _ in recs:
            # first-line tasks: a second line that would score differently if it were kept
            preds.append(p + ("\n" + str(a) if rng.random() < 0.5 else ""))
            extra = metric in ("qa_f1", "qa_f1_zh", "rouge", "rouge_zh", "code_sim") and rng.random() < 0.3
            answers.append([str(a)] + ([_en(rng, 1, 4)] if extra else []))  # max over several answers
        all_classes = next((c[3] for c in recs if c[3]), None)
        if metric == "classification":  # one class list per dataset, as in LongBench's files
            pool = CLASSES_ZH if dataset == "lsht" else CLASSES_EN
            all_classes = list(pool)
            answers = [[rng.choice(pool)] for _ in recs]
            preds = [rng.choice(pool) + rng.choice(("", "\n" + rng.choice(pool))) for _ in recs]
        lengths = [rng.choice((100, 3999, 4000, 7999, 8000, 20000)) for _ in recs]
        cases.append({"dataset": dataset, "predictions": preds, "answers": answers, "all_classes": all_classes,
                      "lengths": lengths})
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics_py", type=Path, help="LongBench/metrics.py of a LongBench checkout (eval.py beside it)")
    ap.add_argument("--commit", required=True, help="the LongBench commit the files come from (recorded)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "tests/fixtures/longbench_metrics.json")
    args = ap.parse_args()
    sys.path.insert(0, str(args.metrics_py.parent))  # eval.py does `from metrics import ...`
    metrics = _load(args.metrics_py, "metrics")
    sys.modules["metrics"] = metrics
    ev = _load(args.metrics_py.parent / "eval.py", "longbench_eval")
    official = {"qa_f1": metrics.qa_f1_score, "qa_f1_zh": metrics.qa_f1_zh_score, "rouge": metrics.rouge_score,
                "rouge_zh": metrics.rouge_zh_score, "classification": metrics.classification_score,
                "retrieval": metrics.retrieval_score, "retrieval_zh": metrics.retrieval_zh_score,
                "count": metrics.count_score, "code_sim": metrics.code_sim_score}
    metric_of = {d: next(k for k, f in official.items() if f is fn) for d, fn in ev.dataset2metric.items()}
    rng = random.Random(20231023)
    cases = [{"metric": m, "prediction": p, "answer": a, "all_classes": c,
              "score": float(official[m](p, a, all_classes=c))} for m, p, a, c in pairs(rng)]
    scorers = scorer_cases(rng, metric_of)
    for s in scorers:
        s["score"] = float(ev.scorer(s["dataset"], s["predictions"], s["answers"], s["all_classes"]))
        e = ev.scorer_e(s["dataset"], s["predictions"], s["answers"], s["lengths"], s["all_classes"])
        s["score_e"] = {k: None if v != v else float(v) for k, v in e.items()}  # nan (empty bucket) -> null
    source = args.metrics_py.read_bytes()
    data = {"longbench_commit": args.commit, "metrics_py_sha1": hashlib.sha1(source).hexdigest(),
            "dataset2metric": metric_of, "cases": cases, "scorers": scorers}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(cases)} metric cases and {len(scorers)} scorer cases written to {args.out}")


if __name__ == "__main__":
    main()
