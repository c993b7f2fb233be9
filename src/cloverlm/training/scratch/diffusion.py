"""The block-diffusion objective: per-block noise levels, masking and the weighted loss (the partition rule is model.layout.block_partition).

Shifted convention (docs/design.md section 1a): a sequence x_0 .. x_{L-1} is read as inputs x_0 .. x_{L-2}, and
input position p predicts x_{p+1}. The L-1 input positions are cut into blocks (one random partition
per batch, sizes from a configured set that includes 1). Block b draws t_b ~ U(eps, 1) and each
eligible target of the block is masked with probability t_b; a masked target x_{p+1} appears as
[MASK] at input position p+1 when that position is inside the block, while the block's first slot
always holds its clean token (the last committed one). The block's last slot is always scored: its
target is never an input of the block. The loss is the masked-diffusion ELBO: the sum over scored
targets of -log p / t_b (weight 1 for the always-scored last slot), divided by the number of eligible
targets. With block size 1 every slot is a first and a last slot: next-token cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from cloverlm.errors import CloverError


@dataclass
class NoisedBatch:
    clean_ids: torch.Tensor  # [B, L-1] the clean stream: every token except the last
    noisy_ids: torch.Tensor  # [B, L-1] the noisy stream
    targets: torch.Tensor  # [B, L-1] the token each input position predicts (x_{p+1})
    scored: torch.Tensor  # [B, L-1] bool: positions whose prediction is scored
    weight: torch.Tensor  # [B, L-1] 1/t for masked targets, 1 for the always-scored last slots
    eligible: torch.Tensor  # [B, L-1] bool: targets that may be masked and scored

    def rows(self, rows) -> NoisedBatch:
        return NoisedBatch(*(getattr(self, f.name)[rows] for f in fields(self)))


def block_ends(block_sizes: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] bools: position is the first / last of its block."""
    sizes = torch.tensor(block_sizes)
    ends = sizes.cumsum(0)
    length = int(ends[-1])
    first, last = torch.zeros(length, dtype=torch.bool), torch.zeros(length, dtype=torch.bool)
    first[ends - sizes] = True
    last[ends - 1] = True
    return first.to(device), last.to(device)


def shift_noise(input_ids, masked_targets, block_sizes: list[int], mask_token_id: int):
    """The noisy stream [B, L-1] for targets masked by `masked_targets` [B, L-1]: input position p holds
    [MASK] when its token (the target of p-1) is masked and p is not the first slot of its block."""
    first, _ = block_ends(block_sizes, input_ids.device)
    inputs = input_ids[:, :-1]
    hide = torch.zeros_like(masked_targets)
    hide[:, 1:] = masked_targets[:, :-1]
    hide &= ~first
    return torch.where(hide, torch.full_like(inputs, mask_token_id), inputs)


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
    """Mask each block's eligible targets with its own probability t_b. input_ids, eligible: [B, L];
    block_sizes partition the L-1 input positions.

    t_fixed=1.0 masks every eligible target (the block-size warm-up). complementary=True appends the
    inverted mask as a second sample, so every eligible target is supervised once per pair (last slots
    in both).
    """
    batch, length = input_ids.shape
    if sum(block_sizes) != length - 1:
        raise CloverError(f"block sizes sum to {sum(block_sizes)} but {length} tokens give {length - 1} input positions")
    sizes = torch.tensor(block_sizes)
    block_of = torch.repeat_interleave(torch.arange(len(block_sizes)), sizes)
    if t_fixed is not None:
        t_block = torch.full((batch, len(block_sizes)), float(t_fixed))
    else:
        t_block = eps + (1 - eps) * torch.rand(batch, len(block_sizes), generator=generator)
    t = t_block[:, block_of].to(input_ids.device)
    draw = torch.rand(batch, length - 1, generator=generator).to(input_ids.device)
    target_ok = eligible[:, 1:]
    masked = (draw < t) & target_ok
    if complementary:
        other = (~masked) & target_ok
        input_ids, target_ok = torch.cat([input_ids, input_ids]), torch.cat([target_ok, target_ok])
        masked = torch.cat([masked, other])
        t = torch.cat([t, 1 - t + eps])  # the inverted mask keeps each target with prob 1 - t
    _, last = block_ends(block_sizes, input_ids.device)
    scored = target_ok & (masked | last)
    weight = torch.where(masked, 1 / t, torch.ones_like(t))
    return NoisedBatch(
        clean_ids=input_ids[:, :-1], noisy_ids=shift_noise(input_ids, masked, block_sizes, mask_token_id),
        targets=input_ids[:, 1:], scored=scored, weight=weight, eligible=target_ok,
    )


def diffusion_loss(model, noised: NoisedBatch, block_sizes: list[int]):
    """Returns (loss, aux, stats). loss = sum_scored CE * weight, divided by the eligible targets (the
    ELBO per token)."""
    out = model(noised.clean_ids, noised.noisy_ids, block_sizes, logits_mask=noised.scored)
    targets = noised.targets[noised.scored]
    nll = F.cross_entropy(out.logits.float(), targets, reduction="none")
    denom = noised.eligible.sum().clamp(min=1)
    elbo = (nll * noised.weight[noised.scored]).sum() / denom
    correct = (out.logits.argmax(-1) == targets).float()
    stats = {
        "elbo": elbo.detach(),
        "nll_masked": nll.mean().detach() if nll.numel() else nll.sum().detach(),
        "acc_masked": correct.mean().detach() if correct.numel() else correct.sum().detach(),
        "aux": out.aux_loss.detach(),
        "masked_tokens": int(noised.scored.sum()),
    }
    return elbo, out.aux_loss, stats
