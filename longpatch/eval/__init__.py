"""Evaluation: LongBench perplexity."""
