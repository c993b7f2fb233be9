"""The conversion objective (docs/design.md section 7): block diffusion on top of a pretrained causal model.

One training sequence holds the clean stream (prompt and answer, causal, computed once) followed by
noisy copies of the answer's blocks only. Under the shifted convention (section 1a) a block whose
targets are x_s .. x_{s+B-1} is fed as [x_{s-1}, x_s or MASK, ..., x_{s+B-2} or MASK] at positions
s-1 .. s+B-2 and sees the clean positions before s-1. A block draws t ~ U(0, 1) and masks each target
with probability t; slot j is scored when its target is masked, and the last slot always (its target
never appears inside the block). The complementary copy masks exactly the other targets, so every
target is scored once per pair; a block may draw several pairs (`draws`). The clean stream's
next-token loss over the answer (the B = 1 case) comes for free. Answers are padded with end tokens
to whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cloverlm.errors import CloverError
from cloverlm.model.layout import NoisyBlocks, NoisySegment, block_partition

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
    """R packed rows, each padded to the same clean length L-1 and noisy length N. Padding is never scored
    and never seen by a real position: clean padding follows the row's tokens (causal), and noisy padding
    slots form a block of their own with no clean history."""

    clean_ids: torch.Tensor  # [R, L-1]: each packed row except its last token
    noisy: NoisyBlocks  # input_ids, positions, block, history: [R, N]
    targets: torch.Tensor  # [R, N] the token each noisy slot predicts
    scored: torch.Tensor  # [R, N] bool
    answer_mask: torch.Tensor  # [R, L-1] clean positions whose next token is an answer token
    answer_targets: torch.Tensor  # [M], row-major over answer_mask
    clean_lengths: torch.Tensor  # [R] real clean positions of each row
    # (scored noisy slots, answer positions) a loss is averaged over: a row apart (rows_apart) keeps its
    # whole batch's, so that the rows' losses and gradients add up to the batch's; None: this batch's own
    loss_counts: tuple[int, int] | None = None

    def token_counts(self) -> dict[str, int]:
        """Real (unpadded) tokens the forward computes: clean positions and noisy slots."""
        return {"clean": int(self.clean_lengths.sum()), "noisy": int((self.noisy.block >= 0).sum())}

    def counts(self) -> tuple[int, int]:
        return self.loss_counts or (int(self.scored.sum()), int(self.answer_mask.sum()))

    def rows_apart(self) -> list[ConversionBatch]:
        """Each row as a batch of its own, cut to its real lengths (no padding computed), averaging its
        losses over the whole batch's counts: the sum of the rows' losses is the batch's loss."""
        counts, parts = self.counts(), []
        answers = self.answer_mask.sum(1).tolist()
        for row, (length, slots) in enumerate(zip(self.clean_lengths.tolist(), (self.noisy.block >= 0).sum(1).tolist())):
            first = sum(answers[:row])
            noisy = self.noisy
            per_row = (t[row : row + 1, :slots] if t.dim() == 2 else t[:slots] for t in (noisy.positions, noisy.block, noisy.history))
            parts.append(ConversionBatch(
                clean_ids=self.clean_ids[row : row + 1, :length],
                noisy=NoisyBlocks(noisy.input_ids[row : row + 1, :slots], *per_row,
                                  segments=None if noisy.segments is None else [noisy.segments[row]]),
                targets=self.targets[row : row + 1, :slots], scored=self.scored[row : row + 1, :slots],
                answer_mask=self.answer_mask[row : row + 1, :length],
                answer_targets=self.answer_targets[first : first + answers[row]],
                clean_lengths=self.clean_lengths[row : row + 1], loss_counts=counts,
            ))  # fmt: skip
        return parts


@dataclass
class _Row:
    """One packed row as lists, before padding."""

    ids: list[int] = field(default_factory=list)
    answer_flags: list[bool] = field(default_factory=list)
    slot_ids: list[int] = field(default_factory=list)
    slot_pos: list[int] = field(default_factory=list)
    slot_block: list[int] = field(default_factory=list)
    slot_history: list[int] = field(default_factory=list)
    slot_target: list[int] = field(default_factory=list)
    slot_scored: list[bool] = field(default_factory=list)
    example_ends: list[int] = field(default_factory=list)  # one past each example's last noisy slot


def _pack_row(segments: list[Segment], end_id: int, mask_id: int, generator, sizes, complementary: bool, draws: int) -> _Row:
    if not segments:
        raise CloverError("a conversion batch row needs at least one example")
    row, block_number = _Row(), 0
    for segment in segments:
        if not segment.prompt or not segment.answer:
            raise CloverError("every example needs a non-empty prompt and answer")
        if segment.complete:
            partition = block_partition(len(segment.answer), sizes, generator)
            answer = segment.answer + [end_id] * (sum(partition) - len(segment.answer))
        else:
            answer = segment.answer[: len(segment.answer) // min(sizes) * min(sizes)]
            partition = block_partition(len(answer), sizes, generator, overhang=False)
        start = len(row.ids) + len(segment.prompt)  # absolute position of the first answer token
        row.ids += segment.prompt + answer
        row.answer_flags += [False] * len(segment.prompt) + [True] * len(answer)
        ids, s = row.ids, start
        for size in partition:
            copies = []
            for _ in range(draws):
                t = float(torch.rand((), generator=generator))
                masked = torch.rand(size, generator=generator) < t
                copies += [masked, ~masked] if complementary else [masked]
            for target_masked in copies:
                target_masked = target_masked.clone()
                target_masked[-1] = True  # the last target is never an input of its block
                flags = target_masked.tolist()
                for j in range(size):
                    row.slot_ids.append(mask_id if j > 0 and flags[j - 1] else ids[s - 1 + j])
                row.slot_pos += range(s - 1, s - 1 + size)
                row.slot_block += [block_number] * size
                row.slot_history += [s - 1] * size
                row.slot_target += ids[s : s + size]
                row.slot_scored += flags
                block_number += 1
            s += size
        row.example_ends.append(len(row.slot_ids))
    return row


# What one more attention call costs, in score-matrix entries (measured, scripts/train_throughput.py):
# neighbouring examples share a segment when their separate calls would cost more than the merged one.
SEGMENT_CALL_COST = 64 * 1024


def noisy_segments(row: _Row) -> list[NoisySegment]:
    """The row's noisy slots as segments of whole examples, each with the mask it attends through."""
    spans, start = [], 0
    for end in row.example_ends:
        if end > start:
            spans.append((start, end))
        start = end

    def cost(a: int, b: int) -> int:
        return (b - a) * (max(row.slot_history[a:b]) + b - a)

    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and cost(merged[-1][0], b) <= cost(*merged[-1]) + cost(a, b) + SEGMENT_CALL_COST:
            a = merged.pop()[0]
        merged.append((a, b))
    segments = []
    for a, b in merged:
        history = torch.tensor(row.slot_history[a:b])
        block = torch.tensor(row.slot_block[a:b])
        clean_keys = int(history.max())
        sees_clean = torch.arange(clean_keys)[None, :] < history[:, None]
        mask = torch.cat([sees_clean, block[:, None] == block[None, :]], dim=1)
        segments.append(NoisySegment(a, b, clean_keys, mask))
    return segments


def padded_length(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`: a few fixed shapes, so that kernels plan once."""
    return -(-length // multiple) * multiple


def build_batch(
    rows: list[list[Segment]], end_id: int, mask_id: int, generator: torch.Generator, sizes=CONVERT_BLOCK_SIZES,
    complementary: bool = True, pad_multiple: int = 1, segmented: bool = False, draws: int = 1,
) -> ConversionBatch:
    """Pack each row's segments into one sequence, draw the noisy answer blocks (deterministic given the
    generator, row after row) and pad every row to a common clean and noisy length, each rounded up to
    `pad_multiple`. Padding changes no loss: it is neither scored nor seen by a real position.

    segmented=True adds the noisy stream's segments (NoisyBlocks.segments): the same loss and gradients
    as the dense mask, at the cost of what it allows (the CPU's path).

    draws > 1 draws each block's mask that many times (each with its complementary copy): more noisy
    slots per clean forward, whose cost (a long prompt, computed once) they share."""
    if not rows:
        raise CloverError("a conversion batch needs at least one row")
    if draws < 1:
        raise CloverError(f"noisy draws per block must be at least 1, got {draws}")
    packed = [_pack_row(segments, end_id, mask_id, generator, sizes, complementary, draws) for segments in rows]
    clean_length = padded_length(max(len(r.ids) - 1 for r in packed), pad_multiple)
    noisy_length = padded_length(max(len(r.slot_ids) for r in packed), pad_multiple)

    def stack(values, length, fill, dtype=torch.long):
        return torch.tensor([list(v) + [fill] * (length - len(v)) for v in values], dtype=dtype)

    # clean position p predicts ids[p + 1]: it is an answer position when ids[p + 1] is
    clean_ids = stack([r.ids[:-1] for r in packed], clean_length, end_id)
    answer_mask = stack([r.answer_flags[1:] for r in packed], clean_length, False, torch.bool)
    next_ids = stack([r.ids[1:] for r in packed], clean_length, end_id)
    return ConversionBatch(
        clean_ids=clean_ids,
        noisy=NoisyBlocks(
            stack([r.slot_ids for r in packed], noisy_length, end_id),
            stack([r.slot_pos for r in packed], noisy_length, 0),
            stack([r.slot_block for r in packed], noisy_length, -1),  # padding: a block of its own
            stack([r.slot_history for r in packed], noisy_length, 0),  # that sees no clean position
            segments=[noisy_segments(r) for r in packed] if segmented else None,
        ),
        targets=stack([r.slot_target for r in packed], noisy_length, end_id),
        scored=stack([r.slot_scored for r in packed], noisy_length, False, torch.bool),
        answer_mask=answer_mask,
        answer_targets=next_ids[answer_mask],
        clean_lengths=torch.tensor([len(r.ids) - 1 for r in packed]),
    )


def _mean(values: torch.Tensor, count: int) -> torch.Tensor:
    return values.sum() / max(count, 1)


def autoregressive_loss(model, batch: ConversionBatch):
    """(loss, stats) of the autoregressive peer (a transformers causal LM): the clean answer's
    next-token loss only, on the same examples."""
    device = next(model.parameters()).device
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    hidden = causal_lm.model(input_ids=batch.clean_ids.to(device)).last_hidden_state
    logits = causal_lm.lm_head(hidden[batch.answer_mask.to(device)])  # the scored positions only
    targets = batch.answer_targets.to(device)
    answers = batch.counts()[1]
    nll = _mean(F.cross_entropy(logits.float(), targets, reduction="none"), answers)
    stats = {"ar_nll": float(nll.detach()), "ar_acc": float(_mean((logits.argmax(-1) == targets).float(), answers)),
             "tokens": batch.token_counts()["clean"]}  # fmt: skip
    return nll, stats


def conversion_loss(model, batch: ConversionBatch, certainty_weight: float = 0.0):
    """(loss, stats): cross-entropy at the scored noisy slots plus the clean stream's answer loss, each
    averaged over the batch's counts (ConversionBatch.counts: a row apart adds its share).

    certainty_weight > 0 adds certainty forcing (dParallel): the mean entropy of the noisy predictions
    that are already right, so that the model grows confident where it is correct and the threshold rule
    commits more tokens per step, without pushing it towards any other answer (a whole batch only: its
    mean is over the right predictions of the batch)."""
    if certainty_weight > 0 and batch.loss_counts is not None:
        raise CloverError("certainty forcing averages over the whole batch: do not split it into rows")
    device = next(model.parameters()).device
    noisy = batch.noisy.to(device)
    out = model(
        input_ids=batch.clean_ids.to(device), noisy_blocks=noisy, logits_mask=batch.scored.to(device),
        clean_logits_mask=batch.answer_mask.to(device),
    )
    targets = batch.targets[batch.scored].to(device)
    answer_targets = batch.answer_targets.to(device)
    scored, answers = batch.counts()
    logits = out.logits.float()
    noisy_nll = _mean(F.cross_entropy(logits, targets, reduction="none"), scored)
    ar_nll = _mean(F.cross_entropy(out.clean_logits.float(), answer_targets, reduction="none"), answers)
    right = logits.argmax(-1) == targets
    counts = batch.token_counts()
    stats = {
        "noisy_nll": float(noisy_nll.detach()),
        "ar_nll": float(ar_nll.detach()),
        "noisy_acc": float(_mean(right.float(), scored)),
        "ar_acc": float(_mean((out.clean_logits.argmax(-1) == answer_targets).float(), answers)),
        "tokens": counts["clean"] + counts["noisy"],
    }
    loss = noisy_nll + ar_nll
    if certainty_weight > 0:
        log_probs = logits[right].log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean() if bool(right.any()) else logits.new_zeros(())
        stats["certainty_entropy"] = float(entropy.detach())
        loss = loss + certainty_weight * entropy
    return loss, stats
