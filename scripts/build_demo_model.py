#!/usr/bin/env python
"""Build longpatch's offline demo model: a small Llama trained on the CPU on Python's own stdlib.

Why: no hub is reachable offline and random weights have nearly uniform attention, so they cannot
show what an approximate attention costs. Source code has real long-range structure (identifiers
defined far above their use), so a small model trained on it learns to use a long context.

Steps (deterministic given --seed and the Python version whose stdlib is read):
1. collect the stdlib's *.py files; hold out ~6% of them (by a hash of the relative path);
2. train a byte-level BPE tokenizer (tokenizers) on the training files;
3. train a LlamaForCausalLM (head_dim 64, 4 query heads sharing 2 KV heads, RoPE) in two phases:
   1024-token windows, then 4096-token windows so the model learns to use a long context;
4. write safetensors + tokenizer + model card to --out, and the held-out evaluation set
   (LongBench record format) beside it.

    python scripts/build_demo_model.py --out longpatch/assets/demo   # ~1 h on 2 CPU cores
"""
from __future__ import annotations

import argparse
import hashlib
import math
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"


def stdlib_files() -> tuple[list[Path], list[Path], Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    held, train = [], []
    for p in files:
        h = int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest()[:8], 16)
        (held if h % 16 == 0 else train).append(p)
    return train, held, root


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(p) for p in files), trainer=trainer)
    # model_max_length only drives a warning when whole source files (longer than the model's 8192
    # positions) are tokenized before truncation, as the evaluation does: set it out of the way.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   model_max_length=1 << 30)
    fast.save_pretrained(out)
    return fast


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """All training files in path order (neighbouring files are related), EOS between files."""
    ids: list[int] = []
    for p in files:
        ids.extend(tokenizer(read(p))["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def make_model(vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                      rope_theta=10000.0, tie_word_embeddings=True, attn_implementation="sdpa",
                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def batches(stream: torch.Tensor, ctx: int, batch: int, steps: int, gen: torch.Generator):
    hi = len(stream) - ctx - 1
    for _ in range(steps):
        starts = torch.randint(0, hi, (batch,), generator=gen)
        yield torch.stack([stream[s:s + ctx + 1] for s in starts.tolist()])


def lm_loss(model, chunk: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of chunk [b, ctx+1] (inputs chunk[:, :-1], targets chunk[:, 1:])."""
    logits = model(chunk[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="longpatch/assets/demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--phase1", type=int, default=900, help="steps of 4 x 1024 tokens")
    ap.add_argument("--phase2", type=int, default=300, help="steps of 1 x 4096 tokens")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg: str):
        print(msg, flush=True)
        log_lines.append(msg)

    t_start = time.time()
    train_files, held_files, root = stdlib_files()
    log(f"stdlib {root}: {len(train_files)} training files, {len(held_files)} held out")
    tok = train_tokenizer(train_files, args.vocab, out)
    stream = token_stream(tok, train_files)
    log(f"tokenizer: vocab {len(tok)}; training stream {len(stream):,} tokens")

    model = make_model(len(tok), args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters")
    gen = torch.Generator().manual_seed(args.seed)
    phases = [(1024, 4, args.phase1), (4096, 1, args.phase2)]
    total = sum(p[2] for p in phases)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    model.train()
    step, t0, curve, seen, ema = 0, time.time(), [], 0, None
    for ctx, bsz, steps in phases:
        for chunk in batches(stream, ctx, bsz, steps, gen):
            loss = lm_loss(model, chunk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            seen += chunk[:, :-1].numel()
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            if step % 25 == 0 or step == total:
                el = time.time() - t0
                curve.append({"step": step, "ctx": ctx, "loss": round(ema, 4), "tokens": seen, "seconds": round(el, 1)})
                log(f"step {step}/{total} ctx {ctx} loss {ema:.3f} tokens {seen:,} {seen / el:.0f} tok/s")
    model.eval()
    held_loss = heldout_loss(model, tok, held_files)
    log(f"held-out loss {held_loss:.4f} (4096-token windows of held-out files)")
    model.save_pretrained(out, safe_serialization=True)
    from longpatch.demo import eval_documents, long_context_report, write_eval_set, write_model_card
    n_docs = write_eval_set(tok, held_files, root, out)
    long_ctx = long_context_report(model, tok, eval_documents(path=out))
    log(f"long context: {long_ctx}")
    write_model_card(out, {
        "python": platform.python_version(), "seed": args.seed, "params": n_params, "vocab": len(tok),
        "train_files": len(train_files), "heldout_files": len(held_files), "train_tokens_seen": seen,
        "stream_tokens": len(stream), "minutes": round((time.time() - t_start) / 60, 1),
        "heldout_loss": round(held_loss, 4), "eval_docs": n_docs, "curve": curve, "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(), "long_context": long_ctx,
    })
    log(f"done in {(time.time() - t_start) / 60:.1f} min; wrote {out}")


@torch.no_grad()
def heldout_loss(model, tok, files, ctx: int = 4096, max_windows: int = 8) -> float:
    stream = token_stream(tok, files)
    losses = []
    for i in range(min(max_windows, (len(stream) - 1) // ctx)):
        losses.append(lm_loss(model, stream[i * ctx:(i + 1) * ctx + 1].unsqueeze(0)).item())
    return sum(losses) / len(losses)


if __name__ == "__main__":
    sys.exit(main())
