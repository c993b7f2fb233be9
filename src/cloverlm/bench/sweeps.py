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
    """One row per (block size, threshold): the sweep prompts decoded as one batch. Only tokens and
    forwards are compared here (a batched request decodes as it would alone); tokens_per_s is the
    batch's throughput, not a latency."""
    tokenizer = models.tokenizer
    examples = heldout_examples(tokenizer, options.sweep_task, options.sweep_prompts, 1 << 30)
    grammars = Grammars(tokenizer, models.clover.config.vocab_size, stop_token_ids(tokenizer))
    grammar = [answer_grammar(grammars, get_task(options.sweep_task), e.example, options.answers) for e in examples]
    rows = []
    for block_size, threshold in tqdm(settings, desc=f"{desc} ({options.sweep_task})"):
        params = [dataclasses.replace(clover_params(e, options, tokenizer, block_size), threshold=threshold) for e in examples]
        engine = Engine(models.clover, max_batch_size=len(examples), calibration=models.calibration)
        start = time.perf_counter()
        completions = engine.generate([
            Request(prompt_ids(e), p, constraint=None if g is None else grammars.constraint(g)) for e, p, g in zip(examples, params, grammar)])
        seconds = time.perf_counter() - start
        tokens = sum(len(completion.tokens) for completion in completions)
        scores = [accuracy(options.sweep_task, e, c.tokens, tokenizer) for e, c in zip(examples, completions)]
        rows.append(
            {
                "block_size": block_size,
                "threshold": threshold,
                "tpf": round(tokens / sum(completion.forwards for completion in completions), 3),
                "tokens_per_s": round(tokens / seconds, 2),
                "accuracy": round(statistics.mean(scores), 4),
                "answers": options.answers,
            }
        )
    return rows
