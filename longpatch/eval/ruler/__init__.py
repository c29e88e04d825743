"""`eval ruler`: the RULER benchmark (NVIDIA/RULER) offline (tasks.py: the 13 tasks and their prompts;
words.py: offline word lists; data.py: essays and QA sets; metrics.py: RULER's scoring; run.py: the
spec, the run and its report)."""
from .metrics import string_match_all, string_match_part
from .run import RulerSpec, print_results, ruler

__all__ = ["RulerSpec", "print_results", "ruler", "string_match_all", "string_match_part"]
