"""The unmasking rules: which masked targets of each row a denoising step decides, and as what.

`unmask(rows, logits)` is the one entry point; it hands each row to its rule:

* plain rows (greedy threshold decoding without grammar or slots) are decided together, on the model's
  device; only the chosen ids and their confidences come to the host;
* rows under a grammar (`_constrained`) decide from the leftmost undecided target on, each choice under
  the grammar state after the ones before it (docs/design.md, 4b);
* every other row (sampling, low_confidence, slots) on the host, one by one (`_general`).

The tensor rules (`threshold_accept`, `greedy`, `choose_tokens`) are shared by all three.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cloverlm.decoding.params import DecodeParams
from cloverlm.decoding.row import DecodeRow

GREEDY_BELOW = 1e-6  # temperatures below this decode greedily (dividing by them in float32 gives nan)


def is_greedy(params: DecodeParams) -> bool:
    return params.temperature < GREEDY_BELOW


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
    if is_greedy(params):
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


def is_plain(row: DecodeRow) -> bool:
    """Rows the batched threshold rule decides: greedy, without grammar or slots."""
    params = row.params
    return (params.strategy == "threshold" and is_greedy(params)
            and row.request.constraint is None and row.allowed is None)


def unmask(rows: list[DecodeRow], logits: torch.Tensor, batched: bool = True, lookahead: bool = False) -> list[bool]:
    """One denoising step for every row, from its logits ([rows, n, V], on the model's device, [MASK]
    already excluded). Returns, per row, whether its block is now decided. batched=False decides plain
    rows one by one on the host (the reference the batched rule is tested against); lookahead holds
    confident choices right of a grammar's reach, unchecked (`_constrained`)."""
    greedy_rows = [i for i, row in enumerate(rows) if is_greedy(row.params) and row.allowed is None]
    tokens, confidence = {}, {}  # row index -> the greedy choice of every target, computed once on the device
    if greedy_rows:
        chosen, conf = greedy(logits[greedy_rows])
        tokens, confidence = dict(zip(greedy_rows, chosen.cpu())), dict(zip(greedy_rows, conf.cpu()))
    plain = [i for i, row in enumerate(rows) if batched and is_plain(row)]
    if plain:
        _threshold_batch([rows[i] for i in plain], torch.stack([tokens[i] for i in plain]),
                         torch.stack([confidence[i] for i in plain]))
    for index, row in enumerate(rows):
        if index in plain:
            continue
        if row.request.constraint is not None:  # the batch's width is the widest block: cut to this one's
            width = len(row.block)
            row_tokens, row_confidence = tokens.get(index), confidence.get(index)
            if row_tokens is not None:
                row_tokens, row_confidence = row_tokens[:width], row_confidence[:width]
            _constrained(row, logits[index], row_tokens, row_confidence, lookahead)
        else:
            _general(row, logits[index, : len(row.block)].float().cpu())
    return [row.end_step() for row in rows]


def _threshold_batch(rows: list[DecodeRow], tokens: torch.Tensor, confidence: torch.Tensor) -> None:
    """The threshold rule for many rows at once, from their greedy choices [rows, n]. The same tokens as
    `_general` (tested)."""
    open_ = torch.zeros(tokens.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        n = len(row.block)
        open_[i, :n] = (row.block == row.mask_id) & row.eligible(tokens[i, :n])
    thresholds = torch.tensor([[row.params.threshold] for row in rows], dtype=confidence.dtype)
    last = torch.tensor([row.last_step() for row in rows])
    accept = threshold_accept(confidence, open_, thresholds, last)
    for i, row in enumerate(rows):
        n = len(row.block)
        row.accept(tokens[i, :n], accept[i, :n])


def _general(row: DecodeRow, logits: torch.Tensor) -> None:
    """Any rule, on the host: threshold or low_confidence, greedy or sampled, with or without slots."""
    params = row.params
    if row.allowed is not None:
        logits = logits.masked_fill(~row.allowed, float("-inf"))
    masked = row.block == row.mask_id
    tokens, confidence = choose_tokens(logits, params, row.generator)
    if params.strategy == "threshold":
        accept = threshold_accept(confidence, masked & row.eligible(tokens), params.threshold, row.last_step())
    else:
        confidence = torch.where(masked, confidence, torch.full_like(confidence, -1.0))
        accept = torch.zeros_like(masked)
        accept[confidence.topk(min(row.transfer_count(), int(masked.sum()))).indices] = True
    distinct = row.allowed is not None and row.request.slots.distinct
    if distinct:
        accept = _distinct(row, tokens, confidence, accept)
    row.accept(tokens, accept)
    if distinct:
        row.keep_assignable()


def _distinct(row: DecodeRow, tokens: torch.Tensor, confidence: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """Slots with distinct answers: the slots accepted in this step, most confident first, keep their
    token while every open slot can still get a different one; the others stay masked. The first
    always keeps it (open slots are kept to assignable options), so each step unmasks a slot."""
    keep = torch.zeros_like(accept)
    fixed: dict[int, int] = {}
    choices = row.assignable_choices()
    for position in sorted(accept.nonzero()[:, 0].tolist(), key=lambda p: -float(confidence[p])):
        token = int(tokens[position])
        if token in choices.get(position, ()):
            keep[position] = True
            fixed[position] = token
            choices = row.assignable_choices(fixed)
    return keep


def _constrained(row: DecodeRow, logits: torch.Tensor, tokens: torch.Tensor | None, confidence: torch.Tensor | None,
                 lookahead: bool) -> None:
    """Decide the leftmost run of undecided targets, each under the grammar state after the ones before
    it; forced tokens are filled in between at no cost.

    A grammar's mask costs far more than a forward's share per token, so a greedy row first asks the
    grammar whether the unconstrained choice (`tokens`, `confidence`) may come next: if it may, it is
    also the choice under the mask, with a confidence at least as high, and passes the rule where the
    unconstrained one does. Only a target that fails that check needs its mask: the same tokens as
    masking every target (tested), at about one mask per row and step.

    With lookahead (greedy threshold decoding), targets right of where the run stops whose
    unconstrained choice passes the threshold hold it, unchecked: the model reads them in the next
    step, and when the run reaches one it stays if the grammar allows it there, else is decided anew."""
    params, constraint, block = row.params, row.request.constraint, row.block
    threshold_rule = params.strategy == "threshold"
    last_step = row.last_step()
    budget = len(block) if threshold_rule else row.transfer_count()
    position = int(((block == row.mask_id) | row.unchecked).nonzero()[0])
    accepted = 0
    while position < len(block) and accepted < budget:
        must_accept = accepted == 0 or not threshold_rule or last_step
        if row.unchecked[position]:
            if constraint.allows(int(block[position])):
                row.decide(position, int(block[position]))
                accepted += 1
            else:
                row.remask(position)
        if block[position] == row.mask_id:
            if tokens is not None and (must_accept or confidence[position] >= params.threshold) \
                    and constraint.allows(int(tokens[position])):
                token = int(tokens[position])
            else:
                scores = logits[position].float().cpu()
                masked = scores.masked_fill(~constraint.allowed(scores=scores)[: logits.shape[-1]], float("-inf"))
                token = choose_tokens(masked[None], params, row.generator)[0].item()
                if not must_accept:
                    # Near the budget a grammar narrows its mask to a short ending, often one token: that
                    # narrows the choice, it does not make the model sure of it. The rule reads the
                    # confidence under the grammar alone (a date cut to "202" at B = 16 otherwise).
                    own = scores.masked_fill(~constraint.allowed(within_budget=False)[: logits.shape[-1]], float("-inf"))
                    if own.softmax(-1)[token].item() < params.threshold:
                        break
            row.decide(position, token)
            accepted += 1
        token = int(block[position])
        if token in row.stops:
            row.stop_at(position)
            return
        constraint.advance(token)
        position = row.fill_forced(position + 1)
    if lookahead and threshold_rule and tokens is not None and not last_step:
        ahead = torch.arange(len(block)) > position
        row.hold(tokens, ahead & (block == row.mask_id) & (confidence >= params.threshold))
