"""`clover calibrate --model DIR`: fit the block-size heads (cloverlm.decoding.calibration) on held-out
prompts (disjoint from the evaluation seeds) by decoding them at every candidate size and regressing
log(steps) on the hidden state (ridge, closed form), then judge auto against every fixed size on the
evaluation prompts. Two kinds of request, each with its own head and its own prompts: free answers
over the whole task suite, and constrained ones (the tasks whose answers have a schema or a tool-call
grammar, under the plain and the grounded schema in turn), as the server and the demo decode them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from cloverlm import tasks
from cloverlm.decoding.calibration import Calibration
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.params import AUTO, DecodeParams, Request, drafts_supported
from cloverlm.errors import CloverError
from cloverlm.evaluation.evaluate import answer_grammar
from cloverlm.evaluation.heldout import HELDOUT_SEED_BASE, encode_example
from cloverlm.model.cache import CloverCache
from cloverlm.model.layout import fixed_partition
from cloverlm.tokenizer import stop_token_ids

CANDIDATE_SIZES = (1, 4, 8, 16, 32, 64)
CALIBRATION_SEED_BASE = HELDOUT_SEED_BASE + 500_000  # held out from training, apart from evaluation seeds
# calibrate()'s defaults, which `clover calibrate` reads: prompts to fit each head on, prompts to judge
# it on, and the most new tokens of each. Whole answers: a 20-message no_fly answer is about 390 tokens,
# and fitted on answers cut at 96 the constrained head saw 14 blocks of 32 and expected 4.3 steps of them
# where the demo's answer takes 1.6 (models/README.md).
FIT_PROMPTS = 16
EVAL_PROMPTS = 8
MAX_NEW_TOKENS = 512
KINDS = {"free": ("free",), "constrained": ("schema", "grounded")}  # a head per kind; the answer modes it is fitted on
# The long context bare forwards are timed at beside the fit prompts' (Calibration.ms_per_1k_context):
# about a 20-message no_fly prompt, the demo's and the benchmark's.
LONG_CONTEXT = 2048
SHORT_CONTEXT = 256  # measure_forward_ms's default


@torch.no_grad()
def measure_forward_ms(model, sizes, context: int = SHORT_CONTEXT, repeats: int = 7) -> list[float]:
    """Median wall time of one denoising forward per block size at batch 1, behind `context` tokens
    prefilled as the engine prefills for block_size="auto"."""
    cache = CloverCache.empty(model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, context))
    model.prefill(ids, fixed_partition(context, Calibration.prefill_block_size), cache)
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


def context_slopes(model, sizes, context: int, forward_ms: list[float], long_context: int = LONG_CONTEXT) -> list[float]:
    """Per size, the milliseconds a bare forward adds per 1,000 tokens of history: `forward_ms` (timed at
    `context`) against forwards timed at `long_context` (within the model's positions). Never negative:
    a forward cannot get cheaper with more to attend to, whatever the timer's noise says."""
    long_context = min(long_context, model.config.max_position_embeddings - max(sizes))
    if long_context <= context:
        return [0.0] * len(sizes)
    long_ms = measure_forward_ms(model, sizes, context=long_context)
    return [round(max(far - near, 0.0) * 1000 / (long_context - context), 3) for near, far in zip(forward_ms, long_ms)]


def recost(model, calibration: Calibration) -> Calibration:
    """The calibration with its costs timed again on this machine, its heads kept: bare forwards at its
    forward_context and at LONG_CONTEXT; each step cost keeps what the host added to the bare forward
    where it was fitted (step_ms - forward_ms), a cost of this machine's process rather than its kernels."""
    context = calibration.forward_context or SHORT_CONTEXT  # older calibrations timed forwards there
    forward_ms = measure_forward_ms(model, calibration.block_sizes, context=context)
    step_ms = calibration.step_ms and {
        kind: [round(step - old + new, 3) for step, old, new in zip(ms, calibration.forward_ms, forward_ms)]
        for kind, ms in calibration.step_ms.items()
    }
    slopes = context_slopes(model, calibration.block_sizes, context, forward_ms)
    return replace(calibration, forward_ms=forward_ms, step_ms=step_ms, forward_context=context, ms_per_1k_context=slopes)


def calibration_prompts(tokenizer, count: int, seed_base: int, max_new_tokens: int, grammars: Grammars | None = None,
                        modes: tuple[str, ...] = ("free",)) -> list[tuple]:
    """(prompt ids, answer budget, example, grammar or None) spread over the task suite, the answer modes
    (decoding.grounding.ANSWER_MODES) taken in turn; under a schema mode only prompts whose answer has a
    grammar count."""
    names, out, seed = tasks.SUITE, [], seed_base
    while len(out) < count:
        if seed - seed_base > 100 * count:
            raise CloverError(f"no task of the suite has answers under {modes}")
        example = tasks.generate(names[seed % len(names)], seed)
        mode = modes[len(out) % len(modes)]
        grammar = None if mode == "free" else answer_grammar(grammars, tasks.get_task(example.task), example, mode)
        seed += 1
        if mode != "free" and grammar is None:
            continue
        encoded = encode_example(tokenizer, example)
        budget = min(max_new_tokens, len(encoded.ids) - encoded.prompt_length + 8)
        out.append((encoded.ids[: encoded.prompt_length], budget, example, grammar))
    return out


def full_blocks(records: list, size: int) -> list:
    """The records of blocks decoded at their full `size` (not an answer's short last block): what the head
    and the step costs are fitted on."""
    return [r for r in records if r.size == size]


# The head's ridge, in units of the mean feature variance (so the grid means the same at any hidden size
# and norm), chosen per size by leave-one-out error. A refit sees a dozen blocks of the large sizes against
# 576 features: a fixed small ridge interpolated them (fit error 0.002 in log steps) and chose sizes by noise.
RIDGE_GRID = tuple(10.0**e for e in range(-3, 5))


@torch.no_grad()
def fit_head(records_by_size: dict[int, list], hidden_size: int, ridge: float | None = None):
    """Ridge regression of log(steps) on [hidden, 1], one row of the head per size; the intercept is not
    shrunk. ridge None: chosen from RIDGE_GRID by leave-one-out error (`_ridge_by_loo`); a number: that ridge
    in the same units. The fit reports that error (`loo_rmse_log_steps`), what a new block can expect."""
    weight = torch.zeros(len(records_by_size), hidden_size)
    bias = torch.zeros(len(records_by_size))
    fit = {}
    for row, (size, records) in enumerate(records_by_size.items()):
        records = full_blocks(records, size)
        if not records:
            bias[row] = math.log(size)  # never observed: assume no parallelism
            fit[size] = {"blocks": 0}
            continue
        x = torch.stack([r.hidden.double() for r in records])
        y = torch.tensor([math.log(r.steps) for r in records], dtype=torch.float64)
        mean_steps = statistics.mean(r.steps for r in records)
        fit[size] = {"blocks": len(records), "mean_steps": round(mean_steps, 3)}
        if len(records) < 3:  # no error to judge a ridge by: the mean alone
            bias[row] = math.log(mean_steps)
            continue
        w, b, alpha, loo = _ridge_by_loo(x, y, RIDGE_GRID if ridge is None else (ridge,))
        # A size's tokens per second divide by its mean steps, not by exp(mean log steps), which is smaller the
        # more a size's steps vary (the large ones): with log-normal errors the mean is exp(mu + var / 2).
        weight[row], bias[row] = w.float(), b + loo**2 / 2
        fit[size] |= {"ridge": alpha, "rmse_log_steps": round(float((y - x @ w - b).pow(2).mean().sqrt()), 4),
                      "loo_rmse_log_steps": round(loo, 4)}  # fmt: skip
    return weight, bias, fit


def _ridge_by_loo(x: torch.Tensor, y: torch.Tensor, grid) -> tuple[torch.Tensor, float, float, float]:
    """(weight, bias, ridge, leave-one-out rmse): the largest ridge of the grid whose leave-one-out squared
    error is within one standard error of the least one (the one-standard-error rule: with a dozen blocks the
    least error alone often picks a small ridge by chance). One eigendecomposition of the centred Gram
    matrix serves every ridge: a ridge fit's leave-one-out residual is its residual over 1 - leverage, the
    leverage of row i being 1/n + sum_j (x_i . v_j)^2 / (s_j + ridge)."""
    n = len(y)
    x_mean, y_mean = x.mean(0), y.mean()
    xc, yc = x - x_mean, y - y_mean
    s, v = torch.linalg.eigh(xc.T @ xc)
    s = s.clamp(min=0.0)
    scale = float(s.sum()) / (x.shape[1] * n) or 1.0  # the mean feature variance
    projected, target = xc @ v, v.T @ (xc.T @ yc)
    fits = []
    for alpha in sorted(grid, reverse=True):
        shrink = 1.0 / (s + alpha * scale)
        w = v @ (shrink * target)
        leverage = 1.0 / n + (projected.pow(2) * shrink).sum(1)
        squared = ((yc - xc @ w) / (1.0 - leverage).clamp(min=1e-9)).pow(2)
        fits.append((alpha, w, float(squared.mean()), float(squared.std()) / math.sqrt(n)))
    _, _, least, error = min(fits, key=lambda fit: fit[2])
    alpha, w, mse, _ = next(fit for fit in fits if fit[2] <= least + error)  # largest ridge first
    return w, float(y_mean - x_mean @ w), alpha, math.sqrt(mse)


def step_costs(records_by_size: dict[int, list], forward_ms: list[float]) -> list[float]:
    """Milliseconds a denoising step of each size cost in the decodes the head was fitted on (its full
    blocks' wall time over their steps, at batch 1). A size without a full block gets its bare forward
    plus the median of what the host added to a step at the sizes that have one."""
    bare = dict(zip(records_by_size, forward_ms))
    measured = {}
    for size, records in records_by_size.items():
        if full := full_blocks(records, size):
            measured[size] = 1000 * sum(r.seconds for r in full) / sum(r.steps for r in full)
    added = [ms - bare[size] for size, ms in measured.items()]
    host = statistics.median(added) if added else 0.0
    return [round(measured.get(size, forward + host), 3) for size, forward in bare.items()]


def decode_all(model, prompts, params_for, grammars=None, calibration=None, record: bool = False, desc: str = ""):
    """Decode every prompt alone (batch 1, as latency is measured), under its grammar where it has one;
    returns completions and wall seconds."""
    completions, seconds = [], 0.0
    engine = Engine(model, max_batch_size=1, calibration=calibration, record_blocks=record)
    for ids, budget, _, grammar in tqdm(prompts, desc=desc, leave=False):
        start = time.perf_counter()
        constraint = None if grammar is None else grammars.constraint(grammar)
        [completion] = engine.generate([Request(ids, params_for(budget), constraint=constraint)])
        seconds += time.perf_counter() - start
        completions.append(completion)
    return completions, seconds


def calibrate(model, tokenizer, *, threshold: float = DecodeParams.threshold, fit_prompts: int = FIT_PROMPTS,
              eval_prompts: int = EVAL_PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS, sizes=None, draft: bool | None = None):
    """Fit the block-size heads (free and constrained requests) and judge each against every fixed size.
    Returns (Calibration, report).

    draft: decode with prompt-lookup drafts, as the model will be served (default: where the model
    supports them); the steps a block takes depend on it."""
    if not 0 < threshold <= 1:
        raise CloverError(f"threshold must be in (0, 1], got {threshold}")
    draft = drafts_supported(model.config) if draft is None else draft
    sizes = [s for s in (sizes or CANDIDATE_SIZES) if s <= model.config.max_block_size]
    stops = stop_token_ids(tokenizer)

    def params_for(size):
        return lambda budget: DecodeParams(max_new_tokens=budget, block_size=size, threshold=threshold,
                                           stop_token_ids=stops, draft=draft)

    grammars = Grammars(tokenizer, model.config.vocab_size, stops)
    heads, fits, fit_sets, records_by_kind = {}, {}, {}, {}
    for kind, modes in KINDS.items():
        fit_sets[kind] = calibration_prompts(tokenizer, fit_prompts, CALIBRATION_SEED_BASE, max_new_tokens, grammars, modes)
        records = {}
        for size in sizes:
            completions, _ = decode_all(model, fit_sets[kind], params_for(size), grammars, record=True, desc=f"fit {kind} B={size}")
            records[size] = [r for c in completions for r in c.block_records]
        *heads[kind], fits[kind] = fit_head(records, model.config.hidden_size)
        records_by_kind[kind] = records
    # Forward cost depends on the context it attends to: measure it at the fit prompts' median length.
    context = int(statistics.median(len(ids) for fit_set in fit_sets.values() for ids, *_ in fit_set))
    forward_ms = measure_forward_ms(model, sizes, context=context)
    step_ms = {kind: step_costs(records, forward_ms) for kind, records in records_by_kind.items()}
    calibration = Calibration(sizes, threshold, forward_ms, *heads["free"], constrained=tuple(heads["constrained"]),
                              step_ms=step_ms, forward_context=context,
                              ms_per_1k_context=context_slopes(model, sizes, context, forward_ms))

    judged = []
    for kind, modes in KINDS.items():
        eval_set = calibration_prompts(tokenizer, eval_prompts, HELDOUT_SEED_BASE, max_new_tokens, grammars, modes)
        for size in [*sizes, AUTO]:
            completions, seconds = decode_all(model, eval_set, params_for(size), grammars, calibration, desc=f"judge {kind} {size}")
            tokens = sum(len(c.tokens) for c in completions)
            accuracy = statistics.mean(
                tasks.get_task(example.task).check(example, tokenizer.decode(c.tokens))["exact"]
                for c, (_, _, example, _) in zip(completions, eval_set)
            )
            judged.append(
                {
                    "requests": kind,
                    "block_size": size,
                    "tpf": round(tokens / max(sum(c.forwards for c in completions), 1), 3),
                    "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                    "accuracy": round(accuracy, 4),
                }
            )
    return calibration, {"fit": fits, "evaluation": judged, "draft": draft, "forward_context": context}
