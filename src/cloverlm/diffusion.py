"""The block-diffusion objective: partitions, per-block noise levels, masking and the weighted loss.

A sequence of L tokens is cut into blocks (one random partition per batch, sizes from a configured set
that includes 1). Block b draws t_b ~ U(eps, 1) and each eligible token of the block is replaced by
[MASK] with probability t_b. The loss is the masked-diffusion ELBO: the sum over masked positions of
-log p(x_0 | x_t block, history) / t_b, divided by the number of eligible tokens. With block size 1 and
t = 1 every token is masked and the loss is next-token cross-entropy: autoregression is a special case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import CloverError


def sample_partition(length: int, sizes: list[int], generator: torch.Generator, chunk: int = 64) -> list[int]:
    """A random partition of `length` into block sizes drawn uniformly from `sizes`.

    Blocks never straddle a multiple of `chunk`, so chunks stay full (the chunked kernels' best case).
    Size 1 must be in `sizes` so that every remainder can be filled.
    """
    if 1 not in sizes:
        raise CloverError(f"block sizes {sizes} must include 1")
    if any(s > chunk or chunk % s for s in sizes):
        raise CloverError(f"block sizes {sizes} must divide the chunk of {chunk} tokens")
    partition: list[int] = []
    position = 0
    while position < length:
        room = min(chunk - position % chunk, length - position)
        fitting = [s for s in sizes if s <= room]
        choice = fitting[int(torch.randint(len(fitting), (1,), generator=generator))]
        partition.append(choice)
        position += choice
    return partition


def uniform_partition(length: int, block_size: int) -> list[int]:
    if block_size < 1 or length % block_size:
        raise CloverError(f"block size {block_size} does not divide the sequence length {length}")
    return [block_size] * (length // block_size)


@dataclass
class NoisedBatch:
    noisy_ids: torch.Tensor  # x_t [B, L]
    masked: torch.Tensor  # [B, L] bool: positions replaced by [MASK] (the scored ones)
    t: torch.Tensor  # [B, L] the noise level of each position's block


def mask_blocks(
    input_ids,
    eligible,
    block_sizes: list[int],
    mask_token_id: int,
    generator: torch.Generator,
    *,
    eps: float = 1e-3,
    t_fixed: float | None = None,
    complementary: bool = False,
) -> NoisedBatch:
    """Mask each block's eligible tokens with its own probability t_b.

    t_fixed=1.0 masks every eligible token (the block-size warm-up). complementary=True appends the
    inverted mask as a second sample, so every eligible token is supervised exactly once per pair.
    """
    batch, length = input_ids.shape
    sizes = torch.tensor(block_sizes)
    block_of = torch.repeat_interleave(torch.arange(len(block_sizes)), sizes)
    if t_fixed is not None:
        t_block = torch.full((batch, len(block_sizes)), float(t_fixed))
    else:
        t_block = eps + (1 - eps) * torch.rand(batch, len(block_sizes), generator=generator)
    t = t_block[:, block_of].to(input_ids.device)
    draw = torch.rand(batch, length, generator=generator).to(input_ids.device)
    masked = (draw < t) & eligible
    if complementary:
        other = (~masked) & eligible
        input_ids = torch.cat([input_ids, input_ids])
        masked = torch.cat([masked, other])
        t = torch.cat([t, 1 - t + eps])  # the inverted mask keeps each token with prob 1 - t
    noisy = torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)
    return NoisedBatch(noisy_ids=noisy, masked=masked, t=t)


def diffusion_loss(model, input_ids, eligible, noised: NoisedBatch, block_sizes: list[int]):
    """Returns (loss, stats). loss = sum_masked CE / t, divided by the eligible tokens (the ELBO per token)."""
    if noised.noisy_ids.shape[0] != input_ids.shape[0]:  # complementary pairs
        input_ids = torch.cat([input_ids, input_ids])
        eligible = torch.cat([eligible, eligible])
    out = model(input_ids, noised.noisy_ids, block_sizes, logits_mask=noised.masked)
    targets = input_ids[noised.masked]
    nll = F.cross_entropy(out.logits.float(), targets, reduction="none")
    denom = eligible.sum().clamp(min=1)
    elbo = (nll / noised.t[noised.masked]).sum() / denom
    correct = (out.logits.argmax(-1) == targets).float()
    stats = {
        "elbo": elbo.detach(),
        "nll_masked": nll.mean().detach() if nll.numel() else nll.sum().detach(),
        "acc_masked": correct.mean().detach() if correct.numel() else correct.sum().detach(),
        "aux": out.aux_loss.detach(),
        "masked_tokens": int(noised.masked.sum()),
    }
    return elbo, out.aux_loss, stats
