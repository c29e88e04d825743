"""`eval longbench`: LongBench task scores (data.py: loading LongBench's files; tasks.py: the official
prompts, budgets and chat rule; metrics.py: the official metrics and scorer; run.py: the spec and the run)."""
from .data import CATEGORIES, SUBSETS, DataError, load_longbench
from .metrics import longbench_score
from .run import LongBenchSpec, longbench

__all__ = ["CATEGORIES", "SUBSETS", "DataError", "LongBenchSpec", "load_longbench", "longbench", "longbench_score"]
