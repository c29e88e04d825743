"""Evaluation: one subpackage per evaluation over one shared runner.

- `ppl/`: LongBench perplexity, the HyperAttention paper's protocol (`longpatch eval ppl`,
  `longpatch.eval.perplexity(...)`);
- `needle/`: needle-in-a-haystack retrieval (`longpatch eval needle`, `longpatch.eval.needle.needle(...)`);
- `longbench/`: LongBench task scores and LongBench's data (`longpatch eval longbench`,
  `longpatch.eval.longbench.longbench(...)`; `longbench_score` is LongBench's scorer);
- the runner they share: `sweep.py` (RunSpec, the layer-count sweep, resolving and loading once, the
  patch-run-unpatch loop), `launch.py` and `worker.py` (processes), `records.py` (records*.jsonl,
  plan.json, resume); `demo.py` is the offline demo job.
"""
from .longbench.data import CATEGORIES, SUBSETS, DataError, load_longbench
from .longbench.metrics import longbench_score
from .ppl.report import summarize
from .ppl.run import perplexity
from .sweep import RunSpec

__all__ = ["CATEGORIES", "SUBSETS", "DataError", "RunSpec", "load_longbench", "longbench_score", "perplexity",
           "summarize"]
