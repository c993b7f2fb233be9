"""Unmasking rules as tensor operations: the threshold rule for a batch of rows, greedy choice with
its confidence, and sampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cloverlm.decoding.params import DecodeParams


def threshold_accept(confidence: torch.Tensor, open_: torch.Tensor, threshold: float | torch.Tensor, last_step) -> torch.Tensor:
    """The threshold rule (Fast-dLLM) over [..., n] blocks: every open position whose confidence is at
    least `threshold`, and always the most confident open one; at the last step (bool, or [...] per
    block) every open position. Blocks with nothing open accept nothing."""
    confidence = torch.where(open_, confidence, torch.full_like(confidence, -1.0))
    accept = open_ & (confidence >= threshold)
    best = F.one_hot(confidence.argmax(-1), confidence.shape[-1]).bool() & open_
    accept = accept | best
    if isinstance(last_step, torch.Tensor):
        return torch.where(last_step[..., None], open_, accept)
    return open_ if last_step else accept


def greedy(logits: torch.Tensor):
    """The most likely token and its probability per position, logits [..., V] (any dtype: the
    normaliser is computed in fp32)."""
    top = logits.max(-1)
    confidence = (top.values.float() - logits.float().logsumexp(-1)).exp()
    return top.indices, confidence


def choose_tokens(logits: torch.Tensor, params: DecodeParams, generator: torch.Generator):
    """Chosen token and its probability per position, logits [n, V]."""
    # Below 1e-6 sampling is greedy in effect, and dividing by a float32 temperature that small gives nan.
    if params.temperature < 1e-6:
        return greedy(logits)
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, probs.gather(-1, tokens[:, None])[:, 0]
