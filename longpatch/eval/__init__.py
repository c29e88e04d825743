"""Evaluation: LongBench perplexity (the HyperAttention paper's protocol) and needle-in-a-haystack
retrieval, with layer sweeps, timing, resumable output and several processes.

`longpatch.eval.perplexity(...)` is the Python twin of `longpatch eval ppl`, `longpatch.eval.needle_run.needle(...)`
that of `longpatch eval needle`, `longpatch.eval.longbench_run.longbench(...)` that of `longpatch eval longbench`
(LongBench task scores; `longbench_score` is LongBench's scorer). Modules: sweep (model, configurations, layer
counts, RunSpec), launch (processes), records (records*.jsonl, atomic writes), scoring and plan and report
(perplexity's token losses, documents, results), needle and needle_run (the needle protocol and its run),
longbench (data), longbench_tasks, longbench_metrics and longbench_run (the task-score protocol, metrics and
run), demo (the offline demo job).
"""
from .longbench import CATEGORIES, SUBSETS, DataError, load_longbench
from .longbench_metrics import longbench_score
from .perplexity import perplexity
from .report import summarize
from .sweep import RunSpec

__all__ = ["CATEGORIES", "SUBSETS", "DataError", "RunSpec", "load_longbench", "longbench_score", "perplexity",
           "summarize"]
