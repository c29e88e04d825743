"""The collectives sequence parallelism needs, on torch.distributed: a differentiable all-to-all with
uneven splits, the slice lengths of every rank, and a free port for tests and the launcher.

Everything here works on whichever backend the process group has: gloo on CPU, NCCL on GPU (NCCL
needs the tensors on this rank's GPU; the callers keep them where the model's activations are).
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from ..errors import ConfigError


def world_of(group) -> tuple[int, int]:
    """(rank in `group`, size of `group`); a clear error when torch.distributed was never set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("sequence parallelism needs torch.distributed: call torch.distributed.init_process_group "
                          "(gloo on CPU, nccl on GPU) or start the processes with torchrun / accelerate launch")
    return dist.get_rank(group), dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single on flat tensors: send[j] elements go to rank j, recv[i] elements arrive from rank i.

    Its gradient is the reverse exchange (what was sent to j comes back from j), so autograd through the
    two all-to-alls of Ulysses attention needs no more than this."""

    @staticmethod
    def forward(ctx, flat, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = flat.new_empty(sum(recv))
        dist.all_to_all_single(out, flat.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(flat: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """Exchange the 1-D ``flat`` (its consecutive pieces of ``send`` sizes go to ranks 0, 1, ...); returns
    the 1-D concatenation of what ranks 0, 1, ... sent here (``recv`` sizes). Differentiable."""
    return _AllToAll.apply(flat, list(send), list(recv), group)


def gather_ints(values: list[int], device, group=None) -> list[list[int]]:
    """Every rank's ``values`` (same count on each rank), in rank order: one small all_gather."""
    _, world = world_of(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]


def comm_device(group=None) -> torch.device:
    """Where small bookkeeping tensors must live for `group`'s backend (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on this machine now (bind port 0 and let the OS choose)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
