"""Peak memory per rank and time of sequence-parallel scoring (longpatch.parallel) vs one process.

For each configuration (the demo model unpatched = exact attention, and patched with a method), one
document of --seq-len random token ids is scored as `eval ppl` scores it (final hidden states, then
the chunked float32 NLL) once in a single process and once split over --nproc processes started by
torch's own launcher (python -m torch.distributed.run --standalone; gloo on CPU, NCCL on GPU). Every
measurement runs in a fresh process, so its peak is its own:

  rss_before   resident memory just before the forward (libraries + weights + inputs)
  peak_rss     the high-water mark during forward + loss (Linux: VmHWM, reset via /proc/self/clear_refs)
  activations  peak_rss - rss_before: what the sequence costs; sequence parallelism should cut it to ~1/N
  seconds      wall time of forward + loss (the slowest rank)

On a GPU the same numbers come from torch.cuda.max_memory_allocated. Prints a table, writes JSON
(--out) and a PNG beside it. A benchmark, not a test: run it alone on a quiet machine when you can.

  python scripts/bench_distributed.py --seq-len 32768 --nproc 2 --out docs/img/distributed.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {"exact": None, "moba": {"method": "moba", "layers": "all", "min_seq_len": 0}}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker(args) -> None:
    """One measurement, in this process (alone, or as one rank under torch.distributed.run)."""
    import torch

    from longpatch import load_model, patch_model
    from longpatch.eval.ppl.run import _evaluate_document_sp
    from longpatch.eval.ppl.scoring import evaluate_document

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1:
        import torch.distributed as dist
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, _ = load_model("demo")
    model.to(device)
    if CONFIGS[args.config]:
        patch_model(model, CONFIGS[args.config])
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    evaluate = _evaluate_document_sp if world > 1 else evaluate_document
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    result = evaluate(model, ids, 1024)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_kib("VmHWM") * 1024
    rank = int(os.environ.get("RANK", "0"))
    row = {"config": args.config, "processes": world, "rank": rank, "seq_len": args.seq_len,
           "threads": torch.get_num_threads(), "device": str(device), "rss_before_mib": before / 2 ** 20,
           "peak_mib": peak / 2 ** 20, "activations_mib": (peak - before) / 2 ** 20, "seconds": seconds,
           "nll_mean": result["nll_mean"]}
    with open(args.worker_out, "a") as f:
        f.write(json.dumps(row) + "\n")


def measure(config: str, nproc: int, seq_len: int, tmp: Path) -> list[dict]:
    rows_file = tmp / f"{config}_{nproc}.jsonl"
    rows_file.unlink(missing_ok=True)
    me = [str(Path(__file__).resolve()), "--worker", "--config", config, "--seq-len", str(seq_len),
          "--worker-out", str(rows_file)]
    # a fixed mmap threshold: glibc then returns every large freed block at once, so RSS follows the live
    # tensors (its default threshold grows up to 32 MiB and keeps freed activations in the heap)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"))
    if nproc == 1:
        cmd = [sys.executable, *me]
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *me]
    subprocess.run(cmd, env=env, check=True)
    return [json.loads(line) for line in rows_file.read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--configs", default="exact,moba", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--out", default="runs/bench_distributed/distributed.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        for nproc in (1, args.nproc):  # serially: one measurement at a time
            rows += measure(config, nproc, args.seq_len, out.parent)
    print(f"demo model, {args.seq_len} tokens, one document scored (forward + chunked NLL)")
    print(f"{'config':8} {'procs':>5} {'rank':>4} {'thr':>3} {'before MiB':>10} {'peak MiB':>9} "
          f"{'activ. MiB':>10} {'seconds':>8} {'nll_mean':>9}")
    for r in rows:
        print(f"{r['config']:8} {r['processes']:>5} {r['rank']:>4} {r['threads']:>3} {r['rss_before_mib']:>10.0f} "
              f"{r['peak_mib']:>9.0f} {r['activations_mib']:>10.0f} {r['seconds']:>8.1f} {r['nll_mean']:>9.5f}")
    out.write_text(json.dumps({"seq_len": args.seq_len, "nproc": args.nproc, "rows": rows}, indent=1) + "\n")
    _plot(rows, out.with_suffix(".png"), args.seq_len)
    print(f"written: {out}, {out.with_suffix('.png')}")


def _plot(rows: list[dict], path: Path, seq_len: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in ((axes[0], "activations_mib", "peak activation memory per rank (MiB)"),
                           (axes[1], "seconds", "seconds (slowest rank)")):
        for i, c in enumerate(configs):
            for j, procs in enumerate(sorted({r["processes"] for r in rows})):
                vals = [r[key] for r in rows if r["config"] == c and r["processes"] == procs]
                ax.bar(i * 3 + j, max(vals), label=f"{procs} process{'es' if procs > 1 else ''}" if i == 0 else None,
                       color=f"C{j}")
        ax.set_xticks([i * 3 + 0.5 for i in range(len(configs))], configs)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"demo model, {seq_len} tokens: one process vs sequence parallel (CPU, gloo)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
