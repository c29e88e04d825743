"""The demo model's training text: the stdlib's files (split into training and held-out files), its
tokenizer and token stream, and the training mix drawn from that stream (`Mixer`, `MIX_SHARES`).

Every sample is a function of the `random.Random` it is drawn with, so a batch seeded by (seed, step)
is the same batch in every build."""
from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

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
        """One sample of a task: a kind of MIX_SHARES, or a single-task mix of recipe.MIXES."""
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
