"""The LM head in chunks of tokens: per-token log-probs of given targets (and, if asked, each position's entropy)
without the logits of every token at once.

At a vocabulary of 248K a branch of a few thousand tokens would hold ~2.5 GB of logits, their fp32 copy and the
log-softmax's saved output. Here the final norm, the head, the log-softmax and the gather run over `chunk` tokens
(all rows' positions together) at a time. With autograd and more than one chunk, each chunk runs under torch's
non-reentrant checkpoint (the idea of recompute.py, for the head): the backward keeps only the chunk's hidden
states and recomputes its logits when it reaches it, so one chunk's logits exist at a time, in the forward and in
the backward, and nothing of size tokens x vocab is saved. One chunk (small vocabularies, short branches) runs
plainly: checkpointing it would lower no peak, since its logits would exist again during the backward.

The values are those of the unchunked head: the same ops per token (rounding may differ with the matmul's
blocking; fp64 agrees to ~1e-15).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

HEAD_CHUNK_LOGITS = 2**26  # logits per chunk by default: 256 MiB in fp32


def default_head_chunk(vocab_size: int) -> int:
    """Tokens per head chunk when none is set: as many as make 2**26 logits (256 MiB in fp32), at least one."""
    return max(1, HEAD_CHUNK_LOGITS // vocab_size)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets], computed in fp32 (or fp64 for fp64 logits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy(logp: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """-sum p log p over the last axis, from log-probs; without autograd unless `grad` (the entropy bonus's).
    log_softmax of finite logits is finite, so p log p is 0 where p underflows to 0, and its gradient is finite."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return -(logp.exp() * logp).sum(-1)


def chunked_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                     chunk: int, entropy: bool | Literal["grad"] = False
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden))[targets] per token, `chunk` tokens at a time.

    `head` maps hidden states [n, H] to logits [n, V] (the final norm and the LM head); `hidden` is [..., H] and
    `targets` its leading shape. Returns log-probs of targets' shape, in fp32 (fp64 for fp64 logits); with
    `entropy`, also each position's entropy of the whole distribution (no autograd; "grad": with autograd, for the
    entropy bonus), as the pair (logp, entropy).
    """
    grad_entropy = entropy == "grad"
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"targets {tuple(targets.shape)} do not match the hidden states' positions {tuple(lead)}")
    if chunk < 1:
        raise ValueError(f"head chunk must be >= 1 tokens, not {chunk}")
    flat, ids = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    n = ids.numel()
    recompute = torch.is_grad_enabled() and n > chunk

    def piece(x: torch.Tensor, t: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, ...]:
        logits = head(x)
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        picked = logp.gather(-1, t.unsqueeze(-1)).squeeze(-1)
        return (picked, _entropy(logp, grad_entropy)) if with_entropy else (picked,)

    outs: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, max(n, 1), chunk):
        x, t = flat[s : s + chunk], ids[s : s + chunk]
        if recompute:
            first = [True]

            def run(x: torch.Tensor, t: torch.Tensor, first: list[bool] = first) -> tuple[torch.Tensor, ...]:
                # an entropy without autograd only in the forward: the backward's recompute needs the log-probs
                with_entropy, first[0] = bool(entropy) and (first[0] or grad_entropy), False
                return piece(x, t, with_entropy)

            outs.append(checkpoint(run, x, t, use_reentrant=False))
        else:
            outs.append(piece(x, t, entropy))
    logp = torch.cat([o[0] for o in outs]).reshape(lead)
    if not entropy:
        return logp
    return logp, torch.cat([o[1] for o in outs]).reshape(lead)

