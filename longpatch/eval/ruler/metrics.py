"""RULER's scoring (scripts/eval/evaluate.py and scripts/eval/synthetic/constants.py), rewritten here.

A prediction is first cleaned as RULER's postprocess_pred does: stripped, every control character
(U+0000-U+001F) made a newline, stripped again. Then, case-insensitively:
- string_match_all (niah, vt, cwe, fwe): per sample, the fraction of the expected strings contained in
  the prediction;
- string_match_part (qa): per sample, 1 if any expected string is contained in the prediction, else 0;
the task score is the mean over samples x 100, rounded to 2 decimals.
"""
from __future__ import annotations

import re

from .tasks import TASKS

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    return _CONTROL.sub("\n", pred.strip()).strip()


def match_all(pred: str, refs: list[str]) -> float:
    """One sample's string_match_all term: the share of refs found in pred (case-insensitive)."""
    p = pred.lower()
    return sum(1.0 if r.lower() in p else 0.0 for r in refs) / len(refs)


def match_part(pred: str, refs: list[str]) -> float:
    """One sample's string_match_part term: 1 when any ref is found in pred (case-insensitive)."""
    p = pred.lower()
    return max(1.0 if r.lower() in p else 0.0 for r in refs)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    return round(sum(match_all(p, r) for p, r in zip(preds, refs)) / len(preds) * 100, 2)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    return round(sum(match_part(p, r) for p, r in zip(preds, refs)) / len(preds) * 100, 2)


METRICS = {"niah": string_match_all, "variable_tracking": string_match_all, "common_words_extraction":
           string_match_all, "freq_words_extraction": string_match_all, "qa": string_match_part}


def metric_name(task: str) -> str:
    return METRICS[TASKS[task]["task"]].__name__


def sample_score(task: str, pred: str, refs: list[str]) -> float:
    """One sample's score on RULER's scale (its term of the task's mean x 100, rounded to 2 decimals)."""
    one = match_part if TASKS[task]["task"] == "qa" else match_all
    return round(one(postprocess(pred), refs) * 100, 2)


def task_score(task: str, preds: list[str], refs: list[list[str]]) -> float:
    """A task's RULER score over its samples: its metric on the postprocessed predictions."""
    return METRICS[TASKS[task]["task"]]([postprocess(p) for p in preds], refs)
