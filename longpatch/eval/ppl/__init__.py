"""`eval ppl`: LongBench perplexity, the HyperAttention paper's protocol (run.py: the spec and the loop;
plan.py: which documents; scoring.py: token losses; report.py: results, tables and plots)."""
from .report import summarize
from .run import PerplexitySpec, perplexity, run_eval_ppl

__all__ = ["PerplexitySpec", "perplexity", "run_eval_ppl", "summarize"]
