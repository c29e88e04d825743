"""Training the demo model: a build's setup from its checkpoint directory (`open_build`: tokenizer, token
streams, model, optimizer, resumed state), the training loop (`train`) with its checkpoints and
retrieval probes, and the losses.

Each step draws its batch from a generator seeded by (seed, step) and sets its learning rate from the
step alone, so a build resumed from a checkpoint is the same build as one run through."""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .data import Mixer, batch_tensors, stdlib_files, token_stream, train_tokenizer
from .model import make_model, parse_rope_scaling, serve_config
from .recipe import OPTIMIZATION, Phase, lr_factor, parse_recipe


def losses(model, ids: torch.Tensor, answer_mask: torch.Tensor, lm_rows: torch.Tensor):
    """(mean next-token NLL over the LM rows' tokens or 0, mean NLL over answer tokens or 0)."""
    hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state
    m = answer_mask[:, 1:]
    # the vocabulary projection is a large share of this small model's compute: only where scored
    need = m | lm_rows[:, None]
    nll = hidden.new_zeros(need.shape, dtype=torch.float32)
    nll[need] = F.cross_entropy(model.lm_head(hidden[need]).float(), ids[:, 1:][need], reduction="none")
    ans = nll[m].mean() if m.any() else nll.new_zeros(())
    lm = nll[lm_rows].mean() if lm_rows.any() else nll.new_zeros(())
    return lm, ans


COPY_KINDS = ("repeat", "synth", "ngram")  # scored per copied token; 'ngram': random tokens over 256 ids


@torch.no_grad()
def retrieval_accuracy(model, mixer: Mixer, n: int, kind: str, trials: int, seed: int = 1234) -> float:
    """Fraction of samples (one needle, one question) whose answer tokens are all argmax-correct."""
    rng = random.Random(seed)
    ok = 0
    for t in range(trials):
        if kind in COPY_KINDS:
            s = (mixer.repeat(rng, n) if kind == "repeat" else
                 mixer.synthetic(rng, n, "random", alphabet=256 if kind == "ngram" else 0))
        else:
            s = mixer.needles(rng, n, kind=kind, depth=(t + 0.5) / trials,
                              value=str(rng.randrange(10000, 100000)), name="PASSKEY" if kind == "code" else "pass key")
        ids, mask, _ = batch_tensors([s])
        pred = model(ids[:, :-1]).logits.argmax(-1)
        m = mask[:, 1:]
        hits = pred[m] == ids[:, 1:][m]
        # needles: all answer tokens right; copies: the fraction of copied tokens right
        ok += bool(hits.all()) if kind not in COPY_KINDS else hits.float().mean().item()
    return ok / trials


@dataclass
class Build:
    """A build as its modes share it: the command line, the checkpoint directory and its log, the data,
    and the model and optimizer at the checkpoint's step."""
    args: argparse.Namespace  # rope_theta and rope_scaling as the checkpoint has them, once resumed
    ckpt: Path
    log: Callable[[str], None]  # to stdout and ckpt/log.txt
    t_start: float
    root: Path  # the stdlib
    train_files: list[Path]
    held_files: list[Path]
    tok: Any
    stream: torch.Tensor  # the training files' tokens
    held_stream: torch.Tensor
    model: Any
    opt: torch.optim.Optimizer
    stages: list[list[Phase]]
    state: dict  # step, curve, evals, seconds, tokens: what a checkpoint carries on
    n_params: int

    @property
    def phases(self) -> list[Phase]:
        return [p for stage in self.stages for p in stage]


def open_log(ckpt: Path) -> Callable[[str], None]:
    logf = open(ckpt / "log.txt", "a")

    def log(msg: str):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()
    return log


def open_build(args: argparse.Namespace) -> Build:
    """Check the options (they fail before any work), then set up from --ckpt: the tokenizer and token
    streams (made and cached there the first time), the model and optimizer, and the state of the
    checkpoint if there is one (whose architecture overrides the command line's)."""
    parse_recipe(args.phases)  # bad options fail now, before the tokenizer and the data stream
    parse_rope_scaling(args.rope_scaling)
    ckpt = Path(args.ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    log = open_log(ckpt)

    t_start = time.time()
    train_files, held_files, root = stdlib_files()
    log(f"stdlib {root}: {len(train_files)} training files, {len(held_files)} held out")
    tok_dir = ckpt / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file() and (ckpt / "stream.pt").is_file():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tok_dir)
        stream, held_stream = torch.load(ckpt / "stream.pt", weights_only=True)  # two tensors
    else:
        tok = train_tokenizer(train_files, args.vocab, tok_dir)
        stream, held_stream = token_stream(tok, train_files), token_stream(tok, held_files)
        torch.save((stream, held_stream), ckpt / "stream.pt")
    log(f"tokenizer: vocab {len(tok)}; training stream {len(stream):,} tokens, held-out {len(held_stream):,}")

    saved = load_checkpoint(ckpt / "state.pt")
    if saved is not None:  # the architecture is the checkpoint's, whatever this command line says
        args.rope_theta, args.rope_scaling = saved["args"]["rope_theta"], saved["args"].get("rope_scaling", "none")
    model = make_model(len(tok), args.seed, args.rope_theta, args.rope_scaling)
    if args.serve_rope_factor:  # fail now, not after hours of training
        serve_config(model.config, args.serve_rope_factor)
    n_params = sum(p.numel() for p in model.parameters())
    stages = parse_recipe(args.phases)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=OPTIMIZATION.betas,
                            weight_decay=OPTIMIZATION.weight_decay)
    state = {"step": 0, "curve": [], "evals": [], "seconds": 0.0, "tokens": 0}
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resumed at step {state['step']} ({state['seconds'] / 60:.1f} min of training so far)")
    build = Build(args=args, ckpt=ckpt, log=log, t_start=t_start, root=root, train_files=train_files,
                  held_files=held_files, tok=tok, stream=stream, held_stream=held_stream, model=model, opt=opt,
                  stages=stages, state=state, n_params=n_params)
    log(f"model: {n_params / 1e6:.2f}M parameters, rope_theta {args.rope_theta:g}, rope scaling "
        f"{args.rope_scaling}; phases {[tuple(p) for p in build.phases]}")
    return build


def save_checkpoint(build: Build) -> None:
    """Model, optimizer, state and command line to ckpt/state.pt (written whole, then renamed). Only tensors,
    numbers, strings, None and plain containers, so that load_checkpoint reads it with weights_only=True."""
    tmp = build.ckpt / "state.pt.tmp"
    plain = (str, int, float, bool, type(None))
    args = {k: v if isinstance(v, plain) else str(v) for k, v in vars(build.args).items()}  # a Path: its text
    torch.save({"model": build.model.state_dict(), "opt": build.opt.state_dict(), "state": build.state,
                "args": args}, tmp)
    tmp.replace(build.ckpt / "state.pt")


def load_checkpoint(path: Path) -> dict | None:
    """What save_checkpoint wrote to `path` (None: no checkpoint yet), read with torch's safe loader
    (weights_only=True): it builds tensors and plain values only, so a state.pt from elsewhere cannot run the
    code a pickle may name. One that holds anything else is refused in one line (SystemExit)."""
    import pickle

    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((line.split(":", 1)[1].strip() for line in str(e).splitlines()
                       if line.strip().startswith("WeightsUnpickler error:")), "not tensors and plain values")
        raise SystemExit(f"--ckpt: {path} is not a checkpoint this script wrote (torch's safe loader refuses it: "
                         f"{detail.split('. Please use', 1)[0]}); move it away to start the build over") from None


def evaluate(build: Build, held_mixer: Mixer) -> None:
    """The retrieval probes on held-out samples at each --eval-lengths, appended to the state's evals."""
    model = build.model
    model.eval()
    row = {"step": build.state["step"]}
    for n in [int(x) for x in build.args.eval_lengths.split(",")]:
        for kind in ("code", "prose") + COPY_KINDS:
            row[f"{kind}@{n}"] = round(retrieval_accuracy(model, held_mixer, n, kind, trials=8), 3)
    model.train()
    build.state["evals"].append(row)
    build.log(f"eval {row}")


def train(build: Build) -> bool:
    """Train from the checkpoint's step through the recipe, probing every --eval-every steps and writing a
    checkpoint every --ckpt-minutes and at the end. True when the recipe is done (the model is left in
    eval mode), False when --stop-after stopped it first."""
    args, model, opt, state, stages, log = build.args, build.model, build.opt, build.state, build.stages, build.log
    mixer = Mixer(build.tok, build.stream, args.synth_vocab, args.synth_span)
    held_mixer = Mixer(build.tok, build.held_stream, args.synth_vocab, args.synth_span)
    phases = build.phases
    total = sum(p.steps for p in phases)
    model.train()
    last_ckpt, ema, ema_a = time.time(), None, None
    bounds = []
    acc = 0
    for n, b, steps, mix in phases:
        bounds.append((acc, acc + steps, n, b, mix))
        acc += steps
    while state["step"] < total:
        step = state["step"]
        n, b, mix = next((n, b, mix) for lo, hi, n, b, mix in bounds if lo <= step < hi)
        rng = random.Random(args.seed * OPTIMIZATION.batch_seed_stride + step)
        ids, mask, lm_rows = batch_tensors([mixer.draw(rng, n, mix) for _ in range(b)])
        t0 = time.time()
        lm, ans = losses(model, ids, mask, lm_rows)
        loss = lm + ans
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZATION.grad_clip)
        for group in opt.param_groups:  # set from the step alone, so a resumed build is the same build
            group["lr"] = args.lr * lr_factor(step, stages)
        opt.step()
        state["seconds"] += time.time() - t0
        state["tokens"] += ids[:, :-1].numel()
        state["step"] = step = step + 1
        ema = lm.item() if ema is None else 0.95 * ema + 0.05 * lm.item()
        ema_a = ans.item() if ema_a is None else 0.95 * ema_a + 0.05 * ans.item()
        if step % 25 == 0 or step == total:
            state["curve"].append({"step": step, "ctx": n, "loss": round(ema, 4), "answer_loss": round(ema_a, 4),
                                   "tokens": state["tokens"], "seconds": round(state["seconds"], 1)})
            log(f"step {step}/{total} ctx {n}x{b} loss {ema:.3f} answer {ema_a:.3f} "
                f"{state['tokens'] / max(state['seconds'], 1e-9):.0f} tok/s {state['seconds'] / 60:.1f} min")
        if step % args.eval_every == 0 or step == total:
            evaluate(build, held_mixer)
        if time.time() - last_ckpt > args.ckpt_minutes * 60 or step == total or step == args.stop_after:
            save_checkpoint(build)
            last_ckpt = time.time()
        if step == args.stop_after:
            log(f"stopped after step {step} (checkpoint in {build.ckpt})")
            return False
    model.eval()
    return True
