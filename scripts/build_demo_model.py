#!/usr/bin/env python
"""Build longpatch's offline demo model (v2): a small Llama trained on the CPU on Python's own stdlib
that also retrieves from far back in its context.

Why: no hub is reachable offline, and a model that ignores distant tokens cannot show what an
approximate attention loses. Source code has long-range structure, but a 5M-parameter model trained
on a few million tokens of it never forms copying (induction) heads. So the code stream is mixed
with samples that reward reading far back (the retrieval mix, `Mixer.draw` and `MIX_SHARES` below):

- code needles: `NAME = 71432` lines planted at random line boundaries of a code window (several
  names per window), asserted at the end (`assert NAME == 71432`);
- prose needles: "The pass key is 71432. Remember it. ..." planted the same way, asked at the end;
- repeated spans: a span of the window reappears later (the classic induction task, on real code).
- random-token copying: random tokens with one span repeated at a random offset, the task on which
  copying (induction) heads form; it comes first, on short sequences (see RECIPE);
- n-gram copying: the same over small alphabets, where only a match on several preceding tokens
  finds the copy's source, as in code, whose tokens recur (`Mixer.ngram`);
- multi-query recall: dozens of code facts per window, all asserted at the end (`Mixer.recall`).
Every code token carries the language-model loss; the answer tokens (the value after `==` / "is", and
the second copy of a span) also enter a second, separately averaged loss, so the few tokens that
need retrieval are not drowned by the many that do not. Lengths grow in phases (`--phases`), grouped
in stages ('A|B') that each warm the learning rate up and decay it, so a stage appended to a recipe
continues its checkpoint exactly as a build from scratch would.

Steps (deterministic given --seed and the Python version whose stdlib is read; each training step
draws its batch from a generator seeded by (seed, step), so a resumed build is the same build):
1. collect the stdlib's *.py files; hold out ~6% of them (by a hash of the relative path);
2. train a byte-level BPE tokenizer (tokenizers) on the training files;
3. train a LlamaForCausalLM (head_dim 64, 4 query heads sharing 2 KV heads, RoPE) through --phases;
   a resumable checkpoint is written to --ckpt every --ckpt-minutes;
4. write safetensors + tokenizer + model card to --out, and the held-out evaluation set
   (LongBench record format) beside it; measure held-out loss, the long-context report and the
   repeated-segment probe;
5. `--report`: measure needle retrieval with `longpatch eval needle` (exact attention, 4k-32k) and add
   it to the model card.

    python scripts/build_demo_model.py --out longpatch/assets/demo
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"
# Names for code needles. Fixed list, so samples are reproducible; PASSKEY is the evaluation's default.
NAME_PARTS = ["PASS", "KEY", "SECRET", "MAX", "MIN", "PORT", "CODE", "TOKEN", "LIMIT", "USER", "BASE",
              "SIZE", "COUNT", "RETRY", "TIMEOUT", "MAGIC", "SEED", "LEVEL", "OFFSET", "INDEX", "VALUE",
              "DEFAULT", "BUFFER", "HOST", "PID", "UID", "ROOT", "FLAG", "MODE", "RATE", "STEP", "ID"]
# Alphabets of the n-gram copying task: 64 ids make most 2-grams unique in 1k tokens, 3-grams in 32k.
NGRAM_ALPHABETS = (64, 256, 1024, 0)
PROSE_SUBJECTS = ["pass key", "secret number", "magic number", "access code", "special value", "lucky number"]


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
    # model_max_length only drives a warning when whole source files are tokenized before
    # truncation, as the evaluation does: set it out of the way.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   model_max_length=1 << 30)
    fast.save_pretrained(out)
    return fast


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files in path order (neighbouring files are related), EOS between files."""
    ids: list[int] = []
    for p in files:
        ids.extend(tokenizer(read(p))["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


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
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                      rope_parameters=rope, tie_word_embeddings=True, attn_implementation="sdpa",
                      bos_token_id=0, eos_token_id=0)
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


# ---------------------------------------------------------------------------------------------
# The training mix


@dataclass
class Sample:
    ids: list[int]        # L + 1 tokens
    answers: list[int]    # positions (into ids) of tokens that need retrieval; their targets are ids[pos]
    lm: bool = True       # whether every token carries the language-model loss (not for random tokens)


class Mixer:
    """Draws training (or evaluation) samples from a token stream; all randomness from `rng`."""

    def __init__(self, tokenizer, stream: torch.Tensor, synth_vocab: int = 0, synth_span: str = "half"):
        self.tok = tokenizer
        self.stream = stream
        # random-token copying draws from ids 256..256+synth_vocab (0: the whole vocabulary); a
        # smaller alphabet makes every token frequent, so the matching is learned from more examples
        self.synth_hi = 256 + synth_vocab if synth_vocab else len(tokenizer)
        self.synth_span = synth_span  # 'half': the second half repeats the first (the classic task)

    def enc(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def window(self, rng: random.Random, n: int) -> list[int]:
        s = rng.randrange(0, len(self.stream) - n - 1)
        return self.stream[s:s + n].tolist()

    def filler_lines(self, rng: random.Random, n_tokens: int) -> list[str]:
        """About n_tokens of code, cut at line boundaries (first and last partial lines dropped)."""
        text = self.tok.decode(self.window(rng, n_tokens + 64))
        lines = text.split("\n")
        return lines[1:-1] if len(lines) > 2 else lines

    def needles(self, rng: random.Random, n: int, *, kind: str, n_needles: int = 1, ask_all: bool = False,
                depth: float | None = None, name: str | None = None, value: str | None = None,
                digits: tuple[int, int] = (1, 6), prefix: str = "") -> Sample:
        """Filler code with planted needles, and questions about some of them at the end (about all of
        them, in random order, with `ask_all`). Values have `digits` digits (a range), each starting
        with `prefix`."""
        facts = []
        used = set()
        for i in range(n_needles):
            if kind == "code":
                nm = name if (i == 0 and name) else _random_name(rng, used)
            else:
                nm = (name if (i == 0 and name) else rng.choice([s for s in PROSE_SUBJECTS if s not in used]))
            used.add(nm)
            d = rng.randint(*digits) - len(prefix)
            rest = str(rng.randrange(0, 10 ** d)).zfill(d) if prefix else str(rng.randrange(10 ** (d - 1), 10 ** d))
            val = value if (i == 0 and value) else prefix + rest
            facts.append((nm, val))
        if kind == "code":
            needle = [f"{nm} = {val}" for nm, val in facts]
            questions = [(f"assert {nm} ==", f" {val}", "\n") for nm, val in facts]
        else:
            needle = [f"The {nm} is {val}. Remember it. {val} is the {nm}." for nm, val in facts]
            questions = [(f"What is the {nm}? The {nm} is", f" {val}", ".\n") for nm, val in facts]
        if ask_all:
            asked = rng.sample(questions, len(questions))
        else:
            asked = [questions[0]] + ([q for q in questions[1:] if rng.random() < 0.5])
        q_ids = [(self.enc(a), self.enc(b), self.enc(c)) for a, b, c in asked]
        budget = n + 1 - sum(len(a) + len(b) + len(c) for a, b, c in q_ids) - sum(len(self.enc(x)) + 1 for x in needle)
        lines = self.filler_lines(rng, max(budget, 16))
        # plant each needle at its own depth (the first at `depth` when given), at a line boundary
        for j, text in enumerate(needle):
            d = depth if (j == 0 and depth is not None) else rng.random()
            lines.insert(round(d * len(lines)), text)
        body = self.enc("\n".join(lines) + "\n")
        ids, answers = list(body), []
        for a, b, c in q_ids:
            ids += a
            answers += range(len(ids), len(ids) + len(b))
            ids += b + c
        return _fit(ids, answers, n + 1)

    def repeat(self, rng: random.Random, n: int) -> Sample:
        """A code window in which one span reappears later (the second copy is the answer)."""
        ids = self.window(rng, n + 1)
        span = rng.randint(8, max(8, min(n // 3, 2048)))
        src = rng.randrange(0, n + 1 - 2 * span)
        dst = rng.randrange(src + span, n + 1 - span + 1)
        ids[dst:dst + span] = ids[src:src + span]
        return Sample(ids, list(range(dst + 1, dst + span)))

    def synthetic(self, rng: random.Random, n: int, span_mode: str | None = None, alphabet: int = 0) -> Sample:
        """Random tokens with one span repeated later: the task on which induction heads form fastest
        (nothing but copying can predict the second copy). Only the copy is scored. `alphabet` > 0
        draws from that many token ids: each one then recurs all over the sequence, so only a match on
        several preceding tokens finds where to copy from (see `ngram`)."""
        hi = 256 + alphabet if alphabet else self.synth_hi
        ids = [rng.randrange(256, hi) for _ in range(n + 1)]
        mode = span_mode or self.synth_span
        if mode == "periodic":
            # one random block repeated to the end; its length differs per sample, so only
            # content matching (not a fixed distance) predicts the repeats
            period = rng.randint(8, max(8, (n + 1) // 2))
            ids = [ids[i % period] for i in range(n + 1)]
            return Sample(ids, list(range(period + 1, n + 1)), lm=False)
        if mode == "half":
            span, src, dst = (n + 1) // 2, 0, (n + 1) // 2
        else:
            span = rng.randint(4, (n + 1) // 2)
            src = rng.randrange(0, n + 2 - 2 * span)
            dst = rng.randrange(src + span, n + 2 - span)
        ids[dst:dst + span] = ids[src:src + span]
        return Sample(ids, list(range(dst + 1, dst + span)), lm=False)

    def ngram(self, rng: random.Random, n: int) -> Sample:
        """Random-span copying over a small alphabet (64..1024 ids, or the whole vocabulary). Model v2's
        copying matched one preceding token: it copies random tokens (each one rare) 90% right at 2048
        tokens, but over 256 ids only 6%, and held-out code (whose tokens recur) about half right. A
        span reappearing in code is found by its preceding n-gram; this task rewards exactly that."""
        return self.synthetic(rng, n, "random", alphabet=rng.choice(NGRAM_ALPHABETS))

    def recall(self, rng: random.Random, n: int) -> Sample:
        """Many code facts (one per 128 tokens, 4 to 32) planted in a window and all asserted at the end,
        in random order. A code needle teaches the one token no n-gram match finds: the value's first
        token, which follows `NAME =` in the needle but `NAME ==` in the question, so only a match on the
        name two tokens back finds it. One needle gives one such target per sample; this gives dozens,
        each of which must tell its own name from the others (multi-query associative recall)."""
        return self.needles(rng, n, kind="code", n_needles=rng.randint(4, min(32, max(4, n // 128))), ask_all=True)

    def recall_long(self, rng: random.Random, n: int) -> Sample:
        """`recall` with the values of the needle evaluation (4-6 digits, 2-3 tokens), half the time all
        starting with the same digit: after the value's first token, only the name (not that token)
        tells which line to copy on from. The code-needle misses of model v3 are mostly of this kind: the
        first value token right, the next ones copied from another line."""
        prefix = str(rng.randint(1, 9)) if rng.random() < 0.5 else ""
        return self.needles(rng, n, kind="code", n_needles=rng.randint(4, min(32, max(4, n // 128))), ask_all=True,
                            digits=(4, 6), prefix=prefix)

    def task(self, rng: random.Random, n: int, kind: str) -> Sample:
        """One sample of a task: a kind of MIX_SHARES, or a single-task mix of MIXES."""
        if kind == "code":
            return self.needles(rng, n, kind="code", n_needles=rng.randint(1, 4))
        if kind == "prose":
            return self.needles(rng, n, kind="prose", n_needles=rng.randint(1, 3))
        if kind == "repeat":
            return self.repeat(rng, n)
        if kind == "recall":
            return self.recall(rng, n)
        if kind == "recallv":
            return self.recall_long(rng, n)
        if kind == "ngram":
            return self.ngram(rng, n)
        if kind == "synth":
            return self.synthetic(rng, n)
        if kind == "synthr":  # a random span at a random offset: no fixed distance to learn instead of copying
            return self.synthetic(rng, n, "random")
        if kind == "synthp":
            return self.synthetic(rng, n, "periodic")
        return Sample(self.window(rng, n + 1), [])

    def draw(self, rng: random.Random, n: int, mix: str = "mix") -> Sample:
        """A sample of `mix`: one task, or (a mix of MIX_SHARES) a task drawn by its share."""
        if mix in MIX_SHARES:
            r = rng.random()
            mix = next(k for k, upto in MIX_SHARES[mix] if r < upto)
        return self.task(rng, n, mix)


# The training mixes: (kind, cumulative share) in draw order; 'window' is plain code.
MIX_SHARES = {
    "mix": [("code", 0.35), ("prose", 0.55), ("repeat", 0.75), ("synthr", 0.8), ("window", 1.0)],
    # n-gram copying in place of random-token copying (stage 2 of the recipe)
    "mixn": [("code", 0.3), ("prose", 0.45), ("repeat", 0.7), ("ngram", 0.9), ("window", 1.0)],
    # weighted to code needles, whose first value token is the one copy no n-gram match finds (stage 3)
    "mixc": [("code", 0.5), ("prose", 0.7), ("repeat", 0.85), ("ngram", 0.95), ("window", 1.0)],
    # many code facts asked per sample (stage 4): dozens of first-value-token targets per sample
    "mixk": [("recall", 0.35), ("code", 0.5), ("prose", 0.65), ("repeat", 0.8), ("ngram", 0.9), ("window", 1.0)],
    # recall with long values sharing a first digit (stage 6): the value's later tokens by the name
    "mixv": [("recallv", 0.4), ("code", 0.55), ("prose", 0.65), ("repeat", 0.8), ("ngram", 0.9), ("window", 1.0)],
}


def _random_name(rng: random.Random, used: set) -> str:
    while True:
        name = "PASSKEY" if rng.random() < 0.15 else "_".join(rng.choice(NAME_PARTS) for _ in range(rng.randint(1, 3)))
        if name not in used:
            return name


def _fit(ids: list[int], answers: list[int], total: int) -> Sample:
    """Exactly `total` tokens: cut the front (filler) or pad it with a repeat of the filler start."""
    if len(ids) >= total:
        cut = len(ids) - total
        return Sample(ids[cut:], [a - cut for a in answers if a - cut > 0])
    pad = total - len(ids)
    return Sample((ids[:pad] * (pad // max(1, len(ids)) + 1))[:pad] + ids, [a + pad for a in answers])


def batch_tensors(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [b, L+1], answer mask [b, L+1], which rows carry the LM loss [b])."""
    ids = torch.tensor([s.ids for s in samples], dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, s in enumerate(samples):
        mask[i, s.answers] = True
    return ids, mask, torch.tensor([s.lm for s in samples])


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


# ---------------------------------------------------------------------------------------------


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


def parse_phases(spec: str) -> list[tuple[int, int, int, str]]:
    """'128x32:600:synth,1024x8:300' -> [(128, 32, 600, 'synth'), (1024, 8, 300, 'mix')]
    (length x batch : steps [: mix]; mix 'synth': random-token copying only (--synth-span), 'synthr': the
    same with a random span at a random offset, 'synthp': a random block of random length repeated,
    'mix': the training mix)."""
    out = []
    for part in spec.split(","):
        try:
            shape, steps, *mix = part.split(":")
            n, b = shape.split("x")
            phase = (int(n), int(b), int(steps), mix[0] if mix else "mix")
        except ValueError:
            phase = None
        if phase is None or len(mix) > 1 or min(phase[:3]) < 1 or phase[3] not in MIXES:
            raise SystemExit(f"--phases: bad phase {part!r}; allowed: LENxBATCH:STEPS[:MIX] with positive "
                             f"integers and MIX one of {', '.join(MIXES)}")
        out.append(phase)
    return out


def parse_recipe(spec: str) -> list[list[tuple[int, int, int, str]]]:
    """'A|B': stages of phases, each with its own learning-rate warm-up and decay (see lr_factor)."""
    return [parse_phases(part) for part in spec.split("|")]


def lr_factor(step: int, stages: list, warm: int = 50) -> float:
    """The learning rate's multiplier at `step`: within each stage, linear warm-up over `warm` steps,
    constant (induction forms at a steady rate), then cosine down to 0.1x over the stage's last 15%.
    A stage appended to a recipe leaves the earlier stages' schedule, hence their model, unchanged."""
    start = 0
    for i, stage in enumerate(stages):
        length = sum(p[2] for p in stage)
        if step < start + length or i == len(stages) - 1:
            s, decay_from = step - start, int(0.85 * length)
            tail = min(1.0, max(0.0, (s - decay_from) / max(1, length - decay_from)))
            return min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))
        start += length
    raise ValueError("no stages")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="longpatch/assets/demo")
    ap.add_argument("--ckpt", default=str(Path.home() / ".cache" / "longpatch" / "demo_v2"),
                    help="resumable checkpoint directory (outside git)")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--phases", default=RECIPE, help="stages 'A|B' of comma-separated phases")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--rope-scaling", default="yarn:4:8192", help="'none' or 'yarn:FACTOR:ORIGINAL_POSITIONS'")
    ap.add_argument("--serve-rope-factor", type=float, default=16.0,
                    help="YaRN factor written to the shipped config.json (0: as trained); see serve_config()")
    ap.add_argument("--synth-span", default="half", choices=["half", "random", "periodic"],
                    help="copying task: the second half repeats the first, or a random span reappears")
    ap.add_argument("--synth-vocab", type=int, default=0, help="alphabet of the random-token copying task (0: all)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-lengths", default="1024,4096")
    ap.add_argument("--stop-after", type=int, default=0, help="stop (with a checkpoint) after this step; 0 = run all")
    ap.add_argument("--export", default="",
                    help="only write the checkpoint as a loadable model, with the served RoPE, to this directory")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--report", action="store_true",
                    help="only measure needle retrieval of the finished model in --out (exact attention) and "
                         "add it to its training.json and model card")
    ap.add_argument("--report-templates", default="code,passkey")
    ap.add_argument("--report-lengths", default="4096,8192,16384,32768")
    ap.add_argument("--report-depths", default="0.05:0.95:0.1")
    ap.add_argument("--report-trials", type=int, default=4)
    ap.add_argument("--report-work", default="runs/demo_model_needle", help="the needle runs' output (resumable)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out, ckpt = Path(args.out), Path(args.ckpt)
    if args.report:
        from longpatch.errors import LongpatchError

        if not (out / "training.json").is_file():
            raise SystemExit(f"--report: {out} has no training.json; allowed: the directory a finished build wrote")
        try:
            needle_report(out, args.report_templates, args.report_lengths, args.report_depths, args.report_trials,
                          Path(args.report_work), print)
        except LongpatchError as e:  # a bad --report-* option, in eval needle's words
            raise SystemExit(f"--report: {e}") from None
        return 0
    parse_recipe(args.phases)  # bad options fail now, before the tokenizer and the data stream
    parse_rope_scaling(args.rope_scaling)
    ckpt.mkdir(parents=True, exist_ok=True)
    logf = open(ckpt / "log.txt", "a")

    def log(msg: str):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    t_start = time.time()
    train_files, held_files, root = stdlib_files()
    log(f"stdlib {root}: {len(train_files)} training files, {len(held_files)} held out")
    tok_dir = ckpt / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file() and (ckpt / "stream.pt").is_file():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tok_dir)
        stream, held_stream = torch.load(ckpt / "stream.pt")
    else:
        tok = train_tokenizer(train_files, args.vocab, tok_dir)
        stream, held_stream = token_stream(tok, train_files), token_stream(tok, held_files)
        torch.save((stream, held_stream), ckpt / "stream.pt")
    log(f"tokenizer: vocab {len(tok)}; training stream {len(stream):,} tokens, held-out {len(held_stream):,}")
    mixer = Mixer(tok, stream, args.synth_vocab, args.synth_span)
    held_mixer = Mixer(tok, held_stream, args.synth_vocab, args.synth_span)

    saved = torch.load(ckpt / "state.pt", weights_only=False) if (ckpt / "state.pt").is_file() else None
    if saved is not None:  # the architecture is the checkpoint's, whatever this command line says
        args.rope_theta, args.rope_scaling = saved["args"]["rope_theta"], saved["args"].get("rope_scaling", "none")
    model = make_model(len(tok), args.seed, args.rope_theta, args.rope_scaling)
    if args.serve_rope_factor:  # fail now, not after hours of training
        serve_config(model.config, args.serve_rope_factor)
    n_params = sum(p.numel() for p in model.parameters())
    stages = parse_recipe(args.phases)
    phases = [p for stage in stages for p in stage]
    total = sum(p[2] for p in phases)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = {"step": 0, "curve": [], "evals": [], "seconds": 0.0, "tokens": 0}
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resumed at step {state['step']} ({state['seconds'] / 60:.1f} min of training so far)")
    log(f"model: {n_params / 1e6:.2f}M parameters, rope_theta {args.rope_theta:g}, rope scaling "
        f"{args.rope_scaling}; phases {phases}")
    if args.export:  # the checkpoint as it would ship, to probe with `longpatch eval needle --model DIR`
        save_served(model, tok, Path(args.export), args.serve_rope_factor, log)
        log(f"exported the step-{state['step']} checkpoint to {args.export}")
        return 0

    def save_ckpt():
        tmp = ckpt / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state, "args": vars(args)}, tmp)
        tmp.replace(ckpt / "state.pt")

    def evaluate():
        model.eval()
        row = {"step": state["step"]}
        for n in [int(x) for x in args.eval_lengths.split(",")]:
            for kind in ("code", "prose") + COPY_KINDS:
                row[f"{kind}@{n}"] = round(retrieval_accuracy(model, held_mixer, n, kind, trials=8), 3)
        model.train()
        state["evals"].append(row)
        log(f"eval {row}")

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
        rng = random.Random(args.seed * 1_000_003 + step)
        ids, mask, lm_rows = batch_tensors([mixer.draw(rng, n, mix) for _ in range(b)])
        t0 = time.time()
        lm, ans = losses(model, ids, mask, lm_rows)
        loss = lm + ans
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
            evaluate()
        if time.time() - last_ckpt > args.ckpt_minutes * 60 or step == total or step == args.stop_after:
            save_ckpt()
            last_ckpt = time.time()
        if step == args.stop_after:
            log(f"stopped after step {step} (checkpoint in {ckpt})")
            return 0

    model.eval()
    finish(model, tok, held_files, root, out, args, state, n_params, len(stream), len(train_files), t_start, log)
    return 0


def save_served(model, tok, out: Path, factor: float, log):
    """Write model and tokenizer to `out` with the RoPE settings it ships with (serve_config; factor 0: as
    trained) and return the model reloaded from there. One path for `finish` and `--export`, so that a
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


def finish(model, tok, held_files, root, out, args, state, n_params, stream_tokens, n_train_files, t_start, log):
    model = save_served(model, tok, out, args.serve_rope_factor, log)  # every figure below is of the shipped model
    held_loss = heldout_loss(model, tok, held_files)
    log(f"held-out loss {held_loss:.4f} (4096-token windows of held-out files)")
    from longpatch.assets import eval_documents
    from longpatch.eval.demo import long_context_report
    n_docs = write_eval_set(tok, held_files, root, out)
    long_ctx = long_context_report(model, tok, eval_documents(path=out))
    log(f"long context: {long_ctx}")
    repeats = repeat_probe(model, token_stream(tok, held_files))
    log(f"repeated segments: {repeats}")
    facts = {"python": platform.python_version(), "seed": args.seed, "params": n_params, "vocab": len(tok),
             "train_files": n_train_files, "heldout_files": len(held_files), "train_tokens_seen": state["tokens"],
             "stream_tokens": stream_tokens, "train_minutes": round(state["seconds"] / 60, 1),
             "heldout_loss": round(held_loss, 4), "eval_docs": n_docs, "curve": state["curve"],
             "evals": state["evals"], "phases": args.phases, "rope_theta": args.rope_theta, "lr": args.lr,
             "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "long_context": long_ctx,
             "repeat_probe": repeats, "rope_scaling": args.rope_scaling,
             "served_rope": dict(model.config.rope_parameters), "build_minutes": None}
    facts["build_minutes"] = round((time.time() - t_start) / 60, 1)
    (out / "training.json").write_text(json.dumps(facts, indent=1))
    write_model_card(out, facts)
    log(f"done in {(time.time() - t_start) / 60:.1f} min; wrote {out}")


def write_model_card(out: Path, facts: dict) -> None:
    """README.md of the model directory: what it is, how it was trained, what was measured."""
    lc = facts["long_context"]
    last = facts["evals"][-1] if facts["evals"] else {}
    evals = ", ".join(f"{k} {v:.2f}" for k, v in last.items() if k != "step") or "none"
    curve = "\n".join(f"| {c['step']} | {c['ctx']} | {c['tokens']:,} | {c['loss']:.3f} | {c['answer_loss']:.3f} |"
                      for c in facts["curve"][::4])
    gain = math.exp(lc["late_short_context"] - lc["late"]) - 1
    repeats = "\n".join(f"| {n} | {r['first']:.3f} | {r['second']:.3f} | {100 * r['ratio']:.1f}% |"
                        for n, r in facts.get("repeat_probe", {}).items())
    needle = facts.get("needle")
    if needle:  # {template: {lengths, depths, trials, accuracy: {length: fraction}, minutes}}
        lengths = sorted({int(n) for r in needle.values() for n in r["accuracy"]})
        rows = "\n".join(
            f"| {t} | {len(r['depths'])} ({r['depths'][0]}...{r['depths'][-1]}) x {r['trials']} | "
            + " | ".join(f"{100 * r['accuracy'][str(n)]:.0f}%" if str(n) in r["accuracy"] else "-" for n in lengths)
            + " |" for t, r in needle.items())
        needle_text = ("exact attention, `longpatch eval needle` (greedy generation, held-out filler):\n\n"
                       "| template | depths x trials | " + " | ".join(str(n) for n in lengths)
                       + " |\n| --- | --- |" + " --- |" * len(lengths) + "\n" + rows)
    else:
        needle_text = "not measured yet (`python scripts/build_demo_model.py --report --out DIR`)"
    sr = facts.get("served_rope")
    served = (f"YaRN factor {sr['factor']:g} and attention factor {sr['attention_factor']:.4f} "
              "(`serve_config` in the script)") if sr and sr.get("factor") else "the same settings"
    (out / "README.md").write_text(f"""# longpatch demo model

A small `LlamaForCausalLM` trained on the CPU by `scripts/build_demo_model.py`, so that longpatch can
show offline what an approximate attention costs. Not a useful language model.

- Architecture: 4 layers, hidden 256, 4 query heads sharing 2 KV heads (GQA), head_dim 64, RoPE
  (theta {facts['rope_theta']:g}; trained with scaling {facts.get('rope_scaling', 'none')}, shipped with
  {served}), measured to 32768 tokens, tied embeddings; {facts['params'] / 1e6:.2f}M parameters;
  byte-level BPE vocab {facts['vocab']}.
- Data: the Python {facts['python']} standard library's `*.py` files, {facts['train_files']} for training
  ({facts['stream_tokens']:,} tokens) and {facts['heldout_files']} held out by a hash of their path, mixed
  with retrieval samples (planted needles, repeated spans, random-token copying; see the script).
  The stdlib is under the Python Software Foundation License; the weights are a derived work.
- Training: seed {facts['seed']}, AdamW lr {facts['lr']}, phases `{facts['phases']}`;
  {facts['train_tokens_seen']:,} tokens in {facts['train_minutes']} min of training on
  {facts['cpu_threads']} CPU threads (torch {facts['torch']}), across resumed runs; the last run
  {facts.get('build_minutes')} min.
- Held-out loss: {facts['heldout_loss']} nats/token (4096-token windows of the held-out stream).
- Long context (`longpatch.eval.demo.long_context_report`, {lc['docs']} documents, nats/token):
  positions 1-255 {lc['early']:.3f}; positions 2048-4095 {lc['late']:.3f}; the same late tokens with
  at most 256 tokens of context {lc['late_short_context']:.3f} (full context {100 * gain:.1f}% better in
  perplexity).

## Retrieval

Repeated held-out code segment (a segment of n tokens followed by itself; nats/token):

| n | first copy | second copy | second / first |
| --- | --- | --- | --- |
{repeats}

Needle in a haystack: {needle_text}

Teacher-forced probe at the last training step: {evals}.

## Training curve

| step | context | tokens seen | LM loss (EMA) | answer loss (EMA) |
| --- | --- | --- | --- | --- |
{curve}
""")


def needle_report(out: Path, templates: str, lengths: str, depths: str, trials: int, work: Path, log) -> None:
    """Run `longpatch eval needle` (exact attention) on the model in `out` for each template and record
    its accuracy per length in training.json and the model card (one template per call is fine: the
    others' figures are kept; each run resumes in work/<template>)."""
    from longpatch.eval.needle_run import needle

    facts = json.loads((out / "training.json").read_text())
    report = facts.get("needle") or {}
    for template in templates.split(","):
        t0 = time.time()
        res = needle(str(out), layers="0", method="sparse", template=template, lengths=lengths, depths=depths,
                     trials=trials, out=str(work / template), progress=False)
        report[template] = {"lengths": res["lengths"], "depths": res["depths"], "trials": res["trials"],
                            "accuracy": {str(s["length"]): s["accuracy"] for s in res["summary"]},
                            "minutes": round((time.time() - t0) / 60, 1)}
        log(f"needle {template}: {report[template]['accuracy']}")
        facts["needle"] = report
        (out / "training.json").write_text(json.dumps(facts, indent=1))
        write_model_card(out, facts)


EVAL_SUBSET = "demo_code"  # held-out stdlib files, LongBench record format, category "code"
EVAL_MIN_TOKENS = 4096
EVAL_MAX_DOCS = 24


def write_eval_set(tokenizer, files, root: Path, out: Path) -> int:
    """Held-out files of at least EVAL_MIN_TOKENS tokens, in path order, as LongBench records."""
    records = []
    for p in files:
        text = read(p)
        if len(tokenizer(text)["input_ids"]) < EVAL_MIN_TOKENS:
            continue
        rel = str(p.relative_to(root))
        records.append({"input": "", "context": text, "answers": [rel], "length": len(text.split()),
                        "dataset": EVAL_SUBSET, "language": "en", "all_classes": None,
                        "_id": hashlib.sha1(rel.encode()).hexdigest()})
        if len(records) == EVAL_MAX_DOCS:
            break
    d = out / "eval"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{EVAL_SUBSET}.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return len(records)


@torch.no_grad()
def repeat_probe(model, stream: torch.Tensor, lengths=(512, 2048, 8192), windows: int = 2) -> dict:
    """A held-out code segment of n tokens followed by itself: mean loss (nats/token) on the first and
    the second copy. A model that reads its context scores the second copy far lower."""
    out = {}
    for n in lengths:
        first, second = [], []
        for w in range(windows):
            seg = stream[w * n:(w + 1) * n]
            ids = torch.cat([seg, seg]).unsqueeze(0)
            nll = F.cross_entropy(model(ids[:, :-1]).logits[0].float(), ids[0, 1:], reduction="none")
            first.append(nll[:n - 1].mean().item())
            second.append(nll[n - 1:].mean().item())
        f, s = sum(first) / windows, sum(second) / windows
        out[str(n)] = {"first": round(f, 4), "second": round(s, 4), "ratio": round(s / f, 4)}
    return out


@torch.no_grad()
def heldout_loss(model, tok, files, ctx: int = 4096, max_windows: int = 8) -> float:
    stream = token_stream(tok, files)
    losses_ = []
    for i in range(min(max_windows, (len(stream) - 1) // ctx)):
        chunk = stream[i * ctx:(i + 1) * ctx + 1].unsqueeze(0)
        logits = model(chunk[:, :-1]).logits
        losses_.append(F.cross_entropy(logits[0].float(), chunk[0, 1:]).item())
    return sum(losses_) / len(losses_)


if __name__ == "__main__":
    sys.exit(main())
