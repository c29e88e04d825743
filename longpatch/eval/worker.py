"""`python -m longpatch.eval.worker ENTRY JSON`: one process of a sequence-parallel evaluation, as
torch's launcher starts it (longpatch.eval.launch.torchrun); calls entry(**json) like a spawned worker.
A module of its own, imported by nothing, so that runpy finds it fresh."""
from longpatch.eval.launch import worker_main

if __name__ == "__main__":
    worker_main()
