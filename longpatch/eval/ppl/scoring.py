"""From a model and token ids to token losses: tokenizers for the records, the LM head, hidden states,
chunked float32 NLL, and one document's losses and wall times."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ...errors import ConfigError, UnsupportedModelError
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
    head = lm_head(model)
    box: dict[str, torch.Tensor] = {}

    def grab(_module, args):
        box["hidden"] = args[0]
        raise _ReachedHead

    handle = head.register_forward_pre_hook(grab)
    try:
        model(input_ids=input_ids, use_cache=False)
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
    return hidden



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



def evaluate_document(model, input_ids: torch.Tensor, chunk: int = 1024, next_ids: torch.Tensor | None = None) -> dict:
    """One document [1, s] on the model as it is: NLL sum/mean over s-1 tokens and wall times.

    next_ids [1, 1]: the token that follows input_ids (a sequence-parallel slice, whose last position
    predicts the next slice's first token), scored too: s tokens then. nll_mean is nan with none scored."""
    with torch.inference_mode():
        _sync()
        t0 = time.perf_counter()
        hidden = final_hidden_states(model, input_ids)
        _sync()
        t1 = time.perf_counter()
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
