"""The `block_sizes` and `thresholds` sections of `clover bench`: Clover's TPF and accuracy on one task
per block size (and "auto" when calibrated) and per confidence threshold, each answer decoded as
options.answers says (under its grounded schema by default: forced runs change which size pays)."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from tqdm import tqdm

from cloverlm.bench.options import BenchModels, BenchOptions, accuracy, clover_params, prompt_ids
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.params import AUTO, Request
from cloverlm.evaluation.evaluate import answer_grammar
from cloverlm.evaluation.heldout import heldout_examples
from cloverlm.tasks import get_task
from cloverlm.tokenizer import stop_token_ids


def bench_block_sizes(models: BenchModels, options: BenchOptions) -> list[dict]:
    """Clover's TPF and accuracy per block size at the bench's threshold, plus "auto" when calibrated."""
    block_sizes: list[int | str] = list(options.sweep_block_sizes)
    if models.calibration is not None:
        block_sizes.append(AUTO)
    else:
        note = f"block-size sweep without {AUTO!r}: {models.folders.get('clover')} has no calibration (clover calibrate)"
        tqdm.write(note, file=sys.stderr)
    return _sweep(models, options, [(size, options.threshold) for size in block_sizes], "block sizes")


def bench_thresholds(models: BenchModels, options: BenchOptions) -> list[dict]:
    """Clover's TPF and accuracy per confidence threshold at the bench's block size."""
    return _sweep(models, options, [(options.block_size, threshold) for threshold in options.sweep_thresholds], "thresholds")


def _sweep(models: BenchModels, options: BenchOptions, settings: list[tuple[int | str, float]], desc: str) -> list[dict]:
    """One row per (block size, threshold). Each request is decoded alone, as a user's request is, prompt
    by prompt with every setting in turn (interleaved against the machine's drift): tokens_per_s is
    one request's speed, the thing a block size is chosen for. In a batch a forward's cost grows with the
    rows times the block's positions, so larger blocks would lose there what they win alone."""
    tokenizer = models.tokenizer
    examples = heldout_examples(tokenizer, options.sweep_task, options.sweep_prompts, 1 << 30)
    grammars = Grammars(tokenizer, models.clover.config.vocab_size, stop_token_ids(tokenizer))
    grammar = [answer_grammar(grammars, get_task(options.sweep_task), e.example, options.answers) for e in examples]
    engine = Engine(models.clover, max_batch_size=1, calibration=models.calibration)
    totals = {setting: {"tokens": 0, "forwards": 0, "seconds": [], "scores": []} for setting in settings}
    for example, g in tqdm(list(zip(examples, grammar)), desc=f"{desc} ({options.sweep_task})"):
        for setting in settings:
            block_size, threshold = setting
            params = dataclasses.replace(clover_params(example, options, tokenizer, block_size), threshold=threshold)
            start = time.perf_counter()
            [completion] = engine.generate([Request(prompt_ids(example), params, constraint=None if g is None else grammars.constraint(g))])
            total = totals[setting]
            total["seconds"].append(time.perf_counter() - start)
            total["tokens"] += len(completion.tokens)
            total["forwards"] += completion.forwards
            total["scores"].append(accuracy(options.sweep_task, example, completion.tokens, tokenizer))
    return [
        {
            "block_size": block_size,
            "threshold": threshold,
            "tpf": round(total["tokens"] / max(total["forwards"], 1), 3),
            "tokens_per_s": round(total["tokens"] / sum(total["seconds"]), 2),
            "median_s": round(statistics.median(total["seconds"]), 3),
            "accuracy": round(statistics.mean(total["scores"]), 4),
            "answers": options.answers,
        }
        for (block_size, threshold), total in totals.items()
    ]
