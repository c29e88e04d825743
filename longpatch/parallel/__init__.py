"""Sequence parallelism on torch.distributed (docs/distributed.md).

``ulysses_attention``: the op on this rank's slice of q/k/v; ``sequence_parallel``: a whole model,
each rank holding a contiguous slice of the sequence. Prefill / scoring only.
"""
from .model import SequenceParallel, sequence_parallel
from .ulysses import head_plan, kv_heads_for, layout, ulysses, ulysses_attention

__all__ = ["SequenceParallel", "head_plan", "kv_heads_for", "layout", "sequence_parallel", "ulysses",
           "ulysses_attention"]
