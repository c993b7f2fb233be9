"""The default training mixture: standard-library source plus the project's task generators.

Every batch is a pure function of (seed, step): resuming a run replays exactly the same data without
saving any iterator state. Task examples for training use seeds below HELDOUT_SEED_BASE
(cloverlm.evaluation.heldout), so held-out prompts are never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from cloverlm import tasks
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE, encode_example
from cloverlm.tokenizer import train_tokenizer
from cloverlm.training.scratch.corpus import read_source, stdlib_files

DEFAULT_VOCAB_SIZE = 8192  # `clover tokenizer --vocab-size` and the trainer's default tokenizer


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, task_samples: int = 400):
    """Byte-level BPE over the stdlib train split plus rendered task examples (so JSON keys and message
    vocabulary get their own tokens)."""
    def texts():
        for path in stdlib_files("train"):
            text = read_source(path)
            if text:
                yield text
        for name in tasks.TASKS:
            for seed in range(task_samples):
                example = tasks.generate(name, seed)
                yield example.prompt + "\n" + example.answer

    return train_tokenizer(texts(), vocab_size=vocab_size)


def tokenize_stdlib(tokenizer, split: str, every: int = 1) -> torch.Tensor:
    """Every `every`-th file of a split as one stream of token ids, documents separated by end-of-text."""
    stream: list[int] = []
    texts = [t for t in (read_source(p) for p in stdlib_files(split)[::every]) if t]
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.int32)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    is_prompt: torch.Tensor  # [B, L] bool: chat prompt tokens
    is_pad: torch.Tensor  # [B, L] bool

    def eligible(self, chat_mode: bool) -> torch.Tensor:
        """Positions that may be masked and scored."""
        ok = ~self.is_pad
        return ok & ~self.is_prompt if chat_mode else ok


class Mixture:
    """Samples training rows: stdlib windows or packed task examples, by weight."""

    def __init__(
        self,
        tokenizer,
        weights: dict[str, float],
        seq_len: int,
        stdlib_tokens: torch.Tensor | None,
        task_sizes: dict[str, dict[str, tuple[int, int]]] | None = None,
    ):
        unknown = set(weights) - set(tasks.TASKS) - {"stdlib"}
        if unknown:
            raise ValueError(f"unknown mixture sources {sorted(unknown)}")
        self.tokenizer = tokenizer
        self.sources = [name for name, w in weights.items() if w > 0]
        self.weights = [weights[name] for name in self.sources]
        self.seq_len = seq_len
        self.stdlib_tokens = stdlib_tokens
        self.pad_id = tokenizer.pad_token_id
        self.task_sizes = task_sizes or {}

    def row(self, rng: random.Random) -> tuple[list[int], list[bool]]:
        source = rng.choices(self.sources, self.weights)[0]
        if source == "stdlib":
            start = rng.randrange(len(self.stdlib_tokens) - self.seq_len)
            return self.stdlib_tokens[start : start + self.seq_len].tolist(), [False] * self.seq_len
        ids: list[int] = []
        is_prompt: list[bool] = []
        while True:  # pack whole examples of this task until the next one does not fit
            size = {key: rng.randint(lo, hi) for key, (lo, hi) in self.task_sizes.get(source, {}).items()}
            encoded = encode_example(self.tokenizer, tasks.generate(source, rng.randrange(HELDOUT_SEED_BASE), **size))
            if len(ids) + len(encoded.ids) > self.seq_len:
                if ids:
                    break
                continue  # a single example longer than the context: draw another
            ids += encoded.ids
            is_prompt += [True] * encoded.prompt_length + [False] * (len(encoded.ids) - encoded.prompt_length)
        return ids, is_prompt

    def batch(self, seed: int, step: int, batch_size: int) -> Batch:
        rows = [self.row(random.Random(f"{seed}/{step}/{r}")) for r in range(batch_size)]
        input_ids = torch.full((batch_size, self.seq_len), self.pad_id, dtype=torch.long)
        is_prompt = torch.zeros(batch_size, self.seq_len, dtype=torch.bool)
        is_pad = torch.ones(batch_size, self.seq_len, dtype=torch.bool)
        for r, (ids, prompt) in enumerate(rows):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            is_prompt[r, : len(ids)] = torch.tensor(prompt)
            is_pad[r, : len(ids)] = False
        return Batch(input_ids, is_prompt, is_pad)
