"""The decoding engine: block-diffusion generation for a batch of requests, on token ids.

Shifted convention (docs/design.md section 1a): every slot predicts the token after it. A block that will hold
tokens x_s .. x_{s+B-1} is run as [x_{s-1}, x_s or MASK, ..., x_{s+B-2} or MASK] at positions
s-1 .. s+B-2, so its first slot is the last committed token and the cache lags one token behind the
text. Per request: the prompt except its last token is prefilled as clean blocks of the request's block
size; the last prompt token opens the first block. Each denoising step runs the block against the
request's cache and unmasks positions by one of two rules:

* "threshold" (Fast-dLLM): every masked position whose confidence (probability of the chosen token)
  is at least `threshold`, and always the most confident one; after `max_steps` steps the rest at once.
* "low_confidence" (LLaDA): a fixed number of steps per block, each unmasking its share of the
  block's positions, most confident first.

A finished block's inputs are committed in the same forward as the first step of the next block (the
fused step of `CloverForBlockDiffusion.decode`); its last token opens the next block. The last block of
a request is never committed: nothing will read it. At block size 1 this is greedy autoregressive
decoding, token for token.

Continuous batching at block granularity: requests join (after their own prefill) and leave between
forwards; the batch holds blocks of different sizes, padded, and caches of different lengths. Each
request's result is the same as decoding it alone (greedy), tested.

Constrained decoding: a request may carry a `Constraint` (a grammar over token ids, e.g. a JSON
schema). A grammar reads left to right, so under one only the leftmost run of masked positions may be
decided in a step: the first masked position always, each next one while its grammar-masked choice
passes the rule; every candidate is drawn from logits masked by the grammar state after the tokens
before it. Tokens the grammar forces (e.g. `{"name":`) are filled in without a model step; a forced run
that would fill the next block is committed with it instead, in one forward (jump-forward). The rules
themselves live in cloverlm.decoding.unmask; the engine runs the forwards and the blocks' lives.

Slots: a request may instead give its whole answer as a fixed layout (`Slots`): one block holding the
layout's tokens with [MASK] at the slots, each slot restricted to its options. The slots are unmasked by
the usual rule in any order, so every answer is chosen seeing the others (joint decisions).

The engine knows nothing of tokenizers or HTTP: stop strings come in as a callable over token ids.
"""

from __future__ import annotations

from collections import deque

import torch

from cloverlm.decoding.params import (
    AUTO,
    MAX_BATCH_SIZE,
    Completion,
    Request,
    distinct_choices,
    drafts_supported,
)
from cloverlm.decoding.row import DecodeRow
from cloverlm.decoding.unmask import unmask
from cloverlm.errors import CloverError, check_token_ids
from cloverlm.model.cache import CloverCache
from cloverlm.model.clover import CloverForBlockDiffusion
from cloverlm.model.layout import fixed_partition


class Engine:
    """Continuous batching of block-diffusion requests over one model.

    submit() queues requests; step() admits waiting ones (prefill), runs one batched forward and returns
    the requests that finished; run() steps until everything is done.
    """

    def __init__(
        self, model: CloverForBlockDiffusion, max_batch_size: int = MAX_BATCH_SIZE, calibration=None, record_blocks: bool = False,
        batched_unmask: bool = True, lookahead: bool = False, jump_forward: bool = True,
    ):
        """calibration: a `cloverlm.decoding.calibration.Calibration`, needed for block_size="auto".
        record_blocks: keep a BlockRecord per finished block in each Completion (calibration fitting).
        batched_unmask=False decides every row on the host, one by one (the reference the batched rule
        is tested against). lookahead: under a grammar, keep confident choices right of the grammar's
        reach, unchecked until it gets there (cloverlm.decoding.unmask); off (the default), only the
        leftmost run commits. A held choice was made before the tokens left of it were, and nothing
        checks it against them but the grammar: on the step-535 adapter (20 no_fly prompts, B = 16) it
        cost zone exact 0.531 -> 0.468 under the plain schema and 0.671 -> 0.642 grounded, for TPF
        +3.8% and +0.4% (models/README.md). jump_forward (the default): a forced run at least a block long is
        committed in one forward (DecodeRow.next_block), where the model's committed tokens see only
        those before them (causal_clean_stream, attention layers only): there a commit's extent changes
        nothing it computes."""
        self.batched_unmask = batched_unmask
        self.lookahead = lookahead
        if max_batch_size < 1:
            raise CloverError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.model = model.eval()
        # Ids and caches go to the model's device; logits and hidden states come back to the CPU, where
        # the unmasking rules, sampling generators, grammars and the calibration head live.
        self.device = next(model.parameters()).device
        self.calibration = calibration
        self.record_blocks = record_blocks
        self.config = model.config
        self.jumps = jump_forward and self.config.causal_clean_stream and drafts_supported(self.config)
        self.max_batch_size = max_batch_size
        self.waiting: deque[DecodeRow] = deque()
        self.rows: list[DecodeRow] = []
        self.cache: CloverCache | None = None
        self._submitted = 0
        self.forwards = 0  # batched forwards run by this engine

    # -- requests --

    def submit(self, request: Request) -> None:
        if not request.prompt_ids:
            raise CloverError("empty prompt: give at least one token")
        check_token_ids(request.prompt_ids, self.config.vocab_size, "prompt token ids")
        if self.config.mask_token_id in request.prompt_ids:
            # a [MASK] in the prompt's leftover block would be "denoised" and overwrite the prompt
            raise CloverError(f"the prompt contains the mask token id {self.config.mask_token_id}; it is reserved for decoding")
        request.params.validate(self.config.max_block_size)
        if request.params.draft and not drafts_supported(self.config):
            raise CloverError("drafts need an all-attention model (config.layer_types without memory layers)")
        if request.params.block_size == AUTO and self.calibration is None:
            raise CloverError('block_size="auto" needs a calibrated model: run `clover calibrate --model DIR` first')
        if request.slots is not None:
            self._check_slots(request)
        self.waiting.append(DecodeRow(request, self._submitted, self.config.mask_token_id, self.config.eos_token_id))
        self._submitted += 1

    def _check_slots(self, request: Request) -> None:
        slots, vocab = request.slots, self.config.vocab_size
        if request.constraint is not None:
            raise CloverError("a request takes slots or a constraint, not both")
        if not 1 <= len(slots.layout) <= self.config.max_block_size:
            raise CloverError(f"a slot layout is one block: 1..{self.config.max_block_size} tokens, got {len(slots.layout)}")
        if sum(token is None for token in slots.layout) != len(slots.options) or not all(slots.options):
            raise CloverError("slots need one non-empty list of options per None in the layout")
        reserved = {self.config.mask_token_id, self.config.eos_token_id, *request.params.stop_token_ids}
        tokens = [t for t in slots.layout if t is not None] + [t for options in slots.options for t in options]
        if any(not 0 <= t < vocab or t in reserved for t in tokens):
            raise CloverError(f"slot layout and options must be ordinary token ids in 0..{vocab - 1} (no mask or stop ids)")
        crowded = distinct_choices(slots.options)[1] if slots.distinct else []
        if crowded:  # they could never all unmask
            raise CloverError(f"distinct slots {', '.join(str(i + 1) for i in crowded)} have fewer options between them than slots")

    def cancel(self, request: Request) -> bool:
        """Drop a request, waiting or in the batch (with its cache rows), at once; False if it is not here
        (finished or never submitted). The others' results are unchanged."""
        for index, row in enumerate(self.waiting):
            if row.request is request:
                del self.waiting[index]
                return True
        for index, row in enumerate(self.rows):
            if row.request is request:
                keep = [i for i in range(len(self.rows)) if i != index]
                self.rows = [self.rows[i] for i in keep]
                self.cache = self.cache.select(keep) if keep else None
                return True
        return False

    def end(self, request: Request, reason: str) -> Completion | None:
        """Drop a request like `cancel`, returning what it has produced (its finished blocks) with `reason`
        as finish_reason (e.g. a server's time limit); None if it is not here."""
        row = next((row for row in (*self.waiting, *self.rows) if row.request is request), None)
        if row is None:
            return None
        self.cancel(request)
        row.finish_reason = reason  # its own: the row was decoding and is dropped as it stands
        return self._completion(row)

    def _completion(self, row: DecodeRow) -> Completion:
        return Completion(
            row.request.request_id, row.generated, row.finish_reason, len(row.request.prompt_ids),
            row.forwards, row.steps, row.blocks, row.block_records if self.record_blocks else None, row.order,
        )

    def has_work(self) -> bool:
        return bool(self.waiting or self.rows)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Decode a batch of requests to the end; completions in the order given."""
        if not requests:
            raise CloverError("empty batch: give at least one request")
        for request in requests:
            self.submit(request)
        return self.run()

    def run(self) -> list[Completion]:
        done: list[Completion] = []
        while self.has_work():
            done += self.step()
        return sorted(done, key=lambda completion: completion.order)

    # -- the loop --

    @torch.no_grad()
    def _admit(self) -> None:
        joined = []
        while self.waiting and len(self.rows) + len(joined) < self.max_batch_size:
            row = self.waiting.popleft()
            prompt, size = row.request.prompt_ids, row.params.block_size
            cache = CloverCache.empty(self.config, 1, device=self.device)
            if size == AUTO:
                size = self.calibration.prefill_block_size
            history = prompt[:-1]  # the last prompt token opens the first block (shifted convention)
            if history:
                partition = fixed_partition(len(history), size)
                ids = torch.tensor([history], device=self.device)
                row.prefilled(self.model.prefill(ids, partition, cache)[0].float().cpu())
                # the whole answer's keys fit without regrowing (a block may overhang the budget)
                cache.reserve(len(prompt) + row.params.max_new_tokens + self.config.max_block_size)
            if row.request.slots is not None:
                row.start_slots(self.config.vocab_size)
            elif row.params.block_size == AUTO:
                row.start_block(self._auto_size(row))
            else:
                row.start_block(size)
            joined.append((row, cache))
        if joined:
            caches = ([self.cache] if self.rows else []) + [cache for _, cache in joined]
            self.cache = CloverCache.concat(caches) if len(caches) > 1 else caches[0]
            self.rows += [row for row, _ in joined]

    @torch.no_grad()
    def step(self) -> list[Completion]:
        """Admit waiting requests, run one forward for the batch, return the requests that finished."""
        self._admit()
        if not self.rows:
            return []
        pad = self.config.mask_token_id
        written = [row.take_written_commit() for row in self.rows]
        if any(written):
            self.cache.keep_written(torch.tensor(written))
        commits = [row.pending_commit or [] for row in self.rows]
        commit_ids = commit_valid = None
        if any(commits):
            commit_ids, commit_valid = _pad([torch.tensor(c, dtype=torch.long) for c in commits], pad, self.device)
        inputs = [row.prepare_step() for row in self.rows]
        step_ids, step_valid = _pad([ids for ids, _ in inputs], pad, self.device)
        step_causal = None
        if any(bool(drafts.any()) for _, drafts in inputs):
            step_causal = _pad([drafts.long() for _, drafts in inputs], 0, self.device)[0].bool()
        logits, hidden = self.model.decode(
            self.cache, commit_ids, commit_valid, step_ids, step_valid, step_causal=step_causal
        )
        logits[..., self.config.mask_token_id] = float("-inf")  # never "unmask" to [MASK]
        ends = torch.tensor([len(row.block) - 1 for row in self.rows], device=hidden.device)
        last_hidden = hidden[torch.arange(len(self.rows), device=hidden.device), ends].float().cpu()
        self.forwards += 1
        for index, row in enumerate(self.rows):  # before denoising: a block finished now sets its commit
            row.after_forward(last_hidden[index])
        decided = unmask(self.rows, logits, batched=self.batched_unmask, lookahead=self.lookahead)
        finished, keep = [], []
        for index, (row, block_done) in enumerate(zip(self.rows, decided)):
            if block_done:
                self._end_block(row)
            if row.finish_reason is None:
                keep.append(index)
            else:
                finished.append(self._completion(row))
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.cache = self.cache.select(keep) if keep else None
        return finished

    def _end_block(self, row: DecodeRow) -> None:
        row.finish_block(self.record_blocks)
        if row.finish_reason is None:
            size = self._auto_size(row) if row.params.block_size == AUTO else row.params.block_size
            row.next_block(size, self._commit_in_place(row), self.config.max_block_size if self.jumps else 0)

    def _auto_size(self, row: DecodeRow) -> int:
        """block_size="auto": the calibration's choice for the row's next block, by its kind and history."""
        return self.calibration.choose(row.last_hidden, row.request.constraint is not None, row.context)

    def _commit_in_place(self, row: DecodeRow) -> bool:
        """Whether the finished block's last step computed its commit already: same inputs (all final),
        the commit's attention pattern (causal under causal_clean_stream, bidirectional otherwise; one
        token is both) and attention layers only. Then its keys stand as written: at block size 1 this
        halves the work per token."""
        if not drafts_supported(self.config) or not torch.equal(row.step_ids, row.block_inputs()):
            return False
        if len(row.block) == 1:
            return True
        if self.config.causal_clean_stream:
            return bool(row.step_causal[1:].all())
        return not bool(row.step_causal.any())


def _pad(blocks: list[torch.Tensor], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D blocks into [B, n] ids and a validity mask, on `device`."""
    width = max(len(b) for b in blocks)
    ids = torch.full((len(blocks), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(blocks), width, dtype=torch.bool)
    for i, block in enumerate(blocks):
        ids[i, : len(block)] = block
        valid[i, : len(block)] = True
    return ids.to(device), valid.to(device)
