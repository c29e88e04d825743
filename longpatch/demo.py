"""Old import path of the demo helpers, kept only so that a demo-model build started before the split
(scripts/build_demo_model.py imports from here when it finishes) still finishes. Nothing in longpatch
imports this module; import from `longpatch.assets` (paths, eval documents) and `longpatch.eval.demo`
(long_context_report, demo_configs, run_demo) instead."""
from .assets import EVAL_MIN_TOKENS, EVAL_SUBSET, demo_eval_path, demo_model_path, eval_documents
from .eval.demo import demo_configs, long_context_report, run_demo

__all__ = ["EVAL_MIN_TOKENS", "EVAL_SUBSET", "demo_configs", "demo_eval_path", "demo_model_path", "eval_documents",
           "long_context_report", "run_demo"]
