"""The trainer's held-out scores: Clover's masked-diffusion ELBO on held-out stdlib windows and its
copy probes, and the Evaluator that runs an architecture's metrics on them every eval_every steps.
(Task accuracy by decoding whole answers is evaluate.py.)"""

from __future__ import annotations

import random

import torch

from cloverlm.errors import CloverError
from cloverlm.evaluation.heldout import heldout_examples
from cloverlm.model.layout import fixed_partition
from cloverlm.training.scratch.diffusion import diffusion_loss, mask_blocks, shift_noise
from cloverlm.training.scratch.recipe import TrainConfig


@torch.no_grad()
def copy_probe(model, examples, block_size: int) -> float:
    """Accuracy on masked value tokens of task answers (ids, coordinates, values) with the rest given."""
    correct = total = 0
    for ex in examples:
        if not ex.value_positions:
            continue
        ids = torch.tensor([ex.ids], device=model.device)
        masked = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        masked[0, [p - 1 for p in ex.value_positions]] = True  # target index of token p is p - 1
        sizes = fixed_partition(ids.shape[1] - 1, block_size)
        noisy = shift_noise(ids, masked, sizes, model.config.mask_token_id)
        logits = model(ids[:, :-1], noisy, sizes, logits_mask=masked).logits
        correct += int((logits.argmax(-1) == ids[:, 1:][masked]).sum())
        total += int(masked.sum())
    return correct / max(total, 1)


@torch.no_grad()
def heldout_elbo(model, windows: torch.Tensor, block_size: int, seed: int = 1234) -> float:
    """Masked-diffusion ELBO per token on held-out stdlib windows (block size 1 = next-token NLL)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = fixed_partition(windows.shape[1] - 1, block_size)
    eligible = torch.ones_like(windows, dtype=torch.bool)
    noised = mask_blocks(
        windows, eligible, sizes, model.config.mask_token_id, generator, t_fixed=1.0 if block_size == 1 else None
    )
    return float(diffusion_loss(model, noised, sizes)[0])


def fitting_examples(tokenizer, task: str, count: int, max_len: int, size_key: str | None, full: int):
    """Held-out examples at the largest size (halving from `full`) whose prompts fit `max_len` tokens."""
    size = full
    while True:
        try:
            return heldout_examples(tokenizer, task, count, max_len, **({size_key: size} if size_key else {}))
        except CloverError:
            if size_key is None or size <= 1:
                raise
            size //= 2


class Evaluator:
    """Held-out windows and copy probes, scored by an architecture's `metrics`."""

    def __init__(self, tokenizer, cfg: TrainConfig, val_tokens: torch.Tensor, metrics):
        self.metrics = metrics
        rng = random.Random(99)
        length = min(cfg.seq_len, 512)
        starts = [rng.randrange(len(val_tokens) - length) for _ in range(4)]
        self.windows = torch.stack([val_tokens[s : s + length] for s in starts]).long()
        # Full-size prompts when the context allows, fewer messages / pairs when it does not.
        self.probe = {
            task: fitting_examples(tokenizer, task, cfg.probe_examples, cfg.seq_len, key, full)
            for task, key, full in (
                ("no_fly_zones", "n_messages", 20),
                ("kv_retrieval", "n_pairs", 60),
                ("tool_call", None, 0),
                ("repeat", "n_items", 8),
            )
        }

    def __call__(self, model, autocast) -> dict[str, float]:
        was_training = model.training
        model.eval()
        with autocast():
            metrics = self.metrics(model, self.windows.to(model.device), self.probe)
        metrics["copy"] = sum(metrics[f"copy_{t}_b1"] for t in self.probe) / len(self.probe)
        model.train(was_training)
        return metrics
