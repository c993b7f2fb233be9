"""What a request asks of the engine (DecodeParams: every decoding default, written once, and its
validation; Request, Slots, Constraint) and what it gets back (Completion, BlockRecord)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cloverlm.errors import CloverError
from cloverlm.model.config import MEMORY

STRATEGIES = ("threshold", "low_confidence")
AUTO = "auto"
# How many requests one engine decodes in a batch, unless its owner says otherwise (engine, server, cli).
MAX_BATCH_SIZE = 16


@dataclass
class DecodeParams:
    max_new_tokens: int = 256
    block_size: int | str = 16  # or "auto": chosen per block by the model's calibration head
    threshold: float = 0.9
    max_steps: int | None = None  # denoising steps per block before the rest is filled at once (None: block size)
    strategy: str = "threshold"
    steps: int | None = None  # low_confidence: steps per block (None: block size)
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    # Fill masked slots with a prompt-lookup draft before each step (cloverlm.decoding.draft); the threshold rule
    # still accepts or rejects every slot.
    draft: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # Called with the generated tokens after every block; returns how many to keep when a stop
    # (e.g. a stop string) was reached, else None.
    stop: Callable[[list[int]], int | None] | None = None

    def validate(self, max_block_size: int) -> None:
        if self.max_new_tokens < 1:
            raise CloverError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.block_size != AUTO and (
            not isinstance(self.block_size, int) or not 1 <= self.block_size <= max_block_size
        ):
            raise CloverError(f"block size {self.block_size!r} is outside 1..{max_block_size} (the model's limit)")
        if not 0 < self.threshold <= 1:
            raise CloverError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.strategy not in STRATEGIES:
            raise CloverError(f"unknown strategy '{self.strategy}'; choose from: {', '.join(STRATEGIES)}")
        if self.draft and self.strategy != "threshold":
            raise CloverError("drafts are accepted by the threshold rule: use strategy 'threshold' with draft=True")
        for name in ("max_steps", "steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise CloverError(f"{name} must be at least 1, got {value}")
        if self.temperature < 0:
            raise CloverError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise CloverError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise CloverError(f"top_p must be in (0, 1], got {self.top_p}")


def drafts_supported(config) -> bool:
    """Whether a model may decode with drafts: only attention layers (a memory layer's bidirectional conv
    would show a position the draft of its own target)."""
    return MEMORY not in config.layer_types


class Constraint(Protocol):
    """The grammar state of one request, advanced over the tokens it generates (in order)."""

    def allowed(self, within_budget: bool = True, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Bool [vocab] of the tokens that may come next; never empty (a finished grammar allows its end
        tokens, which should be stop tokens of the request). within_budget=False: without the narrowing
        near the end of the budget (`limit`), the same where a grammar has none. scores: the model's
        [vocab] scores, which a grammar may use to decide which tokens to check near that end."""
        ...

    def allows(self, token: int) -> bool:
        """Whether `token` may come next: `allowed()[token]`, cheaper where the grammar can tell. Near the
        end of its budget (`limit`) a grammar may allow fewer tokens in `allowed` than `allows` accepts:
        the next of a short ending, where `allows` judges the token asked about."""
        ...

    def limit(self, tokens: int) -> None:
        """The answer has at most `tokens` tokens: a grammar that can close within them does."""
        ...

    def finished(self) -> bool:
        """Whether the tokens so far are a complete answer (an end token may follow)."""
        ...

    def advance(self, token: int) -> None:
        """Consume one generated token (one that `allowed` permitted)."""
        ...

    def forced(self) -> list[int]:
        """The tokens the grammar fixes from here on, whatever the model would say (may be empty)."""
        ...


@dataclass
class Slots:
    """An answer of fixed layout, decoded as one block: `layout` holds token ids, None where the model fills
    in, and `options` the token ids allowed at each None, in order."""

    layout: list[int | None]
    options: list[list[int]]
    distinct: bool = False  # no two slots take the same token (e.g. one zone per drone)


def distinct_choices(options: Sequence[Iterable[int]]) -> tuple[list[set[int]], list[int]]:
    """Slots that must take different tokens, each one of its options: (per slot, the options that some
    complete assignment gives it; []) or, where no complete assignment exists (Hall's condition fails),
    ([], the indices of slots that share fewer options than they are). The engine keeps each open slot
    to these choices, so the slot it unmasks first is always assignable and a distinct block cannot
    stall: its forwards stay <= its slots."""
    sets = [set(o) for o in options]
    slot_of: dict[int, int] = {}  # token -> slot, a maximum matching (Kuhn's augmenting paths)

    def augment(slot: int, seen: set[int]) -> bool:
        for token in sets[slot]:
            if token not in seen:
                seen.add(token)
                if token not in slot_of or augment(slot_of[token], seen):
                    slot_of[token] = slot
                    return True
        return False

    for slot in range(len(sets)):
        seen: set[int] = set()
        if not augment(slot, seen):  # the slots reached hold only the tokens seen: one too few
            return [], sorted({slot} | {slot_of[t] for t in seen})
    token_of = {slot: token for token, slot in slot_of.items()}
    reach, frees = [], []  # per slot: slots reachable by alternating paths; whether a free token is
    for start in range(len(sets)):
        seen_slots, stack, free = {start}, [start], False
        while stack:
            slot = stack.pop()
            for token in sets[slot] - {token_of[slot]}:
                if token not in slot_of:
                    free = True
                elif slot_of[token] not in seen_slots:
                    seen_slots.add(slot_of[token])
                    stack.append(slot_of[token])
        reach.append(seen_slots)
        frees.append(free)
    # slot i may take token t if it holds t, t is free, or t's holder can move on to a free token or
    # around to the token i gives up
    return [{t for t in sets[i] if t not in slot_of or slot_of[t] == i or frees[slot_of[t]] or i in reach[slot_of[t]]}
            for i in range(len(sets))], []


@dataclass
class Request:
    prompt_ids: list[int]
    params: DecodeParams = field(default_factory=DecodeParams)
    request_id: object = None
    # Streaming: on_step(request, block) after every denoising step (provisional; mask id where unknown),
    # on_block(request, tokens) with the tokens that became final when a block finished.
    on_step: Callable[[Request, list[int]], None] | None = None
    on_block: Callable[[Request, list[int]], None] | None = None
    constraint: Constraint | None = None  # stateful: one per request, not shared
    slots: Slots | None = None  # the answer's layout (then max_new_tokens does not apply)


@dataclass
class BlockRecord:
    """One finished block, for fitting the block-size head: the hidden state the block started from,
    its size, the denoising steps it took and their wall time (at batch 1 the block's own: its forwards,
    the commit of the block before it, and the host's unmasking and grammar)."""

    hidden: torch.Tensor
    size: int
    steps: int
    seconds: float = 0.0


@dataclass
class Completion:
    request_id: object
    tokens: list[int]  # generated tokens, cut before a stop token / at a stop
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    forwards: int  # decoding forwards (a fused commit + step counts once); the prefill is not counted
    steps: int  # denoising steps
    blocks: int
    block_records: list[BlockRecord] | None = None  # with Engine(record_blocks=True)
    order: int = 0  # submission number within the engine

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(self.forwards, 1)
