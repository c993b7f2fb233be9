"""The bidirectional local convolution at block boundaries (docs/design.md): a centred depthwise conv over
every block of a training sequence at once, where a tap before the block's start reads the clean (committed)
history, a tap inside the block reads the stream being denoised, and a tap past the block's end reads zero:
the future is unknown.

`block_conv_reference` is the rule written tap by tap. `block_conv` computes the same sum as one plain
depthwise conv of the stream and then corrects only the rows a block boundary touches: a tap that read past
its block's end is taken out, and a tap that read the stream before its block's start is swapped for the
clean history. A boundary touches at most `radius` rows of a block per tap, so the corrections are small
gathers. The tap-by-tap form pads and slices the whole sequence for each tap and each stream; its backward
allocates and fills a zero tensor of the padded sequence for every slice (aten::fill_ alone was 21% of a
graft stage-1 step in a 1-thread CPU profile: models/README.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_conv_reference(stream, clean, weight, block_start, block_end):
    """stream, clean [B, L, C]; weight [C, 1, 2r + 1] (tap j + r weighs the row j places away); block_start,
    block_end [L]: each position's block (model/layout.py's BlockLayout). Returns the conv before its
    activation, [B, L, C]."""
    r = weight.shape[-1] // 2
    length = stream.shape[1]
    pad = lambda x: F.pad(x, (0, 0, r, r))
    stream_p, clean_p = pad(stream), pad(clean)
    positions = torch.arange(length, device=stream.device)
    out = 0
    for j in range(-r, r + 1):
        source = positions + j
        from_history = (source < block_start)[None, :, None]
        inside = (source < block_end)[None, :, None]
        rows = torch.where(from_history, clean_p[:, r + j : r + j + length], stream_p[:, r + j : r + j + length])
        rows = rows * inside.to(rows.dtype)
        out = out + rows * weight[:, 0, j + r].to(rows.dtype)
    return out


def boundary_rows(block_sizes: list[int], r: int, device=None) -> dict[int, torch.Tensor]:
    """For each tap j != 0 (|j| <= r), the positions whose tap j a block boundary changes: j > 0, those that
    read past their block's end (the sequence's own end is padding, zero anyway); j < 0, those that read the
    history before their block's start (the sequence's own start is padding). Built on the host from the
    partition, so a GPU never waits for it."""
    length = sum(block_sizes)
    rows: dict[int, list[int]] = {j: [] for j in range(-r, r + 1) if j}
    start = 0
    for size in block_sizes:
        end = start + size
        for j in range(1, r + 1):
            rows[j] += range(max(start, end - j), min(end, length - j))
            rows[-j] += range(max(start, j), min(end, start + j))
        start = end
    return {j: torch.tensor(at, dtype=torch.long, device=device) for j, at in rows.items()}


def _shift_add(out, x, w, j: int) -> None:
    """out[:, t] += x[:, t + j] * w for every t where t + j is in the sequence, in place."""
    length = x.shape[1]
    if abs(j) >= length:  # a tap longer than the sequence reads only padding
        return
    if j >= 0:
        out[:, : length - j].addcmul_(x[:, j:], w)
    else:
        out[:, -j:].addcmul_(x[:, : length + j], w)


class _BlockConv(torch.autograd.Function):
    """The conv as shifted multiply-adds into one output, in place, and the same for its backward: no padded
    copies, no transposes, few allocations. Every new tensor is memory the CPU must fault in; on a
    training step whose heap is returned after each step (training/loop.py) that costs more than the
    arithmetic."""

    @staticmethod
    def forward(ctx, stream, clean, weight, rows: dict, two_streams: bool):
        w = weight[:, 0].to(stream.dtype)  # [C, 2r + 1]
        r = w.shape[1] // 2
        out = stream * w[:, r]
        for j in range(-r, r + 1):
            if j:
                _shift_add(out, stream, w[:, j + r], j)
        for j, at in rows.items():
            if len(at) and (j > 0 or two_streams):
                out.index_add_(1, at, stream[:, at + j] * w[:, j + r], alpha=-1)
                if j < 0:
                    out.index_add_(1, at, clean[:, at + j] * w[:, j + r])
        ctx.save_for_backward(stream, clean if two_streams else None, weight)
        ctx.rows, ctx.two_streams = rows, two_streams
        return out

    @staticmethod
    def backward(ctx, grad):
        stream, clean, weight = ctx.saved_tensors
        rows, two_streams = ctx.rows, ctx.two_streams
        w = weight[:, 0].to(grad.dtype)
        r = w.shape[1] // 2
        length = grad.shape[1]
        grad_stream = grad_clean = grad_weight = None
        needs_stream, needs_clean, needs_weight = ctx.needs_input_grad[:3]
        if needs_stream:  # the transposed conv: tap j sends row t's gradient to row t + j
            grad_stream = grad * w[:, r]
            for j in range(-r, r + 1):
                if j:
                    _shift_add(grad_stream, grad, w[:, j + r], -j)
        if two_streams and needs_clean:
            grad_clean = torch.zeros_like(clean)
        if needs_weight:
            acc = torch.promote_types(grad.dtype, torch.float32)  # bf16 gradients summed in fp32
            grad_weight = torch.zeros_like(weight, dtype=acc)
            product = torch.empty_like(grad)
            for j in range(-r, r + 1):
                lo, hi = max(0, -j), length - max(0, j)
                if hi <= lo:
                    continue
                torch.mul(grad[:, lo:hi], stream[:, lo + j : hi + j], out=product[:, lo:hi])
                grad_weight[:, 0, j + r] = product[:, lo:hi].sum((0, 1), dtype=grad_weight.dtype)
        for j, at in rows.items():
            if not len(at) or (j < 0 and not two_streams):
                continue
            g_rows = grad[:, at]
            g = g_rows * w[:, j + r]
            if grad_stream is not None:
                grad_stream.index_add_(1, at + j, g, alpha=-1)
            if grad_clean is not None and j < 0:
                grad_clean.index_add_(1, at + j, g)
            if grad_weight is not None:
                grad_weight[:, 0, j + r] -= (g_rows * stream[:, at + j]).sum((0, 1), dtype=grad_weight.dtype)
                if j < 0:
                    grad_weight[:, 0, j + r] += (g_rows * clean[:, at + j]).sum((0, 1), dtype=grad_weight.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_stream, grad_clean, grad_weight, None, None


def block_conv(stream, clean, weight, rows: dict[int, torch.Tensor]):
    """`block_conv_reference`'s result, given the partition's `boundary_rows`. `clean` may be `stream` itself
    (the clean stream, prefill): then no tap has its source swapped."""
    return _BlockConv.apply(stream, clean, weight, rows, clean is not stream)
