"""Per-task accuracy on held-out prompts, for Clover (decoded by the engine, all prompts of a task
batched) and for its autoregressive peer (transformers' generate, one prompt at a time)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from tqdm import tqdm

from cloverlm import tasks
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request
from cloverlm.tokenizer import stop_token_ids
from cloverlm.training.data import TokenizedExample, heldout_examples

ANSWER_SLACK = 16


def answer_budget(encoded: TokenizedExample) -> int:
    """Max new tokens for a held-out example: its reference answer's length + ANSWER_SLACK."""
    return len(encoded.ids) - encoded.prompt_length + ANSWER_SLACK


def _clover_completions(model, examples, stop_ids, *, block_size, threshold, batch_size, calibration) -> Iterator:
    engine = Engine(model, max_batch_size=batch_size, calibration=calibration)
    for index, encoded in enumerate(examples):
        params = DecodeParams(
            max_new_tokens=answer_budget(encoded), block_size=block_size, threshold=threshold, stop_token_ids=stop_ids
        )
        engine.submit(Request(encoded.ids[: encoded.prompt_length], params, request_id=index))
    while engine.has_work():
        for completion in engine.step():
            yield completion.request_id, completion.tokens, completion.forwards


def _peer_completions(model, examples, stop_ids, prompt_lookup: int) -> Iterator:
    from cloverlm.convert.peer import peer_generate

    for index, encoded in enumerate(examples):
        prompt = encoded.ids[: encoded.prompt_length]
        tokens = peer_generate(model, prompt, answer_budget(encoded), stop_ids, prompt_lookup=prompt_lookup)
        yield index, tokens, len(tokens)  # counted as one forward per token, drafts or not


def evaluate_tasks(
    model,
    tokenizer,
    task_names,
    count: int,
    *,
    block_size: int | str = 16,
    threshold: float = 1.0,
    batch_size: int = 8,
    calibration=None,
    sizes: dict[str, dict[str, int]] | None = None,
    prompt_lookup: int = 0,
) -> dict:
    """Mean of each checker field over `count` held-out prompts per task, plus the tokens generated and
    tokens per forward.
    `model` is Clover or the peer (the decoding options are Clover's); `sizes` gives a generator's size
    arguments by task (e.g. {"no_fly_zones": {"n_messages": 4}}); block_size="auto" needs `calibration`;
    prompt_lookup is the peer's (see peer_generate)."""
    is_clover = model.config.model_type == "clover"
    report = {}
    for name in task_names:
        task = tasks.get_task(name)
        examples = heldout_examples(tokenizer, name, count, 1 << 30, **(sizes or {}).get(name, {}))
        if is_clover:
            completions = _clover_completions(
                model, examples, stop_token_ids(tokenizer), block_size=block_size, threshold=threshold,
                batch_size=batch_size, calibration=calibration,
            )  # fmt: skip
        else:
            completions = _peer_completions(model, examples, stop_token_ids(tokenizer), prompt_lookup)
        started = time.perf_counter()
        totals: dict[str, float] = {}
        tokens = forwards = 0
        for index, generated, used in tqdm(completions, total=len(examples), desc=name, leave=False):
            for key, value in task.check(examples[index].example, tokenizer.decode(generated)).items():
                totals[key] = totals.get(key, 0.0) + value
            tokens += len(generated)
            forwards += used
        report[name] = {key: round(value / count, 4) for key, value in totals.items()}
        report[name]["new_tokens"] = tokens
        report[name]["tokens_per_forward"] = round(tokens / max(forwards, 1), 3)
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
    return report
