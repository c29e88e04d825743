"""LongBench's task metrics and its scorer, giving the numbers of LongBench's own `metrics.py` / `eval.py`.

Each metric takes (prediction, ground_truth, all_classes=None) and returns a score in [0, 1]; the
scorer takes the max over a record's reference answers and reports 100 x mean, rounded to 2
decimals. The agreement with the official functions is a test (tests/fixtures/longbench_metrics.json,
written by scripts/longbench_metric_fixture.py from the official code).

Libraries, as the official code uses them: `rouge` (ROUGE-L F of the `rouge` package, 0.0 where it
raises, e.g. on an empty hypothesis) and `jieba` (Chinese word segmentation). code_sim is fuzzywuzzy's
`fuzz.ratio` in its pure-Python form (difflib's SequenceMatcher, rounded to a whole percent), written
out here so that the number does not change when python-Levenshtein happens to be installed (which
fuzzywuzzy would then use, and which scores some pairs differently).
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Sequence

from ...errors import ConfigError

# Chinese punctuation removed by normalize_zh (LongBench's list, with the ASCII punctuation added to it)
_ZH_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
                   "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"LongBench metrics need the {module!r} package: pip install 'longpatch[longbench]' "
                          f"(rouge, jieba, fuzzywuzzy)") from None


def normalize_en(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces (applied in that order)."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh(text: str) -> str:
    """Lower case, no ASCII or Chinese punctuation, no whitespace at all."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


def _token_f1(pred: list[str], truth: list[str]) -> float:
    same = sum((Counter(pred) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def _jieba_words(text: str) -> list[str]:
    return list(_need("jieba").cut(text, cut_all=False))


def qa_f1(prediction: str, ground_truth: str, **_) -> float:
    return _token_f1(normalize_en(prediction).split(), normalize_en(ground_truth).split())


def qa_f1_zh(prediction: str, ground_truth: str, **_) -> float:
    def words(text):  # jieba words, each normalized, empty ones dropped
        return [w for w in (normalize_zh(t) for t in _jieba_words(text)) if w]
    return _token_f1(words(prediction), words(ground_truth))


def rouge(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F of the `rouge` package; 0.0 when it cannot score the pair (it raises on an empty or
    all-punctuation text, and hits the recursion limit on very long ones): the official behaviour."""
    scorer = _need("rouge").Rouge()
    try:
        return scorer.get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0


def rouge_zh(prediction: str, ground_truth: str, **_) -> float:
    return rouge(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **_) -> float:
    """1 / (number of classes named in the prediction) when the right one is among them, else 0.

    A named class that is a strict substring of the answer is dropped first, but the official loop
    removes items from the list it is iterating over, so the class right after a dropped one is never
    examined; the index walk below does the same, on purpose."""
    if all_classes is None:
        raise ConfigError("classification metric: the record has no all_classes")
    named = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(named):
        term = named[i]
        if term in ground_truth and term != ground_truth:
            named.remove(term)  # its first occurrence, as list.remove does in the official loop
        i += 1
    return 1.0 / len(named) if ground_truth in named else 0.0


def _share_equal(prediction: str, wanted: str) -> float:
    """Fraction of the numbers in the prediction that equal `wanted` (0 when it has none)."""
    numbers = re.findall(r"\d+", prediction)
    return float(sum(n == wanted for n in numbers) / len(numbers)) if numbers else 0.0


def _paragraph_id(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ConfigError(f"retrieval metric: answer {ground_truth[:40]!r} names no paragraph ({pattern})")
    return found[0]


def retrieval(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, _paragraph_id(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, _paragraph_id(ground_truth, r"段落(\d+)"))


def count(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(prediction, str(ground_truth))


def _fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's fuzz.ratio without python-Levenshtein: equal -> 100, one empty -> 0, else difflib's
    ratio as a rounded percent (Python's round: halves to even)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim(prediction: str, ground_truth: str, **_) -> float:
    """Edit similarity of the first prediction line that is not a comment or a code fence."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return _fuzz_ratio(line, ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1, "qa_f1_zh": qa_f1_zh, "rouge": rouge, "rouge_zh": rouge_zh,
    "classification": classification, "retrieval": retrieval, "retrieval_zh": retrieval_zh,
    "count": count, "code_sim": code_sim,
}


def _record_score(dataset: str, prediction: str, ground_truths: Sequence[str], all_classes) -> float:
    from .tasks import FIRST_LINE, metric_of

    metric = METRICS[metric_of(dataset)]
    if dataset in FIRST_LINE:  # few-shot tasks: the model tends to go on with the next example
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for truth in ground_truths:
        score = max(score, metric(prediction, truth, all_classes=all_classes))
    return score


def longbench_score(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
                    all_classes: Sequence[str] | None) -> float:
    """LongBench's `scorer`: 100 x mean over records of the best score against any reference answer,
    rounded to 2 decimals. dataset: a LongBench task name (it picks the metric)."""
    if not predictions or len(predictions) != len(answers):
        raise ConfigError(f"longbench_score: {len(predictions)} predictions for {len(answers)} answer lists; "
                          "expected the same number, at least one")
    total = 0.0
    for prediction, truths in zip(predictions, answers):
        total += _record_score(dataset, prediction, truths, all_classes)
    return round(100 * total / len(predictions), 2)


LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def longbench_score_e(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]],
                      lengths: Sequence[int], all_classes: Sequence[str] | None) -> dict[str, float | None]:
    """LongBench-E's `scorer_e`: the score per length bucket (the record's `length` < 4000, < 8000, more).
    A bucket without records is None (the official code prints nan there)."""
    import numpy as np

    buckets: dict[str, list[float]] = {b: [] for b in LENGTH_BUCKETS}
    for prediction, truths, length in zip(predictions, answers, lengths):
        bucket = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        buckets[bucket].append(_record_score(dataset, prediction, truths, all_classes))
    # np.mean and numpy's round (scale, round half to even, unscale), not Python's: the official code
    # rounds a numpy float, which differs from Python's round on some values
    return {b: float(round(100 * np.mean(v), 2)) if v else None for b, v in buckets.items()}
