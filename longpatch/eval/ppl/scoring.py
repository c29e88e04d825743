"""From a model and token ids to token losses: tokenizers for the records, the LM head, hidden states
(of one forward, or of a chunked prefill through the KV cache), chunked float32 NLL, and one document's
losses and wall times."""
from __future__ import annotations

import inspect
import math
import time

import torch
import torch.nn.functional as F

from ...errors import ConfigError, UnsupportedModelError, check_int
from ...loading import BYTES, ByteTokenizer, resolve_tokenizer
from ..sweep import input_device


def make_encoder(tokenizer, loaded, vocab: int, model_name: str, trust_remote_code: bool = False):
    """-> (encode(text) -> list[int], tokenizer id for the records). The tokenizer as loading.resolve_tokenizer
    finds it (`tokenizer` given, else `loaded`); the byte tokenizer needs a vocabulary of at least 256."""
    tok = resolve_tokenizer(tokenizer, loaded, None, trust_remote_code)
    if isinstance(tok, ByteTokenizer):
        if vocab < 256:
            raise ConfigError(f"tokenizer: 'bytes' needs a vocabulary of at least 256 ids; {model_name} has {vocab}")
        return tok.encode, BYTES

    def encode(text: str) -> list[int]:
        try:  # verbose=False: no "sequence longer than the model maximum" warning per document
            return list(tok(text, add_special_tokens=True, verbose=False)["input_ids"])
        except TypeError:  # tokenizers that are not transformers tokenizers
            return list(tok.encode(text))

    return encode, str(getattr(tok, "name_or_path", "") or type(tok).__name__)



def _chatglm_layout(model) -> bool:
    t = getattr(model, "transformer", None)
    return t is not None and hasattr(t, "output_layer") and hasattr(t, "encoder")



def lm_head(model) -> torch.nn.Module:
    """The module that turns final hidden states into logits."""
    if _chatglm_layout(model):
        return model.transformer.output_layer
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__}: no LM head found (get_output_embeddings() is None); "
                                    "perplexity needs a causal LM")
    return head



def vocab_size(model) -> int:
    head = lm_head(model)
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


class _ReachedHead(Exception):
    pass



def final_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, hidden]: what the model's LM head receives for input_ids [batch, seq].

    Works for transformers causal LMs and for the ChatGLM2 layout (remote code or the tiny stand-in,
    whose hidden states are [seq, batch, hidden] and are transposed here). The model runs its own
    forward (so patched attention, accelerate hooks and remote code all behave as usual); a pre-hook
    on the LM head records the head's input and stops the forward there, so no logits are computed.
    """
    return _head_input(model, input_ids, stop=True, use_cache=False)[0]


def _head_input(model, input_ids: torch.Tensor, stop: bool, **forward) -> tuple[torch.Tensor, object]:
    """(final_hidden_states of input_ids, the forward's output): the forward called with ``forward`` kwargs,
    stopped at the LM head (output None) when ``stop``, else run to its end (its logits computed too)."""
    head = lm_head(model)
    box: dict[str, torch.Tensor] = {}

    def grab(_module, args):
        box["hidden"] = args[0]
        if stop:
            raise _ReachedHead

    handle = head.register_forward_pre_hook(grab)
    out = None
    try:
        out = model(input_ids=input_ids, **forward)
    except _ReachedHead:
        pass
    finally:
        handle.remove()
    if "hidden" not in box:
        raise UnsupportedModelError(f"{type(model).__name__}: the forward pass never reached the LM head")
    hidden = box["hidden"]
    if _chatglm_layout(model):
        hidden = hidden.transpose(0, 1)
    if tuple(hidden.shape[:2]) != tuple(input_ids.shape):
        raise UnsupportedModelError(f"{type(model).__name__}: the LM head got hidden states of shape "
                                    f"{tuple(hidden.shape)} for input {tuple(input_ids.shape)}; expected one per token")
    return hidden, out


def chunk_bounds(n: int, chunk: int | None, decode_tokens: int | None = None) -> list[tuple[int, int]]:
    """[(start, end)] of a prefill of n tokens in chunks of ``chunk`` tokens (None, or >= n: one chunk).
    decode_tokens: only the first n - decode_tokens are prefilled so; the last decode_tokens follow one at a
    time (one-token chunks: the model's decode steps against the cache, as in generation)."""
    if decode_tokens:
        m = n - decode_tokens
        return chunk_bounds(m, chunk) + [(i, i + 1) for i in range(m, n)]
    if chunk is None or chunk >= n:
        return [(0, n)]
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def prefill_shapes(n: int, chunk: int | None, decode_tokens: int | None = None) -> set[tuple[int, int]]:
    """The (q_len, kv_len) of the attention calls of a prefill of n tokens in chunks (sweep.say_if_exact),
    decode steps included (chunk_bounds)."""
    return {(e - s, e) for s, e in chunk_bounds(n, chunk, decode_tokens)}


def chunked_hidden_states(model, input_ids: torch.Tensor, chunk: int | None, cache: str | None = None,
                          decode_tokens: int | None = None) -> torch.Tensor:
    """final_hidden_states of input_ids [1, s], the model run on ``chunk`` tokens at a time against its KV
    cache (a chunked prefill; None or chunk >= s: one forward). Each chunk's positions continue the
    earlier ones' (position_ids given: a model keeping its own cache may otherwise restart them at 0), so
    for exact attention the result is one forward's, up to float rounding, and every position's logits
    (the chunk's last one predicting the next chunk's first token) score as they would there. ``cache``: "int8"
    or "fp8": through an 8-bit KV cache (quantized.QuantizedCache; one chunk without ``chunk``), whose rows
    every attention call reads. decode_tokens: the last that many tokens fed one at a time after the
    prefill of the others (chunk_bounds), each a decode step of the model against the cache."""
    bounds = chunk_bounds(input_ids.shape[1], chunk, decode_tokens)
    if len(bounds) == 1 and cache is None:
        return final_hidden_states(model, input_ids)
    from ...cache import GrowingCache, cache_argument, takes_cache_objects
    from ...quantized import QuantizedCache

    # transformers' own classes write each chunk's keys and values into the Cache object in place, so their
    # forward can stop at the LM head as final_hidden_states does; a model that keeps its own tuple cache
    # (ChatGLM2) returns it, so its forward runs to the end (the chunk's logits computed and dropped)
    in_place = takes_cache_objects(model)
    name = cache_argument(model)
    # GrowingCache: the whole document's room allocated once, not the cache copied by every chunk
    if cache is not None and not in_place:
        raise ConfigError(f"--cache {cache}: {type(model).__name__} keeps its own KV cache (not transformers' Cache "
                          "objects); run it without --cache")
    room = bounds[-1][1] - bounds[0][1]
    past = None if not in_place else GrowingCache(config=model.config, reserve=room) if cache is None else \
        QuantizedCache(config=model.config, fmt=cache, reserve=room)
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters  # transformers < 5.2x
    parts = []
    for s, e in bounds:
        pos = torch.arange(s, e, device=input_ids.device)
        forward = {"position_ids": pos[None], **({"cache_position": pos} if takes_cache_position else {})}
        if past is not None:
            forward[name] = past
        hidden, out = _head_input(model, input_ids[:, s:e], stop=in_place, use_cache=True, **forward)
        if not in_place:
            past = out[1] if isinstance(out, tuple) else out.past_key_values
        parts.append(hidden)
    return torch.cat(parts, 1)



def _softcap(model) -> float | None:
    config = getattr(model, "config", None)
    return getattr(config, "final_logit_softcapping", None) or None



def _head_logits(model, head, hidden: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    cap = _softcap(model)
    return torch.tanh(logits / cap) * cap if cap else logits



def token_nll(model, hidden: torch.Tensor, input_ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """float32 natural-log NLL of tokens 1..s-1 of input_ids [1, s] given hidden [1, s, h], computed
    `chunk` positions at a time so at most [chunk, vocab] logits exist."""
    head = lm_head(model)
    positions = hidden.shape[1] - 1
    if positions <= 0:  # nothing to score (e.g. a one-token slice of a sequence-parallel document)
        return hidden.new_zeros(0, dtype=torch.float32)
    parts = []
    for i in range(0, positions, chunk):
        j = min(i + chunk, positions)
        logits = _head_logits(model, head, hidden[:, i:j])
        targets = input_ids[:, i + 1:j + 1].to(logits.device)
        parts.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"))
    return torch.cat([p.to(parts[0].device) for p in parts])



def model_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full [b, s, vocab] logits from the model's own forward (HF output or ChatGLM2 tuple)."""
    out = model(input_ids=input_ids, use_cache=False)
    return (out.logits if hasattr(out, "logits") else out[0]).float()



def check_loss_path(model, n: int = 16) -> None:
    """Fail early when hidden states -> LM head does not reproduce the model's own logits (a model
    that post-processes logits in a way this module does not know would get wrong losses)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size(model), (1, n), generator=gen).to(input_device(model))
    with torch.inference_mode():
        want = model_logits(model, ids)
        got = _head_logits(model, lm_head(model), final_hidden_states(model, ids)).to(want.device)
    tol = 1e-3 * max(1.0, float(want.abs().max()))
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=tol):
        raise UnsupportedModelError(f"{type(model).__name__}: its logits are not LM-head(final hidden states); "
                                    "the chunked loss cannot reproduce them")




def _sync() -> None:
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)



def evaluate_document(model, input_ids: torch.Tensor, chunk: int = 1024, next_ids: torch.Tensor | None = None,
                      prefill_chunk: int | None = None, cache: str | None = None,
                      decode_tokens: int | None = None) -> dict:
    """One document [1, s] on the model as it is: NLL sum/mean over s-1 tokens and wall times.

    next_ids [1, 1]: the token that follows input_ids (a sequence-parallel slice, whose last position
    predicts the next slice's first token), scored too: s tokens then. nll_mean is nan with none scored.
    prefill_chunk: the document fed through the KV cache that many tokens at a time (chunked_hidden_states;
    the forward time is all of them). decode_tokens N (teacher-forced decode perplexity): the first s - N
    tokens prefilled, the last N fed one at a time through the cache, and only those N tokens scored (the
    prefill's last position predicts the first of them, each step the next); the forward time is all of it."""
    # no_grad, not inference_mode, for a chunked prefill: its chunks get attention masks (queries against a
    # longer cache), which the patched layers read once per forward (ragged.memo, keyed by the mask's version
    # counter); an inference tensor has none, and each layer would read it again
    if decode_tokens is not None:  # at least one token prefilled (PerplexitySpec checks it as --decode-tokens)
        check_int("decode_tokens", decode_tokens, 1, input_ids.shape[1] - 1)
    one_forward = prefill_chunk is None and cache is None and decode_tokens is None
    with torch.inference_mode() if one_forward else torch.no_grad():
        _sync()
        t0 = time.perf_counter()
        hidden = chunked_hidden_states(model, input_ids, prefill_chunk, cache, decode_tokens)
        _sync()
        t1 = time.perf_counter()
        if decode_tokens:  # the N + 1 last positions: their first N predict the N decoded tokens (no other logits)
            hidden, input_ids = hidden[:, -decode_tokens - 1:], input_ids[:, -decode_tokens - 1:]
        if next_ids is not None:  # token_nll scores every position but the last: add a placeholder row
            hidden = torch.cat([hidden, hidden[:, -1:]], 1)
            input_ids = torch.cat([input_ids, next_ids.to(input_ids.device)], 1)
        nll = token_nll(model, hidden, input_ids, chunk)
        total = float(nll.double().sum())
        _sync()
        t2 = time.perf_counter()
    n = int(nll.numel())
    return {"scored_tokens": n, "nll_sum": total, "nll_mean": total / n if n else math.nan,
            "forward_seconds": t1 - t0, "loss_seconds": t2 - t1}


def check_configs_chunk(spec, model) -> None:
    """A run's --prefill-chunk (spec.prefill_chunk; eval ppl, eval needle) against every config it runs
    (config.check_prefill_chunk: an int >= 1, a multiple of the method's block), resolved from the same
    options as the run itself, before any model is loaded, any process started or anything written."""
    if spec.prefill_chunk is None:
        return
    from ...config import check_prefill_chunk
    from ...specs import resolve

    check_prefill_chunk(None, spec.prefill_chunk)  # the unpatched baseline: any int >= 1
    resolved = resolve(model if isinstance(model, str) else None, spec.config, spec.method, spec.layers, spec.sets,
                       trust_remote_code=spec.trust_remote_code)
    for _, cfg in resolved.patches:
        check_prefill_chunk(cfg, spec.prefill_chunk)
