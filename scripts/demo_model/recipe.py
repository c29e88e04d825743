"""The demo model's recipe: its training stages and phases (`STAGES`, `--phases`), the learning-rate
schedule over them, and the fixed hyperparameters of the model and the optimizer."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from .data import MIX_SHARES


@dataclass(frozen=True)
class Architecture:
    """The LlamaForCausalLM's shape (model.make_model; vocabulary, RoPE and seed come from the command line)."""
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 32768


@dataclass(frozen=True)
class Optimization:
    """AdamW's settings and each step's (train.train); the peak learning rate is --lr, scaled by lr_factor."""
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0          # max gradient norm
    warmup_steps: int = 50          # each stage's linear warm-up (lr_factor)
    batch_seed_stride: int = 1_000_003  # step s draws its batch from Random(seed * stride + s)


ARCHITECTURE = Architecture()
OPTIMIZATION = Optimization()


class Phase(NamedTuple):
    """LENxBATCH:STEPS[:MIX] of --phases: `steps` steps of `batch` samples of `length` + 1 tokens of `mix`."""
    length: int
    batch: int
    steps: int
    mix: str


MIXES = ("synth", "synthr", "synthp", "ngram", *MIX_SHARES)
# The recipe of the shipped model (v3): five stages, each a continuation of the one before (a stage
# appended to a recipe leaves the earlier stages' model unchanged, see lr_factor), so each was tried
# from the previous stage's checkpoint and kept because it measured better (docs/demo.md).
STAGES = [
    # 1 (model v2). Random-offset copying (synthr) first, on sequences that start at 32 tokens and
    # double: the time an induction head takes to form grows steeply with the context length (at 128
    # tokens it did not form in 1000 steps; from 32 tokens it forms at step ~650), and once formed it
    # stretches to longer inputs in a few steps per length. Then the training mix (code + needles +
    # repeats) at growing lengths, trained with YaRN (factor 4 over 8192 positions).
    "32x128:400:synthr,64x64:200:synthr,128x32:200:synthr,512x8:200:synthr,2048x2:150:synthr,"
    "8192x1:60:synthr,1024x8:700,4096x2:300,8192x1:100",
    # 2. Copying by a match on several preceding tokens (n-gram copying over small alphabets), as code
    # needs: v2 copied random tokens at 90% but held-out code spans at ~50%.
    "256x16:300:ngram,1024x4:300:mixn,4096x2:250:mixn,8192x1:100:mixn",
    # 3. Weighted to code needles: their first value token is the one copy no n-gram match finds.
    "2048x4:150:mixc,4096x2:150:mixc,8192x1:80:mixc",
    # 4. Multi-query recall (dozens of first-value-token targets per sample), out to 16k tokens.
    "1024x8:250:mixk,4096x2:200:mixk,8192x1:100:mixk,16384x1:60:mixk",
    # 5. Longer prompts: 16k and 32k (inside what YaRN factor 4 over 8192 positions is set up for).
    "4096x2:100:mixk,16384x1:100:mixk,32768x1:20:mixk",
]
RECIPE = "|".join(STAGES)


def parse_phases(spec: str) -> list[Phase]:
    """'128x32:600:synth,1024x8:300' -> [(128, 32, 600, 'synth'), (1024, 8, 300, 'mix')]
    (length x batch : steps [: mix]; mix 'synth': random-token copying only (--synth-span), 'synthr': the
    same with a random span at a random offset, 'synthp': a random block of random length repeated,
    'mix': the training mix)."""
    out = []
    for part in spec.split(","):
        try:
            shape, steps, *mix = part.split(":")
            n, b = shape.split("x")
            phase = Phase(int(n), int(b), int(steps), mix[0] if mix else "mix")
        except ValueError:
            phase = None
        if phase is None or len(mix) > 1 or min(phase.length, phase.batch, phase.steps) < 1 or phase.mix not in MIXES:
            raise SystemExit(f"--phases: bad phase {part!r}; allowed: LENxBATCH:STEPS[:MIX] with positive "
                             f"integers and MIX one of {', '.join(MIXES)}")
        out.append(phase)
    return out


def parse_recipe(spec: str) -> list[list[Phase]]:
    """'A|B': stages of phases, each with its own learning-rate warm-up and decay (see lr_factor)."""
    return [parse_phases(part) for part in spec.split("|")]


def lr_factor(step: int, stages: list[list[Phase]], warm: int = OPTIMIZATION.warmup_steps) -> float:
    """The learning rate's multiplier at `step`: within each stage, linear warm-up over `warm` steps,
    constant (induction forms at a steady rate), then cosine down to 0.1x over the stage's last 15%.
    A stage appended to a recipe leaves the earlier stages' schedule, hence their model, unchanged."""
    start = 0
    for i, stage in enumerate(stages):
        length = sum(p.steps for p in stage)
        if step < start + length or i == len(stages) - 1:
            s, decay_from = step - start, int(0.85 * length)
            tail = min(1.0, max(0.0, (s - decay_from) / max(1, length - decay_from)))
            return min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))
        start += length
    raise ValueError("no stages")
