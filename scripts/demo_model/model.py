"""The demo model: a small LlamaForCausalLM (recipe.ARCHITECTURE) with RoPE, possibly YaRN-scaled, and the
RoPE settings it ships with (`serve_config`, written by `save_served`)."""
from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch

from .recipe import ARCHITECTURE


def parse_rope_scaling(spec: str) -> dict:
    """--rope-scaling: 'none' -> {}, 'yarn:F:N' -> the YaRN entries of config.json's rope_parameters."""
    if spec == "none":
        return {}
    kind, _, rest = spec.partition(":")
    factor, _, original = rest.partition(":")
    try:
        f, n = float(factor), int(original)
    except ValueError:
        f = n = 0
    if kind != "yarn" or not f >= 1 or n < 1:
        raise SystemExit(f"--rope-scaling: got {spec!r}; allowed: 'none' or 'yarn:FACTOR:ORIGINAL_POSITIONS' "
                         "(FACTOR >= 1, positions a positive int)")
    return {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": n}


def make_model(vocab_size: int, seed: int, rope_theta: float, rope_scaling: str = "none"):
    """rope_scaling 'yarn:F:N': YaRN with factor F over N original positions, recorded in config.json so
    plain transformers loads it. YaRN stretches only the RoPE dimensions whose wavelength exceeds the
    trained length, so the rotations a model trained at N tokens sees at F*N are ones it has seen,
    while the fast dimensions that resolve neighbouring tokens stay as trained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "default", "rope_theta": rope_theta, **parse_rope_scaling(rope_scaling)}
    cfg = LlamaConfig(vocab_size=vocab_size, **asdict(ARCHITECTURE), rope_parameters=rope, tie_word_embeddings=True,
                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def serve_config(config, factor: float) -> tuple[dict, int]:
    """The RoPE settings to ship for a model trained with YaRN factor f over N positions: the same N with
    `factor` (> f), and the attention factor (cos/sin scale) kept at the trained 0.1*ln(f) + 1.

    Why: trained with factor f at up to N tokens, the slowest RoPE dimensions only ever rotated up to
    N/f positions' worth. Served as trained, a 4N-token prompt turns them 4x further than ever seen and
    retrieval beyond N collapses (measured on v2: prose needles 100% at 8k, 20% at 16k, 0% at 32k).
    Served with factor 4f they turn at 4N exactly as far as at N in training, while the fast
    dimensions (wavelength < N/32, never interpolated by YaRN) stay as trained; keeping the trained
    attention factor keeps the logit scale the model learned (YaRN's default for 4f sharpens it, which
    measured worse: 60% vs 80% at 32k). Shorter prompts see only slow rotations it has also seen."""
    rope = dict(config.rope_parameters)
    if rope.get("rope_type") != "yarn":
        raise SystemExit(f"--serve-rope-factor {factor:g}: needs a model trained with --rope-scaling yarn:F:N, "
                         f"this one has rope_type {rope.get('rope_type')!r}")
    trained = float(rope["factor"])
    if factor < trained:
        raise SystemExit(f"--serve-rope-factor {factor:g}: must be >= the trained YaRN factor {trained:g} (or 0)")
    rope.update(factor=float(factor), attention_factor=rope.get("attention_factor") or 0.1 * math.log(trained) + 1)
    # factor * N positions, as transformers expects of YaRN (it warns on every load otherwise); the
    # slowest dimensions turn at (factor / f) * N tokens as far as at N in training: 32k for 16 / 4.
    return rope, int(factor * rope["original_max_position_embeddings"])


def save_served(model, tok, out: Path, factor: float, log):
    """Write model and tokenizer to `out` with the RoPE settings it ships with (serve_config; factor 0: as
    trained) and return the model reloaded from there. One path for `report.finish` and `--export`, so that a
    probed checkpoint is the model as it would ship."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if not factor:
        return model
    from transformers import AutoModelForCausalLM
    rope, max_pos = serve_config(model.config, factor)
    model = AutoModelForCausalLM.from_pretrained(out, rope_parameters=rope, max_position_embeddings=max_pos).eval()
    model.config.save_pretrained(out)  # the weights just saved are the same; only config.json changes
    log(f"served RoPE: {rope}, {max_pos} positions")
    return model
