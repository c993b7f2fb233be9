"""One request's decoding state in the engine's batch: its block, draft, constraint and slots, and every
change to that state (the engine decides when; the row knows how)."""

from __future__ import annotations

import random
import time

import torch

from cloverlm.decoding.draft import PromptLookup
from cloverlm.decoding.params import BlockRecord, Request, distinct_choices


class DecodeRow:
    """A request in flight: its current block and what it has produced.

    `block` holds the tokens the current block decides (its targets), [MASK] where not yet chosen. Under
    a grammar a target may also be *unchecked*: a confident choice right of the grammar's reach, read by
    the model like a decided token and kept or remasked when the grammar gets to it."""

    def __init__(self, request: Request, order: int, mask_id: int, eos_id: int):
        self.request = request
        self.order = order
        self.params = request.params
        self.mask_id = mask_id
        self.stops = set(self.params.stop_token_ids) | {eos_id}
        self.generated: list[int] = []
        if request.constraint is not None:
            request.constraint.limit(self.params.max_new_tokens)
        self.last_token = request.prompt_ids[-1]  # slot 0 of the next block: the last token not in the cache
        self.pending_commit: list[int] | None = None  # the finished block's inputs, committed with the next step
        # A finished block whose last step ran exactly as its commit would: its keys, already written,
        # become history without a commit forward (Engine._commit_in_place).
        self.written_commit = 0
        self.step_ids: torch.Tensor | None = None  # the inputs and causal flags the last step ran with
        self.step_causal: torch.Tensor | None = None
        self.forwards = self.steps = self.blocks = 0
        self.finish_reason: str | None = None
        self.last_hidden: torch.Tensor | None = None  # final hidden state of the last position decoded
        self.block_records: list[BlockRecord] = []
        seed = self.params.seed if self.params.seed is not None else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)
        # no index where every block is one token: such a block reads no draft (step_inputs)
        self.lookup = PromptLookup(request.prompt_ids) if self.params.draft and self.params.block_size != 1 else None
        # the current block (start_block / start_slots)
        self.block = torch.zeros(0, dtype=torch.long)
        self.unchecked = torch.zeros(0, dtype=torch.bool)  # [block]: choices the grammar has not reached yet
        self.block_steps = 0
        self.initially_masked = 0
        self.block_start_hidden: torch.Tensor | None = None
        self.block_started = 0.0  # perf_counter when the current block opened (its BlockRecord's seconds)
        self.drafted = torch.zeros(0, dtype=torch.bool)  # [block]: targets the current step reads as drafts
        self.draft: torch.Tensor | None = None  # [block] the drafted tokens (where drafted)
        # slots: the tokens each position may take ([block, V]) and where the slots are
        self.allowed: torch.Tensor | None = None
        self.slot_positions: list[int] = []

    @property
    def context(self) -> int:
        """Tokens of history the next block reads: the prompt and the answer so far."""
        return len(self.request.prompt_ids) + len(self.generated)

    # -- a block's life --

    def start_block(self, block_size: int) -> None:
        size = min(block_size, self.params.max_new_tokens - len(self.generated))
        self.block_start_hidden = self.last_hidden
        self.block_started = time.perf_counter()
        self.block = torch.full((size,), self.mask_id)
        self.unchecked = torch.zeros(size, dtype=torch.bool)
        self.block_steps = 0
        self.initially_masked = size
        # Forced tokens fill the new block, except one position that stays masked: the block is run anyway
        # (the forward commits the previous one), and a block with nothing masked would never be stepped.
        self.fill_forced(0, keep_masked=1)

    def start_slots(self, vocab_size: int) -> None:
        slots = self.request.slots
        self.block_start_hidden = self.last_hidden
        self.block_started = time.perf_counter()
        self.block = torch.tensor([self.mask_id if token is None else token for token in slots.layout])
        self.unchecked = torch.zeros(len(self.block), dtype=torch.bool)
        self.block_steps = 0
        self.initially_masked = len(slots.options)
        self.allowed = torch.ones(len(self.block), vocab_size, dtype=torch.bool)
        self.slot_positions = [i for i, token in enumerate(slots.layout) if token is None]
        for position, options in zip(self.slot_positions, slots.options):
            self.allowed[position] = False
            self.allowed[position, options] = True
        if slots.distinct:
            self.keep_assignable()

    def block_inputs(self) -> torch.Tensor:
        """The block as the model reads it: the last committed token, then all targets except the last."""
        return torch.cat([torch.tensor([self.last_token]), self.block[:-1]])

    def prepare_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of the next step and which of them read causally ([block] each), kept as the step's.
        Without drafts these are block_inputs() and none. A draft runs from the first masked target on
        and stops before the first target already decided otherwise. A one-token block reads no draft
        (its only input is the committed token), so it gets none."""
        size = len(self.block)
        self.drafted = torch.zeros(size, dtype=torch.bool)
        self.step_ids, self.step_causal = self.block_inputs(), self.drafted
        masked = self.block == self.mask_id
        if (self.lookup is None or size == 1 or self.request.constraint is not None or self.allowed is not None
                or not bool(masked.any())):
            return self.step_ids, self.step_causal
        first = int(masked.nonzero()[0])
        proposal = self.lookup.propose(self.block[:first].tolist(), size - first)
        draft = self.block.clone()
        for offset, token in enumerate(proposal):
            position = first + offset
            if not masked[position]:
                if int(self.block[position]) != token:
                    break
                continue
            if token == self.mask_id:
                break
            draft[position] = token
            self.drafted[position] = True
        self.draft = draft
        self.step_ids = torch.cat([torch.tensor([self.last_token]), draft[:-1]])
        if bool(self.drafted.any()):
            # Input slot j holds target j - 1: from the first drafted input on, the block is read causally.
            self.step_causal = torch.arange(size) > int(self.drafted.nonzero()[0])
        return self.step_ids, self.step_causal

    def prefilled(self, last_hidden: torch.Tensor) -> None:
        """The prompt (except its last token) is in the cache; `last_hidden` is its last position's state."""
        self.last_hidden = last_hidden

    def take_written_commit(self) -> int:
        """How many keys the last step wrote that stand as the finished block's commit (then none)."""
        written, self.written_commit = self.written_commit, 0
        return written

    def after_forward(self, last_hidden: torch.Tensor) -> None:
        """A forward ran this row's step (and committed its finished block, if one was pending)."""
        self.pending_commit = None
        self.forwards += 1
        self.last_hidden = last_hidden

    def accept(self, tokens: torch.Tensor, accept: torch.Tensor) -> None:
        """Decide the targets where `accept` ([block] bool) holds, as `tokens`."""
        self.block = torch.where(accept, tokens, self.block)

    def decide(self, position: int, token: int) -> None:
        self.block[position] = token
        self.unchecked[position] = False

    def remask(self, position: int) -> None:
        self.block[position] = self.mask_id
        self.unchecked[position] = False

    def stop_at(self, position: int) -> None:
        """The target at `position` is a stop: the rest of the block is cut there anyway."""
        self.block[position:] = self.block[position].clone()
        self.unchecked[position:] = False

    def hold(self, tokens: torch.Tensor, keep: torch.Tensor) -> None:
        """Choose `tokens` where `keep` ([block] bool) holds, unchecked until the grammar reaches them."""
        self.accept(tokens, keep)
        self.unchecked |= keep

    def end_step(self) -> bool:
        """Count a denoising step; whether the block is decided (nothing masked or unchecked)."""
        self.block_steps += 1
        self.steps += 1
        if self.request.on_step is not None:
            self.request.on_step(self.request, self.block.tolist())
        return not bool((self.block == self.mask_id).any() or self.unchecked.any())

    def finish_block(self, record: bool) -> list[int]:
        """The decided block's tokens join the answer up to a stop; sets finish_reason when the answer is
        over. Returns the tokens that became final."""
        self.blocks += 1
        if record and self.block_start_hidden is not None:
            seconds = time.perf_counter() - self.block_started
            self.block_records.append(BlockRecord(self.block_start_hidden, len(self.block), self.block_steps, seconds))
        return self._join(self.block.tolist())

    def _join(self, tokens: list[int]) -> list[int]:
        """`tokens` join the answer up to a stop (token, stop string, the slots' layout or the budget)."""
        before = len(self.generated)
        for token in tokens:
            if token in self.stops:
                self.finish_reason = "stop"
                break
            self.generated.append(token)
        if self.finish_reason is None and self.params.stop is not None:
            keep = self.params.stop(self.generated)
            if keep is not None:
                del self.generated[keep:]
                self.finish_reason = "stop"
        if self.finish_reason is None and self.request.slots is not None:
            self.finish_reason = "stop"  # the layout is the whole answer
        if self.finish_reason is None and len(self.generated) >= self.params.max_new_tokens:
            # a grammar that closed on the budget's last token ended the answer, not the budget
            constraint = self.request.constraint
            self.finish_reason = "stop" if constraint is not None and constraint.finished() else "length"
        new = self.generated[before:]
        if self.request.on_block is not None and new:
            self.request.on_block(self.request, new)
        return new

    def next_block(self, block_size: int, commit_in_place: bool, jump_room: int = 0) -> None:
        """Open the next block after a finished one: its inputs become history, written by the last step
        already (commit_in_place) or committed with the next one. jump_room > 0 (Engine.jumps): a run the
        grammar forces that is at least a block long joins the answer now and the commit (of at most
        jump_room tokens) with it, and the block opens after the run: it costs one forward, as the peer's
        jump-forward, where blocks of forced tokens cost one each."""
        if self.lookup is not None:
            self.lookup.extend(self.block.tolist())
        commit = [] if commit_in_place else self.block_inputs().tolist()
        if commit_in_place:
            self.written_commit = len(self.block)
        self.last_token = int(self.block[-1])
        run = self._forced_run(block_size, jump_room - len(commit))
        if run:
            commit += [self.last_token] + run[:-1]
            self.last_token = run[-1]
            self._join(run)
            if self.lookup is not None:
                self.lookup.extend(run)
        self.pending_commit = commit or None
        if self.finish_reason is None:
            self.start_block(block_size)

    def _forced_run(self, block_size: int, room: int) -> list[int]:
        """The tokens the grammar forces from here (advanced over), when they fill a block: at most
        `room`, no stop token, and one token of the budget left for the block after them."""
        constraint = self.request.constraint
        if constraint is None or room < block_size:
            return []
        run = []
        for token in constraint.forced()[: min(room, self.params.max_new_tokens - len(self.generated) - 1)]:
            if token in self.stops:
                break
            run.append(token)
        if len(run) < block_size:
            return []
        for token in run:
            constraint.advance(token)
        return run

    # -- rules' helpers --

    def eligible(self, tokens: torch.Tensor) -> torch.Tensor:
        """[block] targets whose prediction read only drafts the model confirmed: those up to the first
        drafted target where the model's choice differs from the draft (all, without drafts). A target
        reads only the drafts before it (prepare_step makes the drafted part of the block causal)."""
        wrong = (self.drafted & (tokens != self.draft)).nonzero() if bool(self.drafted.any()) else None
        if wrong is None or not len(wrong):
            return torch.ones(len(self.block), dtype=torch.bool)
        return torch.arange(len(self.block)) <= int(wrong[0])

    def assignable_choices(self, fixed: dict[int, int] | None = None) -> dict[int, set[int]]:
        """Distinct slots: per open slot (masked, and not in `fixed`, {position: token}), the options that
        leave every open slot a different answer beside the ones taken."""
        fixed = fixed or {}
        taken = {int(self.block[p]) for p in self.slot_positions if self.block[p] != self.mask_id} | set(fixed.values())
        open_ = [(p, set(options) - taken) for p, options in zip(self.slot_positions, self.request.slots.options)
                 if self.block[p] == self.mask_id and p not in fixed]
        choices, _ = distinct_choices([options for _, options in open_])
        return {p: c for (p, _), c in zip(open_, choices)}

    def keep_assignable(self) -> None:
        """Keep each open distinct slot to its assignable options (a slot given only taken ones would never unmask)."""
        for position, choices in self.assignable_choices().items():
            self.allowed[position] = False
            self.allowed[position, sorted(choices)] = True

    def fill_forced(self, start: int, keep_masked: int = 0) -> int:
        """Under a constraint, write the grammar's forced tokens from position `start` on (the first
        undecided one); returns the position after them."""
        constraint = self.request.constraint
        if constraint is None:
            return start
        room = max(len(self.block) - keep_masked - start, 0)
        for token in constraint.forced()[:room]:
            self.decide(start, token)
            constraint.advance(token)
            start += 1
        return start

    def last_step(self) -> bool:
        """After this step the block's remaining masks are filled at once (max_steps)."""
        return self.block_steps + 1 >= (self.params.max_steps or len(self.block))

    def transfer_count(self) -> int:
        """low_confidence: how many positions this step unmasks (the block's masks spread evenly over
        its steps, the earlier steps taking the remainder)."""
        steps = min(self.params.steps or len(self.block), self.initially_masked)
        base, extra = divmod(self.initially_masked, steps)
        return base + (1 if self.block_steps < extra else 0)
