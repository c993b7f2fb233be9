"""A simple block-diffusion decoder on token ids (the fast engine builds on the same model calls).

Per block: every position starts as [MASK]; each step runs the block against the cache, and fills the
masked positions whose confidence (max probability) is at least `threshold`, and always the single most
confident one (Fast-dLLM's rule; threshold=1.0 gives one token per step). When no mask is left the
block is committed. The prompt is prefilled as clean blocks; its last partial block becomes the first
generation block, its known tokens given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .diffusion import uniform_partition
from .errors import CloverError
from .model import CloverCache, CloverForBlockDiffusion


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens, cut before the stop token
    forwards: int  # model forward passes, denoising steps and commits together
    steps: int  # denoising steps

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(self.forwards, 1)


@torch.no_grad()
def generate(
    model: CloverForBlockDiffusion,
    prompt_ids: list[int],
    *,
    max_new_tokens: int = 256,
    block_size: int = 16,
    threshold: float = 1.0,
    stop_ids: tuple[int, ...] = (),
) -> GenerationResult:
    if not prompt_ids:
        raise CloverError("empty prompt: give at least one token of text")
    if max_new_tokens < 1:
        raise CloverError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not 0 < threshold <= 1:
        raise CloverError(f"threshold must be in (0, 1], got {threshold}")
    if not 1 <= block_size <= model.config.max_block_size:
        raise CloverError(f"block size {block_size} is outside 1..{model.config.max_block_size}")
    mask_id = model.config.mask_token_id
    stop_ids = tuple(stop_ids) or (model.config.eos_token_id,)
    cache = CloverCache.empty(model.config)
    committed = (len(prompt_ids) // block_size) * block_size
    forwards = 0
    if committed:
        model.prefill(torch.tensor([prompt_ids[:committed]]), uniform_partition(committed, block_size), cache)
        forwards += 1
    carry = list(prompt_ids[committed:])  # known tokens at the start of the first generation block
    generated: list[int] = []
    steps = 0
    while len(generated) < max_new_tokens:
        block = torch.tensor([carry + [mask_id] * (block_size - len(carry))])
        while (block == mask_id).any():
            probs = model.forward_block(block, cache, commit=False).float().softmax(-1)[0]
            forwards += 1
            steps += 1
            confidence, token = probs.max(-1)
            masked = block[0] == mask_id
            confidence = torch.where(masked, confidence, torch.full_like(confidence, -1.0))
            accept = (confidence >= threshold) & masked
            accept[confidence.argmax()] = True
            block[0, accept] = token[accept]
        model.forward_block(block, cache, commit=True)
        forwards += 1
        new = block[0, len(carry) :].tolist()
        carry = []
        for token in new:
            if token in stop_ids or len(generated) >= max_new_tokens:
                return GenerationResult(generated, forwards, steps)
            generated.append(token)
    return GenerationResult(generated, forwards, steps)
