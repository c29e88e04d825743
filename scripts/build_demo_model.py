#!/usr/bin/env python
"""Build longpatch's offline demo model (v2): a small Llama trained on the CPU on Python's own stdlib
that also retrieves from far back in its context.

Why: no hub is reachable offline, and a model that ignores distant tokens cannot show what an
approximate attention loses. Source code has long-range structure, but a 5M-parameter model trained
on a few million tokens of it never forms copying (induction) heads. So the code stream is mixed
with samples that reward reading far back (the retrieval mix, `Mixer.draw` and `MIX_SHARES` in
demo_model/data.py):

- code needles: `NAME = 71432` lines planted at random line boundaries of a code window (several
  names per window), asserted at the end (`assert NAME == 71432`);
- prose needles: "The pass key is 71432. Remember it. ..." planted the same way, asked at the end;
- repeated spans: a span of the window reappears later (the classic induction task, on real code).
- random-token copying: random tokens with one span repeated at a random offset, the task on which
  copying (induction) heads form; it comes first, on short sequences (see RECIPE in demo_model/recipe.py);
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

This file is the command line, one function per mode (build, --export, --report); the builder is the
package beside it, scripts/demo_model/: data.py (the stdlib, tokenizer and training mix), recipe.py
(stages, phases, hyperparameters), model.py (the Llama and its served RoPE), train.py (setup,
checkpoint/resume, training loop) and report.py (training.json, model card, needle report).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Run as a file, this directory is sys.path[0] already; loaded by path (as the tests do), it may not be.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model.model import save_served  # noqa: E402
from demo_model.recipe import RECIPE  # noqa: E402
from demo_model.report import finish, needle_report  # noqa: E402
from demo_model.train import open_build, train  # noqa: E402


def parser() -> argparse.ArgumentParser:
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
    return ap


def build_model(args: argparse.Namespace) -> int:
    """Train (or resume training) through --phases with checkpoints in --ckpt, then write the model to --out."""
    build = open_build(args)
    if train(build):  # else stopped at --stop-after, with a checkpoint
        finish(build, Path(args.out))
    return 0


def export_checkpoint(args: argparse.Namespace) -> int:
    """--export: the checkpoint as it would ship, to probe with `longpatch eval needle --model DIR`."""
    build = open_build(args)
    save_served(build.model, build.tok, Path(args.export), args.serve_rope_factor, build.log)
    build.log(f"exported the step-{build.state['step']} checkpoint to {args.export}")
    return 0


def report_needles(args: argparse.Namespace) -> int:
    """--report: needle retrieval of the finished model in --out, added to its training.json and model card."""
    from longpatch.errors import LongpatchError

    out = Path(args.out)
    if not (out / "training.json").is_file():
        raise SystemExit(f"--report: {out} has no training.json; allowed: the directory a finished build wrote")
    try:
        needle_report(out, args.report_templates, args.report_lengths, args.report_depths, args.report_trials,
                      Path(args.report_work), print)
    except LongpatchError as e:  # a bad --report-* option, in eval needle's words
        raise SystemExit(f"--report: {e}") from None
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mode = report_needles if args.report else export_checkpoint if args.export else build_model
    return mode(args)


if __name__ == "__main__":
    sys.exit(main())
