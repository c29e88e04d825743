"""The methods registry: name -> Method with typed, validated parameters.

A method turns (q, k, v) in the shared layout into the attention output:
q [b, q_heads, q_len, d], k/v [b, kv_heads, kv_len, d] (GQA: kv_heads divides q_heads, K/V are
never repeated in memory), output [b, q_heads, q_len, d]. A method always implements prefill
(q_len == kv_len); it may implement decode (q_len < kv_len against a KV cache). Where it does not,
the family adapter runs exact attention for that call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError, shown

# The largest int any method param takes: sizes past the input are clamped to it by the ops (window=10**9 is
# a valid wish for every key), but a 400-digit number is a typo, and past int64 torch cannot take it at all.
MAX_INT = 2 ** 62


@dataclass(frozen=True)
class Param:
    """One method parameter: its default, accepted types and an optional range check."""

    default: Any
    types: tuple[type, ...]
    doc: str
    check: Callable[[Any], bool] | None = None
    allowed: str = ""  # how `check` reads to a user, e.g. "an int >= 1"

    def validate(self, method: str, name: str, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ConfigError(f"params.{name} of method '{method}': got an int of {len(str(abs(value)))} digits; "
                              f"allowed: {self.allowed or ' or '.join(t.__name__ for t in self.types)}, at most 2**62")
        ok_type = isinstance(value, self.types) and not (isinstance(value, bool) and bool not in self.types)
        if float in self.types and isinstance(value, int) and not isinstance(value, bool):
            value, ok_type = float(value), True
        if value is None and type(None) in self.types:
            return None
        if not ok_type or (self.check is not None and not self.check(value)):
            what = self.allowed or " or ".join(t.__name__ for t in self.types)
            raise ConfigError(f"params.{name} of method '{method}': got {shown(value)}; allowed: {what}")
        return value


# Range checks are small module-level classes, not lambdas: a patched model keeps its Method (and
# so these checks) in its routes, and torch.save / pickle can only store objects importable by name.

@dataclass(frozen=True)
class Between:
    """lo <= x <= hi (hi None: no upper bound); None passes when ``optional``."""

    lo: float
    hi: float | None = None
    optional: bool = False

    def __call__(self, x) -> bool:
        if x is None:
            return self.optional
        return x >= self.lo and (self.hi is None or x <= self.hi)


@dataclass(frozen=True)
class OneOf:
    """x is one of ``choices``."""

    choices: tuple

    def __call__(self, x) -> bool:
        return x in self.choices


def positive_int(doc: str, default: int) -> Param:
    return Param(default, (int,), doc, Between(1), "an int >= 1")


def nonneg_int(doc: str, default: int) -> Param:
    return Param(default, (int,), doc, Between(0), "an int >= 0")


def optional_int(doc: str, default: int | None = None) -> Param:
    return Param(default, (int, type(None)), doc, Between(0, optional=True), "an int >= 0 or null")


def one_of(doc: str, default: str, choices: tuple) -> Param:
    return Param(default, (str,), doc, OneOf(tuple(choices)), " or ".join(repr(c) for c in choices))


def no_exact_params(n: int, params: dict) -> None:
    """``Method.exact_params`` of a method that no setting makes exact (linear, performer): None."""
    return None


@dataclass
class Method:
    """A registered attention method: its functions and what it declares about itself.

    Callers do not call these functions directly: ``method.bind(params, head_dim, layer_idx)`` gives a
    ``BoundMethod``, the one form in which routes and benchmarks run a method (docs/methods.md).

    ``prefill(q, k, v, *, causal, scale, backend, buffers, [state,] **params)`` returns the output.
    ``decode`` (optional) has the same signature and is called when q_len < kv_len; without it the
    family adapter runs exact attention for that call. ``state`` (passed only when ``stateful``) is a
    per-layer dict the method may use to keep decode-time summaries beside the KV cache;
    ``init_state(k, v, *, buffers, **params)`` builds it from an existing cache in one pass.
    ``make_buffers(head_dim=, layer_seed=, **params)`` (optional) returns tensors the patched layer
    keeps as buffers that move with the model's device but keep their dtype through a cast of the
    model (``routing.MethodBuffers``; e.g. HyperAttention's LSH directions; not persistent: the params
    draw them again); ``layer_seed`` is the layer index (None for a lone call, as in the
    benchmarks).
    """

    name: str
    summary: str
    prefill: Callable[..., Any]
    params: dict[str, Param] = field(default_factory=dict)
    decode: Callable[..., Any] | None = None
    make_buffers: Callable[..., dict] | None = None
    causal_only: bool = False  # non-causal calls keep the model's own attention (and are not benchmarked)
    stateful: bool = False
    init_state: Callable[..., dict] | None = None
    # exact_when(q_len, kv_len, params) -> True where this call computes exact attention anyway (e.g. below
    # a length threshold), so stats can tell the approximation from exact work done by the method's code
    exact_when: Callable[[int, int, dict], bool] | None = None
    # exact_params(n, params) -> the params to change so that the method computes exact attention on
    # sequences of up to n tokens (e.g. hyper's min_seq_len >= n), or None where no setting makes it exact
    # (linear, performer: the default, ``no_exact_params``). Always callable: None given here is taken as
    # the default. The contract tests (tests/test_contract.py) hold every method to it.
    exact_params: Callable[[int, dict], dict | None] = no_exact_params
    # attended_pairs(q, k, causal, params) -> the query-key products a prefill call computes, selection
    # (gates, estimates) included, per query head summed: what `bench attention` divides exact's by for
    # the ideal speedup. None: not reported.
    attended_pairs: Callable[..., int] | None = None
    # couples_heads: whether the query heads of a KV group depend on each other (e.g. a block selection the
    # group makes together from the sum of its heads' scores): True, False (every query head computed on its
    # own, random draws shared by all heads), or couples_heads(params) -> bool where it depends on the params.
    # Sequence parallelism keeps a coupled group's query heads on one rank (parallel/ulysses.py).
    couples_heads: bool | Callable[[dict], bool] = False
    # graph_step(params, n) -> paged.StepSpec, or None where these params have none: the graph-safe one-token
    # step (fixed shapes, no host sync) that a static-cache decode runs after a prefill of n tokens, eager and
    # under torch.compile
    graph_step: Callable[[dict, int], Any] | None = None
    # chunk_block(params) -> the block a chunked prefill's chunks must start on for the method to run its own
    # attention on them (a query-aware selection chooses per query block), or None where any chunk runs
    # (the chunk size must then be a multiple of it: ``config.check_prefill_chunk``)
    chunk_block: Callable[[dict], int | None] | None = None
    # takes_chunks: ``prefill`` also runs a prefill chunk (1 < q_len < kv_len, the queries the last positions of
    # the keys), for a method without ``decode`` (hyper): such calls run it instead of exact attention
    takes_chunks: bool = False
    # reads_quantized(params) -> True where these params' one-token step reads an 8-bit KV cache in place
    # (``quantized.QuantizedKV``: dequantizing only the rows it attends); other calls get the layer's cache
    # dequantized once per call
    reads_quantized: Callable[[dict], bool] | None = None

    def __post_init__(self):
        if self.exact_params is None:  # callers call it without a check: None means "no exact setting"
            self.exact_params = no_exact_params

    def couples(self, params: dict[str, Any] | None) -> bool:
        """``couples_heads`` for these params (given or resolved; defaults filled and checked)."""
        if callable(self.couples_heads):
            return bool(self.couples_heads(self.resolve_params(params)))
        return bool(self.couples_heads)

    def resolve_params(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """Fill defaults and validate; unknown names are an error that lists the known ones."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "(none)"
            raise ConfigError(f"params.{unknown[0]}: unknown parameter of method '{self.name}'; allowed: {known}")
        return {n: p.validate(self.name, n, given.get(n, p.default)) for n, p in self.params.items()}

    def bind(self, params: dict[str, Any] | None, head_dim: int, layer_idx: int | None = None) -> BoundMethod:
        """This method with validated params and its buffers drawn for ``head_dim`` (and the layer
        ``layer_idx``: every patched layer draws its own; None for a lone call)."""
        resolved = self.resolve_params(params)
        buffers = {}
        if self.make_buffers is not None:
            buffers = self.make_buffers(head_dim=head_dim, layer_seed=layer_idx, **resolved)
        return BoundMethod(self, resolved, buffers, head_dim, layer_idx)


@dataclass
class BoundMethod:
    """A method bound to its params and buffers: how a route (routing.py) and the benchmarks call it.

    ``buffers`` are the tensors ``make_buffers`` drew; a patched layer registers them on its module
    and passes its own (moved, loaded) tensors to each call instead.
    """

    method: Method
    params: dict[str, Any]
    buffers: dict[str, Any]
    head_dim: int
    layer_idx: int | None = None

    @property
    def has_decode(self) -> bool:
        return self.method.decode is not None

    def __call__(self, q, k, v, *, causal: bool = True, scale: float | None = None, backend: str = "auto",
                 state: dict | None = None, buffers: dict | None = None):
        """Prefill when q_len == kv_len (or a chunk, for a method that ``takes_chunks``), else the method's
        decode; ``state`` reaches stateful methods only."""
        chunk = self.method.takes_chunks and 1 < q.shape[2] < k.shape[2]
        fn = self.method.prefill if q.shape[2] == k.shape[2] or chunk else self.method.decode
        if fn is None:
            raise ValueError(f"method '{self.method.name}' has no decode (q_len < kv_len runs exact attention)")
        extra = {"state": state} if self.method.stateful else {}
        return fn(q, k, v, causal=causal, scale=scale, backend=backend,
                  buffers=self.buffers if buffers is None else buffers, **extra, **self.params)

    def init_state(self, k, v, buffers: dict | None = None) -> dict | None:
        """A stateful method's decode state for the cache k/v, built in one pass (None when not stateful)."""
        if not self.method.stateful:
            return None
        if self.method.init_state is None:
            return {}
        return self.method.init_state(k, v, buffers=self.buffers if buffers is None else buffers, **self.params)

    def attended_pairs(self, q, k, causal: bool = True) -> int | None:
        """Query-key products of a prefill call on these inputs (``Method.attended_pairs``), or None."""
        fn = self.method.attended_pairs
        pairs = None if fn is None else fn(q, k, causal, self.params)
        return None if pairs is None else int(pairs)

    def step_spec(self, n: int):
        """The graph-safe step of these params after a prefill of n tokens (``Method.graph_step``), or None."""
        return None if self.method.graph_step is None else self.method.graph_step(self.params, n)

    def chunk_block(self) -> int | None:
        """The block a chunked prefill's chunks must start on for these params (``Method.chunk_block``), or None."""
        return None if self.method.chunk_block is None else self.method.chunk_block(self.params)

    def reads_quantized(self) -> bool:
        """Whether a one-token step of these params reads an 8-bit KV cache in place (``Method.reads_quantized``)."""
        return self.method.reads_quantized is not None and bool(self.method.reads_quantized(self.params))

    def exact_at(self, q_len: int, kv_len: int) -> bool:
        """Whether a call of this shape computes exact attention (``Method.exact_when``)."""
        return self.method.exact_when is not None and bool(self.method.exact_when(q_len, kv_len, self.params))

    def redrawn(self, seed: int) -> dict[str, Any]:
        """Buffers drawn afresh from ``seed`` (mixed with the layer index like the patch's own draw);
        {} for a method without buffers or without a ``seed`` param (nothing random to redraw)."""
        if self.method.make_buffers is None or "seed" not in self.method.params:
            return {}
        return self.method.make_buffers(head_dim=self.head_dim, layer_seed=self.layer_idx,
                                        **{**self.params, "seed": seed})


_METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    _METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    if name in _METHODS:
        return _METHODS[name]
    raise ConfigError(f"method: got {shown(name)}; allowed: {', '.join(sorted(_METHODS))}")


def available_methods() -> dict[str, Method]:
    return dict(sorted(_METHODS.items()))
