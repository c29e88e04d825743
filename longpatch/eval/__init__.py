"""Evaluation: LongBench perplexity (the HyperAttention paper's protocol) with layer sweeps and timing.

`longpatch.eval.perplexity(...)` is the Python twin of `longpatch eval ppl`; the implementation lives
in the submodule longpatch.eval.perplexity (import its other names with `from ... import`).
"""
from .longbench import CATEGORIES, SUBSETS, DataError, load_longbench
from .perplexity import parse_layer_sweep, perplexity, summarize

__all__ = ["CATEGORIES", "SUBSETS", "DataError", "load_longbench", "parse_layer_sweep", "perplexity", "summarize"]
