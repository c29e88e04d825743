"""`with sequence_parallel(model):` a whole (patched or unpatched) model runs sequence-parallel.

Each rank calls the model on its contiguous slice of the sequence (`sp.shard(input_ids)`); the
context adds what that needs:
* position_ids of the slice (its offset comes from one all_gather of the slice lengths per forward);
* every attention layer through `ulysses`: the model's family (longpatch.families) wraps its attention
  layers (`Family.wrap_attention`) so that each call reaches `SequenceParallel.attend` in the shared
  layout, with the layer's route when patched (method, min_seq_len, timing; unpatched layers and
  unpatched models run longpatch's exact attention, which is the model's own attention up to float
  rounding);
* `labels=` (this rank's slice of them) gives the loss of the whole sequence on every rank: the last
  position of a slice is scored against the first label of the next slice, and the sum and count of
  the token losses are all_reduce'd.
Everything else (embeddings, MLPs, norms, the LM head) is per position and needs no communication.
Prefill / scoring only: a KV cache, use_cache=True, generate() or a decode-shaped attention call
raise ConfigError, since each rank would cache only its slice.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import ConfigError, UnsupportedModelError
from ..families import AttentionCall, detect_family
from ..ops import exact_attention
from ..patching import REPORT_ATTR
from .comm import comm_device, gather_ints, world_of
from .ulysses import kv_heads_for, ulysses

SP_ATTR = "_longpatch_sp"  # the SequenceParallel state on the model
IGNORE = -100  # label ignored by the loss, as in transformers

_NO_DECODE = ("sequence parallelism runs prefill / scoring only (each rank would cache only its own slice); "
              "decode without sequence_parallel, e.g. on one rank with the whole prompt")


def _couples(route) -> bool:
    """Whether this layer's method needs the whole KV group of query heads on one rank (Method.couples_heads)."""
    if route is None or route.method is None:
        return False
    return route.method.couples(route.bound.params if route.bound is not None else route.params)


def _route_attend(route, causal: bool, scale):
    """attend(q, k, v) on full-length head subsets for one layer: its route's path when patched, else exact."""
    def attend(q, k, v):
        if route is None:
            return exact_attention(q, k, v, causal=causal, scale=scale)
        path = route.choose(q.shape[2], k.shape[2], None, causal=causal)
        if path == "original":  # an unpatched layer (or a causal-only method on a non-causal call)
            def original():
                return exact_attention(q, k, v, causal=causal, scale=scale, backend=route.backend)
            return route.run(path, q, k, v, causal=causal, scale=scale, original=original)
        return route.run(path, q, k, v, causal=causal, scale=scale)
    return attend


class _SPForward:
    """The model's forward under sequence parallelism (an instance of a class, like the families' forwards)."""

    def __init__(self, sp: "SequenceParallel", original):
        self.sp, self.original = sp, original
        params = inspect.signature(original).parameters
        self.takes_positions = "position_ids" in params
        self.takes_cache = "use_cache" in params

    def __call__(self, *args, **kwargs):
        sp = self.sp
        if args:  # input_ids given positionally, as model(ids)
            kwargs["input_ids"], args = args[0], args[1:]
        if args:
            raise ConfigError("under sequence_parallel pass the model's inputs by keyword (input_ids=, labels=, ...)")
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ConfigError(f"past_key_values / use_cache=True: {_NO_DECODE}")
        if self.takes_cache:
            kwargs["use_cache"] = False
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not bool(mask.all()):
            raise ConfigError("sequence parallelism: attention_mask with padding is not supported (one unpadded "
                              "sequence per batch row; drop the mask)")
        x = kwargs.get("input_ids")
        x = kwargs.get("inputs_embeds") if x is None else x
        if x is None:
            raise ConfigError("sequence parallelism: pass input_ids= or inputs_embeds= (this rank's slice)")
        b, n_local = x.shape[0], x.shape[1]
        sp.seq_lens = [v[0] for v in gather_ints([n_local], sp.device, sp.group)]
        if min(sp.seq_lens) == 0:
            raise ConfigError(f"sequence parallelism: a rank got no tokens (slice lengths {sp.seq_lens})")
        start = sum(sp.seq_lens[:sp.rank])
        if kwargs.get("position_ids") is None:
            if not self.takes_positions:
                raise UnsupportedModelError(f"{type(sp.model).__name__}.forward takes no position_ids, which "
                                            "sequence parallelism needs to place each rank's slice")
            kwargs["position_ids"] = torch.arange(start, start + n_local, device=x.device).unsqueeze(0).expand(b, -1)
        labels = kwargs.pop("labels", None)
        try:
            out = self.original(**kwargs)
        finally:
            sp.seq_lens = None
        if labels is None:
            return out
        loss = sp.loss(out.logits if hasattr(out, "logits") else out[0], labels)
        if isinstance(out, tuple):
            return (loss, *out)
        out["loss"] = loss
        return out


def _no_generate(*args, **kwargs):
    raise ConfigError(f"generate() under sequence_parallel: {_NO_DECODE}")


class SequenceParallel:
    """What `sequence_parallel` yields: the group, this rank, and helpers to cut and score a sequence."""

    def __init__(self, model, group, rank: int, world: int):
        self.model, self.group, self.rank, self.world = model, group, rank, world
        self.device = comm_device(group)
        self.seq_lens: list[int] | None = None  # every rank's slice length, during a forward
        self._saved: list = []

    # ---- cutting a sequence
    def bounds(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of `rank`'s (default: this rank's) slice of n positions: ceil(n/N) each, the last shorter."""
        if n < self.world:
            raise ConfigError(f"sequence parallelism: {n} tokens cannot be split over {self.world} ranks")
        r = self.rank if rank is None else rank
        per = -(-n // self.world)
        return min(n, r * per), min(n, (r + 1) * per)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a full tensor along `dim` (the sequence; dim 1 of input_ids / labels)."""
        s, e = self.bounds(x.shape[dim])
        return x.narrow(dim, s, e - s)

    # ---- the loss of the whole sequence
    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the whole sequence (labels: this rank's slice, -100 ignored).

        Every rank returns the same value; its gradient reaches this rank's logits only (each rank
        backpropagates its own part, as in data parallelism)."""
        firsts = gather_ints(labels[:, 0].tolist(), self.device, self.group)  # each rank's first labels
        nxt = firsts[self.rank + 1] if self.rank + 1 < self.world else [IGNORE] * labels.shape[0]
        targets = torch.cat([labels[:, 1:], torch.tensor(nxt, dtype=labels.dtype, device=labels.device)[:, None]], 1)
        targets = targets.to(logits.device)
        local = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                ignore_index=IGNORE, reduction="sum")
        totals = torch.stack([local.detach().double(), (targets != IGNORE).sum().double()]).to(self.device)
        dist.all_reduce(totals, group=self.group)
        total, count = totals.tolist()
        # value: the global mean; gradient: d(local sum)/count, this rank's share
        return (local + (total - local.detach())) / max(count, 1.0)

    # ---- every attention layer's call (Family.wrap_attention)
    def attend(self, q, k, v, call: AttentionCall) -> torch.Tensor:
        """One attention layer's call on this rank's slice (shared layout): `ulysses` around its route."""
        if self.seq_lens is None:
            raise ConfigError("sequence parallelism: an attention layer ran outside the model's forward "
                              "under sequence_parallel")
        if q.shape[2] != k.shape[2]:
            raise ConfigError(f"got a decode call (q_len {q.shape[2]}, kv_len {k.shape[2]}); {_NO_DECODE}")
        why = call.unsupported(sum(self.seq_lens))  # the whole sequence's keys, not this slice's
        if why is not None:
            raise ConfigError(f"sequence parallelism: layer {call.layer} got {why}, which it does not support "
                              "(plain causal or full attention only)")
        route = call.route
        return ulysses(q, k, v, _route_attend(route, call.causal, call.scale), group=self.group,
                       seq_lens=self.seq_lens, whole_groups=_couples(route))

    # ---- install / uninstall
    def install(self) -> None:
        model = self.model
        report = getattr(model, REPORT_ATTR, None)
        fam = report.family if report is not None else detect_family(model)  # the one that patched it, if any
        if not callable(getattr(fam, "wrap_attention", None)):
            raise UnsupportedModelError(f"sequence_parallel: the {fam.name!r} family cannot wrap the attention "
                                        f"of {type(model).__name__} (it has no wrap_attention)")
        if getattr(model, SP_ATTR, None) is not None:
            raise ConfigError("model is already under sequence_parallel")
        hq, hk = fam.attention_heads(model)
        kv_heads_for(hq, hk, self.world)  # heads not divisible by the ranks: fail now, not in the first layer
        original_forward = vars(model).get("forward")
        self._saved.append(lambda: _restore(model, "forward", original_forward))
        model.forward = _SPForward(self, model.forward)
        original_generate = vars(model).get("generate")
        self._saved.append(lambda: _restore(model, "generate", original_generate))
        model.generate = _no_generate
        setattr(model, SP_ATTR, self)
        self._saved.append(lambda: delattr(model, SP_ATTR))
        self._saved.append(lambda: fam.unwrap_attention(model))
        fam.wrap_attention(model, self.attend)

    def uninstall(self) -> None:
        while self._saved:
            self._saved.pop()()


def _restore(obj, name: str, value) -> None:
    """Put back an instance attribute as it was (absent: the class's own)."""
    if value is None:
        vars(obj).pop(name, None)
    else:
        setattr(obj, name, value)


@contextlib.contextmanager
def sequence_parallel(model, group=None):
    """Run `model` sequence-parallel over `group` (None: the default process group) inside the block.

    Each rank calls the model with its contiguous slice of the sequence (``sp.shard(input_ids)``: ranks
    in order, ceil(n/N) positions each, the last shorter); position_ids of the slice are added, every
    attention layer runs `ulysses` (patched layers their method, unpatched ones exact attention), and
    ``labels=`` (the same slice of the labels) gives the whole sequence's loss on every rank.
    Prefill / scoring only: past_key_values, use_cache=True and generate() raise ConfigError.
    Patch or unpatch the model outside the block, not inside.
    """
    rank, world = world_of(group)
    sp = SequenceParallel(model, group, rank, world)
    try:
        sp.install()
        yield sp
    finally:
        sp.uninstall()
