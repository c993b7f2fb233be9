"""The conversion objective (docs/design.md section 7): block diffusion on top of a pretrained causal model.

One training sequence holds the clean stream (prompt and answer, causal, computed once) followed by
noisy copies of the answer's blocks only. Under the shifted convention (section 1a) a block whose
targets are x_s .. x_{s+B-1} is fed as [x_{s-1}, x_s or MASK, ..., x_{s+B-2} or MASK] at positions
s-1 .. s+B-2 and sees the clean positions before s-1. A block draws t ~ U(0, 1) and masks each target
with probability t; slot j is scored when its target is masked, and the last slot always (its target
never appears inside the block). The complementary copy masks exactly the other targets, so every
target is scored once per pair. The clean stream's next-token loss over the answer (the B = 1 case)
comes for free. Answers are padded with end tokens to whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cloverlm.errors import CloverError
from cloverlm.model.layout import NoisyBlocks

CONVERT_BLOCK_SIZES = (4, 8, 16, 32)


@dataclass
class Segment:
    """One example: prompt ids and answer ids. A complete answer ends with the end-of-turn token and is
    padded with more of them to whole blocks; an incomplete one (cut at a length limit) is trimmed to
    whole blocks instead, so that no end token is taught where the text goes on."""

    prompt: list[int]
    answer: list[int]
    complete: bool = True


@dataclass
class ConversionBatch:
    clean_ids: torch.Tensor  # [1, L-1]: the packed sequence but its last token
    noisy: NoisyBlocks
    targets: torch.Tensor  # [N] the token each noisy slot predicts
    scored: torch.Tensor  # [N] bool
    answer_mask: torch.Tensor  # [1, L-1] clean positions whose next token is an answer token
    answer_targets: torch.Tensor  # [M]


def block_partition(length: int, sizes, generator: torch.Generator, overhang: bool = True) -> list[int]:
    """Blocks of sizes drawn from `sizes` until they cover `length` tokens: the last may overhang, or
    with overhang=False only sizes that fit are drawn (`length` a multiple of the smallest size)."""
    partition, covered = [], 0
    while covered < length:
        fitting = list(sizes) if overhang else [s for s in sizes if s <= length - covered]
        size = fitting[int(torch.randint(len(fitting), (1,), generator=generator))]
        partition.append(size)
        covered += size
    return partition


def build_batch(
    segments: list[Segment], end_id: int, mask_id: int, generator: torch.Generator, sizes=CONVERT_BLOCK_SIZES,
    complementary: bool = True,
) -> ConversionBatch:
    """Pack segments into one sequence and draw the noisy answer blocks (deterministic given the generator)."""
    if not segments:
        raise CloverError("a conversion batch needs at least one example")
    ids: list[int] = []
    slot_ids, slot_pos, slot_block, slot_history, slot_target, slot_scored = [], [], [], [], [], []
    answer_flags: list[bool] = []
    block_number = 0
    for segment in segments:
        if not segment.prompt or not segment.answer:
            raise CloverError("every example needs a non-empty prompt and answer")
        if segment.complete:
            partition = block_partition(len(segment.answer), sizes, generator)
            answer = segment.answer + [end_id] * (sum(partition) - len(segment.answer))
        else:
            answer = segment.answer[: len(segment.answer) // min(sizes) * min(sizes)]
            partition = block_partition(len(answer), sizes, generator, overhang=False)
        start = len(ids) + len(segment.prompt)  # absolute position of the first answer token
        ids += segment.prompt + answer
        answer_flags += [False] * len(segment.prompt) + [True] * len(answer)
        s = start
        for size in partition:
            t = float(torch.rand((), generator=generator))
            masked = torch.rand(size, generator=generator) < t
            copies = [masked, ~masked] if complementary else [masked]
            for target_masked in copies:
                target_masked = target_masked.clone()
                target_masked[-1] = True  # the last target is never an input of its block
                for j in range(size):
                    feeds_mask = j > 0 and bool(target_masked[j - 1])
                    slot_ids.append(mask_id if feeds_mask else ids[s - 1 + j])
                    slot_pos.append(s - 1 + j)
                    slot_block.append(block_number)
                    slot_history.append(s - 1)
                    slot_target.append(ids[s + j])
                    slot_scored.append(bool(target_masked[j]))
                block_number += 1
            s += size
    full = torch.tensor(ids)
    tensor = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype)
    # clean position p predicts ids[p + 1]: it is an answer position when ids[p + 1] is
    answer_mask = tensor(answer_flags[1:], torch.bool)
    return ConversionBatch(
        clean_ids=full[None, :-1],
        noisy=NoisyBlocks(tensor(slot_ids)[None], tensor(slot_pos), tensor(slot_block), tensor(slot_history)),
        targets=tensor(slot_target),
        scored=tensor(slot_scored, torch.bool),
        answer_mask=answer_mask[None],
        answer_targets=full[1:][answer_mask],
    )


def autoregressive_loss(model, batch: ConversionBatch):
    """(loss, stats) of the autoregressive peer (a transformers causal LM): the clean answer's
    next-token loss only, on the same examples."""
    device = next(model.parameters()).device
    logits = model(input_ids=batch.clean_ids.to(device)).logits[batch.answer_mask.to(device)]
    targets = batch.answer_targets.to(device)
    nll = F.cross_entropy(logits.float(), targets)
    stats = {"ar_nll": float(nll.detach()), "ar_acc": float((logits.argmax(-1) == targets).float().mean()),
             "tokens": int(batch.clean_ids.shape[1])}  # fmt: skip
    return nll, stats


def conversion_loss(model, batch: ConversionBatch):
    """(loss, stats): cross-entropy at the scored noisy slots plus the clean stream's answer loss."""
    device = next(model.parameters()).device
    noisy = batch.noisy
    noisy = NoisyBlocks(*(t.to(device) for t in (noisy.input_ids, noisy.positions, noisy.block, noisy.history)))
    out = model(
        input_ids=batch.clean_ids.to(device), noisy_blocks=noisy, logits_mask=batch.scored[None].to(device),
        clean_logits_mask=batch.answer_mask.to(device),
    )
    targets = batch.targets[batch.scored].to(device)
    noisy_nll = F.cross_entropy(out.logits.float(), targets)
    ar_nll = F.cross_entropy(out.clean_logits.float(), batch.answer_targets.to(device))
    stats = {
        "noisy_nll": float(noisy_nll.detach()),
        "ar_nll": float(ar_nll.detach()),
        "noisy_acc": float((out.logits.argmax(-1) == targets).float().mean()),
        "ar_acc": float((out.clean_logits.argmax(-1) == batch.answer_targets.to(device)).float().mean()),
        "tokens": int(batch.clean_ids.shape[1] + noisy.input_ids.shape[1]),
    }
    return noisy_nll + ar_nll, stats
