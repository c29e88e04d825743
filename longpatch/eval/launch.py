"""How an evaluation runs in several processes, whatever it evaluates.

Three ways: one process (`single`); `num_processes > 1` local workers spawned here (`spawned`), each
running the same evaluation function with num_processes=1 and the rank in its environment; or the
processes of `accelerate launch` / torchrun (`launcher`). Every process takes the work items
`items[rank::world]` and appends its own records file (records.records_file); rank 0 writes the plan and
the report. An evaluation plugs in with one call to `run_sharded`.

A fourth, `sequence` (run_sequence_parallel, eval ppl --sequence-parallel N): N processes share each
item, every process holding a slice of the sequence (longpatch.parallel); all of them run every item
and rank 0 alone writes the records. Started from one process it runs itself under torch's own
launcher (`python -m torch.distributed.run --standalone`); under torchrun / accelerate launch with N
processes it runs as one of them.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError, LongpatchError
from ..outdir import HELD_ENV, claim_out, held_key, hold_out
from .records import removed_on_failure

WORKER_ENV = "LONGPATCH_EVAL_WORKER"  # set in the processes --num-processes spawns
_LAUNCHER_TIMEOUT = timedelta(days=7)  # ranks wait for the slowest one at the end; a 32k sweep takes hours


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    # single | spawned (by --num-processes) | launcher (accelerate launch / torchrun) | sequence (the launcher's
    # processes share each item: sequence parallelism)
    mode: str = "single"
    state: Any = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        if self.state is not None:
            return torch.device("cpu") if self.state.device.type == "cpu" else self.state.device
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", self.rank) or 0)
            return torch.device("cuda", local % torch.cuda.device_count())
        return torch.device("cpu")

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()


def distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Dist()
    rank = int(os.environ.get("RANK", "0") or 0)
    if os.environ.get(WORKER_ENV):
        return Dist(rank, world, "spawned")
    from accelerate import PartialState
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=_LAUNCHER_TIMEOUT)
    return Dist(state.process_index, state.num_processes, "launcher", state)


def shared_run_id(dist: Dist, run_id: str | None) -> str:
    """One id per invocation, the same in every process of it (spawned workers get it passed in)."""
    run_id = run_id or uuid.uuid4().hex[:12]
    if dist.mode == "launcher":
        from accelerate.utils import broadcast_object_list
        run_id = broadcast_object_list([run_id], from_process=0)[0]
    return run_id


def run_sharded(spec, model, entry: str, body: Callable[[Dist, str], dict], report: Callable[[], dict]) -> dict:
    """Run an evaluation in this process, in spec.num_processes spawned workers, or as one rank of a launcher.

    spec: the evaluation's spec (launch reads out, num_processes, run_id, tokenizer, configs and its
        to_kwargs()); model: a name or a loaded model; entry: "module:function" that a spawned worker
        calls with spec.to_kwargs() (model included); body(dist, run_id): the evaluation in this
        process, returning its results on rank 0 ({} elsewhere and in spawned workers); report():
        the results from what the workers wrote.
    A failed call that finished nothing removes the `out` directory it created. The run owns `out` (_owned)
    for its lifetime: another run on it refuses.
    """
    out = Path(spec.out)
    existed = out.exists()
    dist = distributed()
    # The lock first: a refused run must not clean up (removed_on_failure) the directory of the run it met.
    with _owned(out, spec.COMMAND, dist.main), removed_on_failure(out, keep_if_existed=existed):
        run_id = shared_run_id(dist, spec.run_id)
        if spec.num_processes <= 1:
            return body(dist, run_id)
        if dist.world > 1:
            raise ConfigError(f"--num-processes: already running under a launcher with {dist.world} processes; "
                              "pass --num-processes 1 (the launcher's processes share the work)")
        if not isinstance(model, str) or not spec.named_inputs():
            raise ConfigError("--num-processes > 1 needs the model, tokenizer and config given by name or path "
                              "(each worker loads its own copy)")
        # Marked before the workers start: a worker's own check_out must not find a sibling's records in an
        # unmarked directory (a non-empty directory longpatch did not write is refused).
        claim_out(out, spec.COMMAND)
        spawn(entry, dict(spec.to_kwargs(), model=model, run_id=run_id), spec.num_processes, out)
        return report()


def run_sequence_parallel(spec, model, entry: str, body: Callable[[Dist, str], dict],
                          report: Callable[[], dict]) -> dict:
    """Run an evaluation with each item split over spec.sequence_parallel processes (Dist mode 'sequence').

    From a single process: start those processes with torch's launcher, each calling entry(**kwargs)
    as in spawn(), and return report(). Under a launcher with exactly that many processes: run body as
    one of them. Not combinable with num_processes (which shards items, not sequences).
    """
    n = spec.sequence_parallel
    out = Path(spec.out)
    existed = out.exists()
    main = int(os.environ.get("RANK", "0") or 0) == 0  # the launcher's rank 0, or the one process
    with _owned(out, spec.COMMAND, main), removed_on_failure(out, keep_if_existed=existed):
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # num_processes > 1: refused by the spec
        if world == 1:
            if not isinstance(model, str) or not spec.named_inputs():
                raise ConfigError("--sequence-parallel > 1 needs the model, tokenizer and config given by name or "
                                  "path (each process loads its own copy)")
            run_id = spec.run_id or uuid.uuid4().hex[:12]
            claim_out(out, spec.COMMAND)  # before the processes start, as in run_sharded
            torchrun(entry, dict(spec.to_kwargs(), model=model, run_id=run_id), n, out)
            return report()
        if world != n:
            raise ConfigError(f"--sequence-parallel: got {n}, but the launcher started {world} processes; "
                              f"allowed: {world} (or start {n} processes)")
        dist = distributed()
        if dist.mode != "launcher":
            raise ConfigError("--sequence-parallel cannot run inside --num-processes workers")
        run_id = shared_run_id(dist, spec.run_id)
        return body(Dist(dist.rank, dist.world, "sequence", dist.state), run_id)


def _owned(out: Path, command: str, main: bool):
    """The run's hold on `out` (outdir.hold_out), taken by its main process only: under a launcher the other
    ranks wait for rank 0 in their first collective (shared_run_id), so rank 0's refusal stops them all
    before any work; the processes this run starts itself find `out` held for them (HELD_ENV)."""
    return hold_out(out, command) if main else contextlib.nullcontext(out)


def torchrun(entry: str, kwargs: dict, nproc: int, out: Path) -> None:
    """Run entry(**kwargs) in nproc local processes started by torch's own launcher (torch.distributed.run,
    --standalone: a free rendezvous port of its own; through longpatch.parallel.torchrun, which keeps its
    failure report to one line) and wait for them."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{HELD_ENV: held_key(out)})  # this run holds out for its processes
    threads = _cpu_threads(nproc)
    if threads and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = threads
    cmd = [sys.executable, "-m", "longpatch.parallel.torchrun", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "longpatch.eval.worker", entry, json.dumps(kwargs)]
    code = subprocess.run(cmd, env=env).returncode
    if code != 0:
        raise LongpatchError(f"the {nproc} sequence-parallel processes exited with code {code} (their errors are "
                             f"above); finished work, if any, is kept in {out}; run the same command again to resume")


def _cpu_threads(nproc: int) -> str | None:
    """OMP_NUM_THREADS for each of nproc local processes on a CPU (None on GPU): the cores are shared
    out, or every process would start one thread per core."""
    return None if torch.cuda.is_available() else str(max(1, (os.cpu_count() or 1) // nproc))


def spawn(entry: str, kwargs: dict, num_processes: int, out: Path) -> None:
    """Run entry(**kwargs) in num_processes local workers (ranks 0..n-1) and wait for all of them; one
    failure stops the others (their finished records are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    threads = _cpu_threads(num_processes)
    procs = []
    for rank in range(num_processes):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(num_processes), LOCAL_RANK=str(rank),
                   **{WORKER_ENV: "1", HELD_ENV: held_key(out)})  # held_key: this run holds out for them
        if threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = threads
        cmd = [sys.executable, "-c", "from longpatch.eval.launch import worker_main; worker_main()", entry,
               json.dumps(dict(kwargs, num_processes=1))]
        procs.append(subprocess.Popen(cmd, env=env))
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or None not in codes:
                break
            time.sleep(0.2)
    finally:
        for p in procs:  # on a failure or Ctrl-C the others stop too; finished records are kept
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    if failed is not None:
        raise LongpatchError(f"eval worker {failed} of {num_processes} exited with code {procs[failed].returncode}; "
                             f"finished work is kept in {out}; run the same command again to resume")


def worker_main() -> None:
    """A spawned worker: argv = [entry "module:function", JSON kwargs]."""
    module, _, name = sys.argv[1].partition(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        fn(**json.loads(sys.argv[2]))
    except LongpatchError as e:
        print(f"longpatch: error (worker {os.environ.get('RANK')}): {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        # a process group left to interpreter shutdown can abort the process ("terminate called without an
        # active exception": gloo's threads destroyed while joinable), failing a run whose work is done
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
