"""Evaluation: LongBench perplexity (the HyperAttention paper's protocol) and needle-in-a-haystack
retrieval, with layer sweeps, timing, resumable output and several processes.

`longpatch.eval.perplexity(...)` is the Python twin of `longpatch eval ppl`, `longpatch.eval.needle_run.needle(...)`
that of `longpatch eval needle`. Modules: sweep (model, configurations, layer counts, RunSpec), launch
(processes), records (records*.jsonl, atomic writes), scoring and plan and report (perplexity's token
losses, documents, results), needle and needle_run (the needle protocol and its run), longbench (data),
demo (the offline demo job).
"""
from .longbench import CATEGORIES, SUBSETS, DataError, load_longbench
from .perplexity import perplexity
from .report import summarize
from .sweep import parse_layer_sweep

__all__ = ["CATEGORIES", "SUBSETS", "DataError", "load_longbench", "parse_layer_sweep", "perplexity", "summarize"]
