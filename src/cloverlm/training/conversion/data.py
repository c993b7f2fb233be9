"""The conversion trainer's data: a mixture of task examples, self-distilled chat and (for distillation)
the model's own right answers, packed into rows of a step's batch.

Every step's examples are a pure function of (seed, step, row) and its masks of (seed, step), so a resumed
run replays exactly the batches an uninterrupted one sees.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from cloverlm import tasks
from cloverlm.convert.base import check_tokenizer
from cloverlm.errors import CloverError
from cloverlm.evaluation.chat import read_chat
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE, encode_example
from cloverlm.tasks.no_fly_zones import NoFlyZones
from cloverlm.tokenizer import end_of_turn_id, format_chat
from cloverlm.training.conversion.config import ConvertConfig
from cloverlm.training.conversion.objective import ConversionBatch, Segment, build_batch

# Sources the mixture may name: the tasks below, "chat" (data/chat_distill) and "distill" (trajectories).
TASK_SOURCES = ("no_fly_zones", "no_fly_zones_varied", "tool_call", "kv_retrieval", "arithmetic")


def read_trajectories(path: str | Path) -> list[dict]:
    """The kept (right) answers of a trajectories file written by training/conversion/distill.py."""
    path = Path(path)
    if not path.is_file():
        raise CloverError(f"distillation trajectories missing: {path} (make them with clover train --recipe distill)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in records if r["kept"]]
    if not kept:
        raise CloverError(f"{path} holds no right answer to distil ({len(records)} tried)")
    return kept


def sample_task_example(name: str, rng: random.Random, full_size_share: float,
                        distractor_weights: dict[str, float] | None = None) -> tasks.Example:
    """A training example of task `name` (never a held-out seed); a no_fly task has 20 messages with
    probability `full_size_share`, else 1..19, and no_fly_zones its distractors drawn by
    `distractor_weights` (texts of its own templates)."""
    seed = rng.randrange(HELDOUT_SEED_BASE)
    if isinstance(tasks.get_task(name), NoFlyZones):
        full = rng.random() < full_size_share
        n_messages = 20 if full else rng.randint(1, 19)
        weights = (distractor_weights or None) if name == "no_fly_zones" else None
        return tasks.generate(name, seed, n_messages=n_messages, distractor_weights=weights)
    if name == "kv_retrieval":
        return tasks.generate(name, seed, n_pairs=rng.randint(4, 60))
    return tasks.generate(name, seed)


class ConversionData:
    """Examples of the mixture as (prompt ids, answer ids) segments, and each step's batch."""

    def __init__(self, tokenizer, cfg: ConvertConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self.end_id = end_of_turn_id(tokenizer)
        self.mask_id = check_tokenizer(tokenizer)
        unknown = set(cfg.mixture) - set(TASK_SOURCES) - {"chat", "distill"}
        if unknown:
            raise CloverError(f"unknown mixture sources {sorted(unknown)}; choose from: {', '.join(TASK_SOURCES)}, chat, distill")
        self.chat = read_chat("train")[: cfg.chat_examples] if cfg.mixture.get("chat") else []
        if cfg.mixture.get("distill"):
            if not cfg.distill_data:
                raise CloverError("the mixture names 'distill' but no trajectories file is given (distill_data)")
            self.distill = read_trajectories(cfg.distill_data)

    def task_segment(self, name: str, seed: int, **size) -> Segment:
        return self.example_segment(tasks.generate(name, seed, **size))

    def example_segment(self, example: tasks.Example) -> Segment:
        encoded = encode_example(self.tokenizer, example)
        return Segment(encoded.ids[: encoded.prompt_length], encoded.ids[encoded.prompt_length :])

    def chat_segment(self, record: dict) -> Segment:
        prompt_text, _ = format_chat(self.tokenizer, record["prompt"])
        prompt = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        if record["finish"] == "stop":
            return Segment(prompt, list(record["answer_ids"]) + [self.end_id])
        return Segment(prompt, list(record["answer_ids"]), complete=False)  # cut at the distillation's limit

    def sample(self, rng: random.Random) -> Segment:
        sources = list(self.cfg.mixture)
        source = rng.choices(sources, [self.cfg.mixture[s] for s in sources])[0]
        if source == "chat":
            return self.chat_segment(rng.choice(self.chat))
        if source == "distill":  # the model's own right answer, which stopped at its end of turn
            record = rng.choice(self.distill)
            return Segment(record["prompt_ids"], record["answer_ids"] + [self.end_id])
        return self.example_segment(sample_task_example(source, rng, self.cfg.full_size_share, self.cfg.distractor_weights))

    def row_segments(self, step: int, row: int = 0) -> list[Segment]:
        """Examples for one row, packed up to tokens_per_step; an example that does not fit is skipped
        (three misses end the packing), except the first, which is taken whatever its size."""
        # row 0 keeps the seeding of one-row runs, so that their checkpoints resume on the same data
        rng = random.Random(f"{self.cfg.seed}/{step}" if row == 0 else f"{self.cfg.seed}/{step}/{row}")
        segments, used, misses = [], 0, 0
        while used < self.cfg.tokens_per_step and misses < 3:
            segment = self.sample(rng)
            size = len(segment.prompt) + len(segment.answer) + 16  # + block padding, on average
            if segments and used + size > self.cfg.tokens_per_step:
                misses += 1
                continue
            segments.append(segment)
            used += size
        return segments

    def step_batch(self, step: int, pad_multiple: int = 1, segmented: bool = False) -> ConversionBatch:
        """The batch of step `step`: rows_per_step packed rows, padded to a common shape (segmented: see
        objective.build_batch)."""
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        rows = [self.row_segments(step, row) for row in range(self.cfg.rows_per_step)]
        return build_batch(rows, self.end_id, self.mask_id, generator, pad_multiple=pad_multiple, segmented=segmented,
                           draws=self.cfg.noisy_draws)
