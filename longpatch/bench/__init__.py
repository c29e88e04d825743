"""The benchmarks: `bench attention` (attention.py: one attention call, prefill, against exact), `bench
decode` (decode.py: one decode step against a cache), `bench generate` (generate.py: a whole model's
greedy generation, unpatched vs patched), and what they share (common.py: timing, errors, tables, plots)."""
