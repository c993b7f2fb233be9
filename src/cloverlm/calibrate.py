"""Learnable block-size calibration (docs/design.md section 5): `block_size="auto"`.

A small head reads the hidden state a block starts from (the final hidden state of the last decoded
position) and predicts, for each candidate size n, how many denoising steps the next block would take
at the calibrated threshold. The decoder picks the size with the highest expected tokens per second,
n / (steps(n) * forward_ms(n)), where forward_ms is measured on the calibrating machine: a bigger block
only pays when the model is sure enough to fill it in few steps.

`clover calibrate --model DIR` fits the head on held-out prompts (disjoint from the evaluation seeds)
by decoding them at every candidate size and regressing log(steps) on the hidden state (ridge, closed
form), then judges auto against every fixed size on the evaluation prompts, and saves
calibration.json + calibration.safetensors into the model folder.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import tasks
from .cache import CloverCache
from .data import HELDOUT_SEED_BASE, encode_example
from .engine import AUTO, DecodeParams, Engine, Request
from .errors import CloverError
from .evaluate import stop_token_ids

CANDIDATE_SIZES = (1, 4, 8, 16, 32, 64)
CALIBRATION_SEED_BASE = HELDOUT_SEED_BASE + 500_000  # held out from training, apart from evaluation seeds
FILES = ("calibration.json", "calibration.safetensors")


@dataclass
class Calibration:
    block_sizes: list[int]
    threshold: float
    forward_ms: list[float]  # one denoising forward of each size, batch 1
    weight: torch.Tensor  # [S, H]: log(steps) = weight @ hidden + bias
    bias: torch.Tensor  # [S]
    prefill_block_size: int = 16

    def predicted_steps(self, hidden: torch.Tensor) -> torch.Tensor:
        steps = (self.weight @ hidden.float() + self.bias).exp()
        return torch.minimum(steps.clamp(min=1.0), torch.tensor(self.block_sizes, dtype=torch.float32))

    def choose(self, hidden: torch.Tensor) -> int:
        sizes = torch.tensor(self.block_sizes, dtype=torch.float32)
        speed = sizes / (self.predicted_steps(hidden) * torch.tensor(self.forward_ms))
        return self.block_sizes[int(speed.argmax())]

    def save(self, folder: Path, extra: dict | None = None) -> None:
        folder = Path(folder)
        save_file({"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}, str(folder / FILES[1]))
        meta = {
            "block_sizes": self.block_sizes,
            "threshold": self.threshold,
            "forward_ms": self.forward_ms,
            "prefill_block_size": self.prefill_block_size,
            **(extra or {}),
        }
        (folder / FILES[0]).write_text(json.dumps(meta, indent=1))


def load_calibration(folder: str | Path) -> Calibration | None:
    """The calibration saved in a model folder, or None if it was never calibrated."""
    folder = Path(folder)
    if not (folder / FILES[0]).exists():
        return None
    meta = json.loads((folder / FILES[0]).read_text())
    tensors = load_file(str(folder / FILES[1]))
    return Calibration(
        block_sizes=meta["block_sizes"],
        threshold=meta["threshold"],
        forward_ms=meta["forward_ms"],
        weight=tensors["weight"],
        bias=tensors["bias"],
        prefill_block_size=meta.get("prefill_block_size", 16),
    )


@torch.no_grad()
def measure_forward_ms(model, sizes, context: int = 256, repeats: int = 7) -> list[float]:
    """Median wall time of one denoising forward per block size at batch 1, against a short context."""
    cache = CloverCache.empty(model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, context))
    model.prefill(ids, [16] * (context // 16), cache)
    timings = []
    for size in sizes:
        block = torch.full((1, size), model.config.mask_token_id)
        model.decode(cache, step_ids=block)  # warm-up
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.decode(cache, step_ids=block)
            samples.append((time.perf_counter() - start) * 1000)
        timings.append(round(statistics.median(samples), 3))
    return timings


def calibration_prompts(tokenizer, count: int, seed_base: int, max_new_tokens: int) -> list[tuple[list[int], int, tasks.Example]]:
    """(prompt ids, answer budget, example) spread over the task suite."""
    names = tasks.SUITE
    out = []
    for i in range(count):
        encoded = encode_example(tokenizer, tasks.generate(names[i % len(names)], seed_base + i))
        budget = min(max_new_tokens, len(encoded.ids) - encoded.prompt_length + 8)
        out.append((encoded.ids[: encoded.prompt_length], budget, encoded.example))
    return out


def fit_head(records_by_size: dict[int, list], hidden_size: int, ridge: float = 1.0):
    """Ridge regression of log(steps) on [hidden, 1], one row of the head per size."""
    weight = torch.zeros(len(records_by_size), hidden_size)
    bias = torch.zeros(len(records_by_size))
    fit = {}
    for row, (size, records) in enumerate(records_by_size.items()):
        records = [r for r in records if r.size == size]  # full blocks only (not a short last block)
        if not records:
            bias[row] = math.log(size)  # never observed: assume no parallelism
            fit[size] = {"blocks": 0}
            continue
        x = torch.stack([r.hidden.float() for r in records])
        x = torch.cat([x, torch.ones(len(records), 1)], dim=1)
        y = torch.tensor([math.log(r.steps) for r in records])
        penalty = ridge * torch.eye(x.shape[1])
        penalty[-1, -1] = 0.0  # the intercept is not shrunk
        solution = torch.linalg.solve(x.T @ x + penalty, x.T @ y)
        weight[row], bias[row] = solution[:-1], solution[-1]
        residual = y - x @ solution
        fit[size] = {
            "blocks": len(records),
            "mean_steps": round(float(torch.tensor([r.steps for r in records], dtype=torch.float32).mean()), 3),
            "rmse_log_steps": round(float(residual.pow(2).mean().sqrt()), 4),
        }
    return weight, bias, fit


def decode_all(model, prompts, params_for, calibration=None, record: bool = False, desc: str = ""):
    """Decode every prompt alone (batch 1, as latency is measured); returns completions and wall seconds."""
    completions, seconds = [], 0.0
    engine = Engine(model, max_batch_size=1, calibration=calibration, record_blocks=record)
    for ids, budget, _ in tqdm(prompts, desc=desc, leave=False):
        start = time.perf_counter()
        [completion] = engine.generate([Request(ids, params_for(budget))])
        seconds += time.perf_counter() - start
        completions.append(completion)
    return completions, seconds


def calibrate(model, tokenizer, *, threshold: float = DecodeParams.threshold, fit_prompts: int = 16, eval_prompts: int = 8, max_new_tokens: int = 128, sizes=None):
    """Fit the block-size head and judge it against every fixed size. Returns (Calibration, report)."""
    if not 0 < threshold <= 1:
        raise CloverError(f"threshold must be in (0, 1], got {threshold}")
    sizes = [s for s in (sizes or CANDIDATE_SIZES) if s <= model.config.max_block_size]
    stops = stop_token_ids(tokenizer)

    def params_for(size):
        return lambda budget: DecodeParams(max_new_tokens=budget, block_size=size, threshold=threshold, stop_token_ids=stops)

    fit_set = calibration_prompts(tokenizer, fit_prompts, CALIBRATION_SEED_BASE, max_new_tokens)
    records = {}
    for size in sizes:
        completions, _ = decode_all(model, fit_set, params_for(size), record=True, desc=f"fit B={size}")
        records[size] = [r for c in completions for r in c.block_records]
    weight, bias, fit = fit_head(records, model.config.hidden_size)
    calibration = Calibration(sizes, threshold, measure_forward_ms(model, sizes), weight, bias)

    eval_set = calibration_prompts(tokenizer, eval_prompts, HELDOUT_SEED_BASE, max_new_tokens)
    judged = []
    for size in [*sizes, AUTO]:
        completions, seconds = decode_all(model, eval_set, params_for(size), calibration, desc=f"judge {size}")
        tokens = sum(len(c.tokens) for c in completions)
        accuracy = statistics.mean(
            tasks.get_task(example.task).check(example, tokenizer.decode(c.tokens))["exact"]
            for c, (_, _, example) in zip(completions, eval_set)
        )
        judged.append(
            {
                "block_size": size,
                "tpf": round(tokens / max(sum(c.forwards for c in completions), 1), 3),
                "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                "accuracy": round(accuracy, 4),
            }
        )
    return calibration, {"fit": fit, "evaluation": judged}
