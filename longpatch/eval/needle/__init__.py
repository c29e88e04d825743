"""`eval needle`: needle-in-a-haystack retrieval (prompts.py: templates, fillers, prompts and judging;
run.py: the spec, the run and its report)."""
from .run import NeedleSpec, needle, print_results

__all__ = ["NeedleSpec", "needle", "print_results"]
