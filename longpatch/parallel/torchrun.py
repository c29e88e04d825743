"""`python -m longpatch.parallel.torchrun ARGS`: torch's own launcher (torch.distributed.run, what the
`torchrun` command runs) with the same ARGS, for `--sequence-parallel` (longpatch.eval.launch.torchrun).

The only difference: when a worker fails, torch's launcher ends with a ChildFailedError traceback that
only repeats that a worker failed; the workers have already printed their own errors (one line for a
bad input), so here that report is one line too."""
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"longpatch: sequence-parallel rank {rank} failed first (exit code {failure.exitcode})", file=sys.stderr)
        sys.exit(1)
